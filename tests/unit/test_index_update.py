"""NumPy indexing on traced tensors (integer arrays, constant boolean masks, None, Ellipsis), take's modes, and
JAX's functional updates ``x.at[key]`` (ops/gather.py): against NumPy (indexing, ``np.put``-style assignment,
``np.add.at`` / ``np.minimum.at`` / ... on copies), on the simulated meshes with the indexed dim split and
not, even and uneven shapes, and the VJPs against central finite differences."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_gather import INDEX_UPDATE_CASES, check_partitioned, check_reference, simulated_meshes
from simulated import assert_all_ranks

MASK = np.array([[True, False, True, False, False], [False, True, False, False, True],
                 [True, True, False, True, False], [False, False, False, False, True],
                 [True, False, False, False, False], [False, True, True, False, False]])

# keys of x (6, 5, 4); NumPy computes the expectation of each
KEYS = {
    "last_kept": np.s_[:, [-1], :],
    "two_adjacent": np.s_[[0, 2, 5], [3, -4, 0]],
    "two_adjacent_after_slice": np.s_[:, [0, 2], [1, 3]],
    "separated_go_first": np.s_[[1, 4], :, [0, 3]],
    "mask_2d": np.s_[MASK],
    "mask_one_dim": np.s_[:, MASK[1]],
    "none_separates": np.s_[None, 1, [0, 2], None],
    "ellipsis_then_array": np.s_[..., [1, 1, 0]],
    "broadcast_arrays": np.s_[[[0], [5]], :, [[1, 2]]],
    "int_and_array_adjacent": np.s_[1, [0, 4]],
    "reversed_slice_then_array": np.s_[::-1, [2, 0]],
    "array_none_array": np.s_[[2, 0], None, [1, 2]],
    "negative_array": np.s_[np.array([-1, -6])],
    "empty_list": np.s_[[]],
    "int_slice_array": np.s_[0, 1:3, [3]],
    "2d_array_then_int": np.s_[:, np.array([[1, 2], [3, 0]]), 2],
    "array_ellipsis_array": np.s_[[1, 2], ..., [0, 3]],
    "strided_slice_array": np.s_[1::2, [4, 0, 4]],
}


@pytest.mark.parametrize("name", KEYS)
def test_getitem_matches_numpy(name):
    x = np.arange(120.0).reshape(6, 5, 4)
    key = KEYS[name]
    got = sr.evaluate(sr.trace(lambda t: t[key], x), x)[0]
    assert got.shape == x[key].shape
    np.testing.assert_array_equal(got, x[key])


def test_traced_index_arrays_wrap_negatives_once_and_clamp_the_rest():
    x, ids = np.arange(120.0).reshape(6, 5, 4), np.array([[-1, 2], [7, -9]])
    a, b = sr.evaluate(sr.trace(lambda t, i: (t[:, i], t[i, 1:3, i]), x, ids), x, ids)
    clamp = lambda n: np.clip(np.where(ids < 0, ids + n, ids), 0, n - 1)
    np.testing.assert_array_equal(a, x[:, clamp(5)])
    np.testing.assert_array_equal(b, x[clamp(6), 1:3, clamp(4)])


def test_take_modes_follow_jax():
    t, ids = np.arange(12.0).reshape(4, 3), np.array([[-1, 0], [5, -7]])
    fns = lambda t, i: (snp.take(t, i), snp.take(t, i, mode="clip"), snp.take(t, i, mode="wrap"),
                        snp.take(t, i, mode="fill", fill_value=-1.0), snp.take(t.astype("int32"), i))
    fill, clip, wrap, filled, ints = sr.evaluate(sr.trace(fns, t, ids), t, ids)
    np.testing.assert_array_equal(clip, np.take(t, ids, axis=0, mode="clip"))
    np.testing.assert_array_equal(wrap, np.take(t, ids, axis=0, mode="wrap"))
    np.testing.assert_array_equal(fill[0], t[[3, 0]])  # -1 is the last row (it was clamped to row 0 before)
    assert np.isnan(fill[1]).all() and (filled[1] == -1).all() and (ints[1] == np.iinfo("int32").min).all()


@pytest.mark.parametrize("key,error,match", [
    (np.s_[[0, 6]], IndexError, "index 6 is out of bounds for axis 0 with size 6"),
    (np.s_[:, [0.5]], IndexError, "integers or booleans; got dtype float64"),
    (np.s_[MASK[:, :4]], IndexError, r"mask must match the dims it indexes; got mask shape \(6, 4\)"),
    (np.s_[[0], [0], [0], [0]], IndexError, "too many indices"),
])
def test_getitem_errors_state_the_rule(key, error, match):
    with pytest.raises(error, match=match):
        sr.trace(lambda t: t[key], sr.TensorSpec((6, 5, 4)))


def test_a_traced_boolean_mask_says_to_use_where():
    with pytest.raises(IndexError, match="snp.where"):
        sr.trace(lambda t: t[t > 0], sr.TensorSpec((6, 5)))


# ---------------------------------------------------------------- x.at[key]
def np_update(x, key, values, kind):
    """NumPy's own: assignment (repeats: the last wins) or the ufunc's ``at`` on a copy."""
    out = x.copy()
    if kind == "set":
        out[key] = values
    else:
        {"add": np.add, "mul": np.multiply, "min": np.minimum, "max": np.maximum}[kind].at(out, key, values)
    return out


UPDATE_KEYS = {
    "rows_repeated": np.s_[[1, 4, 1, -1]],
    "cols": np.s_[:, [0, 3, 3]],
    "two_arrays": np.s_[[0, 5, 0], :, [1, 2, 1]],
    "mask": np.s_[MASK],
    "basic_window": np.s_[1:4, 2],
    "int_row": np.s_[-2],
    "strided": np.s_[::2, 1:],
    "none_and_ellipsis": np.s_[None, ..., 1],
}
KINDS = ["set", "add", "mul", "min", "max"]
METHOD = {"set": "set", "add": "add", "mul": "multiply", "min": "min", "max": "max"}


def _values(x, key, seed=3):
    return np.random.default_rng(seed).standard_normal(x[key].shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", UPDATE_KEYS)
def test_at_updates_match_numpy(name, kind):
    x = np.random.default_rng(1).standard_normal((6, 5, 4))
    key = UPDATE_KEYS[name]
    v = _values(x, key)
    got = sr.evaluate(sr.trace(lambda t, u: getattr(t.at[key], METHOD[kind])(u), x, v), x, v)[0]
    np.testing.assert_array_equal(got, np_update(x, key, v, kind))


def test_at_set_repeated_index_the_last_wins_and_get_subtract_divide():
    x = np.zeros((4, 2))
    fn = lambda t: (t.at[[1, 1, 1]].set(np.array([[1.0], [2.0], [3.0]])), t.at[2].subtract(1.5),
                    (t + 2.0).at[[0, 0]].divide(2.0), t.at[[3]].get())
    s, d, q, g = sr.evaluate(sr.trace(fn, x), x)
    np.testing.assert_array_equal(s[1], [3.0, 3.0])
    np.testing.assert_array_equal(d[2], [-1.5, -1.5])
    np.testing.assert_array_equal(q[0], [0.5, 0.5])
    assert g.shape == (1, 2)


def test_traced_indices_out_of_range_are_dropped_by_updates():
    x, ids = np.zeros((5, 2)), np.array([-1, 7, 2, -8])
    fn = lambda t, i: (t.at[i].set(1.0), t.at[i].add(1.0), t.at[i, 1].max(4.0))
    s, a, m = sr.evaluate(sr.trace(fn, x, ids), x, ids)
    want = np.zeros((5, 2))
    want[[4, 2]] = 1.0
    np.testing.assert_array_equal(s, want)
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(m[:, 1], [0, 0, 4, 0, 4])


def test_kv_cache_update_at_a_traced_position_is_a_dynamic_update_slice():
    cache, new = np.zeros((2, 6, 3), "float32"), np.ones((2, 3), "float32")
    graph = sr.trace(lambda c, n, p: c.at[:, p].set(n), cache, new, np.int64(4))
    assert "dynamic_update_slice" in [n.op for n in graph.nodes]
    for pos in (4, -1):
        got = sr.evaluate(graph, cache, new, np.int64(pos))[0]
        want = cache.copy()
        want[:, pos] = new
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- partitioned, every mesh
MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [sr.Mesh((2, 2), ("x", "y")),
                                                                 sr.Mesh((2, 4), ("x", "y"))]
SHAPES = [(8, 4, 6), (6, 5, 4), (7, 5, 3)]  # even on most meshes, uneven on 4 / 8, uneven everywhere


def _specs(mesh, ndim):
    axes = mesh.axis_names
    yield [None] * ndim  # replicated
    yield [axes[0]] + [None] * (ndim - 1)  # the indexed dim 0 split
    yield [None, axes[-1]] + [None] * (ndim - 2)
    if len(axes) == 2:
        yield [axes[0], axes[1]] + [None] * (ndim - 2)


def _partitioned_cases():
    for mesh in MESHES:
        for shape in SHAPES[:2] if mesh.size in (3, 6) else SHAPES:
            for k, spec in enumerate(_specs(mesh, len(shape))):
                yield pytest.param(mesh, shape, spec, id=f"{mesh}-{shape}-spec{k}")


def _program_fn(t, u, i, p):
    return (t[:, [-1, 0]], t[i], t[i, :, i], t[1, [0, 2]],
            t.at[i].set(u), t.at[i].add(u), t.at[i].min(u), t.at[:, [0, 2, 0]].max(3.0),
            t.at[[1, 1]].multiply(2.0), t.at[p].set(-1.0), t.at[:, p].add(5.0))


def _np_fn(x, u, ids, pos):
    n0, n1 = x.shape[0], x.shape[1]
    ci = np.clip(np.where(ids < 0, ids + n0, ids), 0, n0 - 1)
    ck = np.clip(np.where(ids < 0, ids + x.shape[2], ids), 0, x.shape[2] - 1)
    drop = ids[(ids >= -n0) & (ids < n0)]
    uu = u[(ids >= -n0) & (ids < n0)]
    return (x[:, [-1, 0]], x[ci], x[ci, :, ck], x[1, [0, 2]],
            np_update(x, drop, uu, "set"), np_update(x, drop, uu, "add"), np_update(x, drop, uu, "min"),
            np_update(x, np.s_[:, [0, 2, 0]], 3.0, "max"), np_update(x, [1, 1], 2.0, "mul"),
            np_update(x, pos % n0, -1.0, "set"), np_update(x, np.s_[:, pos % n1], 5.0, "add"))


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh,shape,spec", list(_partitioned_cases()))
def test_partitioned_indexing_and_updates_match_numpy(mesh, shape, spec):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    ids = np.array([shape[0] - 1, 0, -2, shape[0] + 3, 1])  # one out of range: clamped by x[i], dropped by .at
    u = rng.standard_normal((len(ids),) + shape[1:])
    pos = np.int64(-1)
    graph = sr.trace(_program_fn, x, u, ids, pos)
    program = sr.partition(graph, mesh, in_specs=[spec, None, None, None])
    assert_all_ranks(program, [x, u, ids, pos], _np_fn(x, u, ids, int(pos)))


# ---------------------------------------------------------------- VJPs against central differences
def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[k] = eps
        g[k] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


VJP_CASES = {
    "getitem_two_arrays": lambda t, u: snp.sum(t[[0, 2, 2], :, [1, 0, 1]] ** 2.0),
    "getitem_mask": lambda t, u: snp.sum(snp.tanh(t[MASK[:4]])),
    "set": lambda t, u: snp.sum(t.at[[1, 3, 1]].set(u) ** 3.0),
    "add": lambda t, u: snp.sum(t.at[[1, 3, 1]].add(u) ** 3.0),
    "min": lambda t, u: snp.sum(t.at[[1, 3, 1]].min(u) ** 3.0),
    "max": lambda t, u: snp.sum(t.at[[1, 3, 1]].max(u) ** 3.0),
    "multiply_unique": lambda t, u: snp.sum(t.at[[2, 0, 1]].multiply(u) ** 3.0),
    "window_add": lambda t, u: snp.sum(t.at[1:4, 2].add(u[:, 0]) ** 3.0),
}


@pytest.mark.parametrize("name", VJP_CASES)
def test_vjp_matches_central_differences(name):
    rng = np.random.default_rng(5)
    x, u = rng.standard_normal((4, 5, 3)), rng.standard_normal((3, 5, 3))
    f = VJP_CASES[name]
    graph = sr.trace(lambda t, v: grad(f, argnums=(0, 1))(t, v), x, u)
    gx, gu = sr.evaluate(graph, x, u)
    value = lambda a, b: float(sr.evaluate(sr.trace(f, a, b), a, b)[0])
    np.testing.assert_allclose(gx, _numeric_grad(lambda a: value(a, u), x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gu, _numeric_grad(lambda b: value(x, b), u), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the case table (also run under MPI)
CASE_PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in INDEX_UPDATE_CASES
               for i, s in enumerate(c.specs) for m in simulated_meshes()]


@pytest.mark.parametrize("case", INDEX_UPDATE_CASES, ids=lambda c: c.name)
def test_case_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", CASE_PARAMS)
def test_case_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


def test_at_with_a_traced_boolean_mask_is_a_where():
    x = np.arange(12.0).reshape(4, 3)
    fn = lambda t: (t.at[t > 5.0].set(0.0), t.at[t[:, 0] > 2.0].add(1.0), t.at[t < 3.0].max(2.0))
    s, a, m = sr.evaluate(sr.trace(fn, x), x)
    np.testing.assert_array_equal(s, np.where(x > 5.0, 0.0, x))
    np.testing.assert_array_equal(a, np.where((x[:, 0] > 2.0)[:, None], x + 1.0, x))
    np.testing.assert_array_equal(m, np.where(x < 3.0, np.maximum(x, 2.0), x))
    with pytest.raises(IndexError, match="takes a scalar value"):
        sr.trace(lambda t: t.at[t > 0].set(np.ones((4, 3))), x)
