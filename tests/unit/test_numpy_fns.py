"""The non-elementwise NumPy coverage (issue 28: ops/creation.py, manipulation.py, sorting.py, reductions.py,
linalg.py, the prod reduction kind): the case table against NumPy (reference evaluator) and partitioned on the
simulated meshes (1..8 ranks, 1-d and 2-d, reordered devices, even and uneven), the plans' collectives
(sorted axis gathered, product all-reduce), edge semantics, bad input, and VJPs by central differences."""
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from op_cases_numpy_fns import CASES
from simulated import assert_all_ranks, collectives

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x3 = sr.Mesh((2, 3), ("x", "y"))


def evaluate(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


# ---------------------------------------------------------------- the partitioned plans
def _reduce_ops(program):
    """The ``op`` of every all-reduce (or its nonblocking start) in program order."""
    return [i.attrs["op"] for i in program.instrs if i.op in ("all_reduce", "all_reduce_start")]


def test_sort_gathers_only_the_sorted_axis_and_keeps_the_other_split():
    """Rows split over x, the sorted axis over y: one all-gather over y; the rows stay split over x."""
    x = np.random.default_rng(0).standard_normal((6, 12))
    graph = sr.trace(lambda a: snp.sort(a, axis=1), x)
    program = sr.partition(graph, MESH_2x3, in_specs=[("x", "y")])
    assert collectives(program) == [("all_gather", ("y",))]
    assert program.outputs[0].sharding == sr.Sharding((("x",), ()))
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


def test_sort_along_an_unsplit_axis_moves_nothing():
    x = np.random.default_rng(1).standard_normal((8, 5))
    graph = sr.trace(lambda a: (snp.sort(a, axis=1, descending=True), snp.argsort(a, axis=1)), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None)])
    assert collectives(program) == []
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


def test_take_along_axis_keeps_the_indices_layout():
    """Indices split along the gathered axis itself: the array is gathered whole, the indices never move."""
    x = np.random.default_rng(2).standard_normal((4, 12))
    idx = np.random.default_rng(3).integers(-12, 12, (4, 8))
    graph = sr.trace(lambda a, i: snp.take_along_axis(a, i, axis=1), x, idx)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x"), (None, "x")])
    assert collectives(program) == [("all_gather", ("x",))]
    assert program.outputs[0].sharding == sr.Sharding(((), ("x",)))
    assert_all_ranks(program, [x, idx], [np.take_along_axis(x, idx, axis=1)])


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)], ids=["even", "uneven"])
def test_prod_of_a_split_axis_is_a_product_all_reduce(shape):
    """Uneven: the padding is masked with 1 (the product's identity) before the local product."""
    x = np.random.default_rng(4).uniform(0.5, 2.0, shape)
    graph = sr.trace(lambda a: snp.prod(a, axis=0), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None)])
    assert collectives(program) == [("all_reduce", ("x",))] and _reduce_ops(program) == ["prod"]
    assert ("mask_padding" in [i.op for i in program.instrs]) == (shape[0] % 4 != 0)
    assert_all_ranks(program, [x], [np.prod(x, axis=0)], tol=1e-12)


def test_any_all_reduce_bools_with_logical_collectives_and_no_cast():
    x = np.zeros((8, 3))
    x[5, 1] = 1.0  # one true entry, on rank 2 only
    graph = sr.trace(lambda a: (snp.any(a > 0.5, axis=0), snp.all(a < 0.5, axis=0)), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None)])
    assert [k for k, _ in collectives(program)] == ["all_reduce"] * 2 and sorted(_reduce_ops(program)) == ["max", "min"]
    assert_all_ranks(program, [x], [np.array([False, True, False]), np.array([True, False, True])])


def test_global_norm_for_gradient_clipping_is_one_all_reduce():
    """The 2-norm of a tensor split over both axes: local sum of squares, one all-reduce over the whole mesh."""
    x = np.random.default_rng(5).standard_normal((6, 9))
    graph = sr.trace(lambda a: snp.linalg.norm(a), x)
    program = sr.partition(graph, MESH_2x3, in_specs=[("x", "y")])
    assert [c["kind"] for c in program.comm_summary()] == ["all_reduce"]
    assert_all_ranks(program, [x], [np.array(np.linalg.norm(x))], tol=1e-12)


# ---------------------------------------------------------------- semantics at the edges
def test_sort_descending_keeps_equal_entries_in_their_order_and_nans_first():
    x = np.array([[1.0, 3.0, np.nan, 3.0, -2.0, 3.0]])
    values, order = evaluate(lambda a: (snp.sort(a, descending=True), snp.argsort(a, descending=True)), x)
    np.testing.assert_array_equal(values, [[np.nan, 3.0, 3.0, 3.0, 1.0, -2.0]])
    np.testing.assert_array_equal(order, [[2, 1, 3, 5, 0, 4]])
    (ascending,) = evaluate(lambda a: snp.argsort(a), x)
    np.testing.assert_array_equal(ascending, [[4, 0, 1, 3, 5, 2]])  # NaN last, ties in order
    assert order.dtype == np.int64


def test_take_along_axis_fills_or_clips_out_of_range_indices():
    x = np.array([[1.0, 2.0, 3.0]])
    idx = np.array([[-1, 3, -4, 0]])
    (filled,) = evaluate(lambda a, i: snp.take_along_axis(a, i, axis=1), x, idx)
    np.testing.assert_array_equal(filled, [[3.0, np.nan, np.nan, 1.0]])
    (clipped,) = evaluate(lambda a, i: snp.take_along_axis(a, i, axis=1, mode="clip"), x, idx)
    np.testing.assert_array_equal(clipped, [[3.0, 3.0, 1.0, 1.0]])
    (ints,) = evaluate(lambda a, i: snp.take_along_axis(a, i, axis=1), x.astype(np.int32), idx)
    assert ints[0, 1] == np.iinfo(np.int32).min


def test_searchsorted_puts_nan_probes_after_the_numbers():
    a = np.array([0.0, 1.0, 1.0, np.nan])
    v = np.array([-1.0, 1.0, 5.0, np.nan])
    for side in ("left", "right"):
        (got,) = evaluate(lambda t: snp.searchsorted(a, t, side=side), v)
        np.testing.assert_array_equal(got, np.searchsorted(a, v, side=side))


def test_static_size_selections_pad_and_collapse_nans():
    x = np.array([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, np.nan]])
    rows, cols = evaluate(lambda a: snp.nonzero(a, size=6, fill_value=-1), x)
    np.testing.assert_array_equal(rows, [0, 0, 1, 1, -1, -1])
    np.testing.assert_array_equal(cols, [1, 3, 0, 3, -1, -1])
    y = np.array([3.0, 1.0, 1.0, np.nan, 2.0, np.nan, 3.0, 3.0])
    values, counts = evaluate(lambda a: snp.unique(a, return_counts=True, size=6), y)
    np.testing.assert_array_equal(values, [1.0, 2.0, 3.0, np.nan, 1.0, 1.0])  # padded with the smallest
    np.testing.assert_array_equal(counts, [2, 1, 3, 2, 0, 0])
    (cut,) = evaluate(lambda a: snp.unique(a, size=2, fill_value=9.0), y)
    np.testing.assert_array_equal(cut, [1.0, 2.0])
    with pytest.raises(ValueError, match="needs a static size="):
        sr.trace(lambda a: snp.nonzero(a), x)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # 0 / 0 for the mean, as NumPy warns
def test_nan_extremes_of_an_all_nan_slice_are_nan():
    x = np.array([[np.nan, 1.0], [np.nan, -2.0]])
    got = evaluate(lambda a: (snp.nanmax(a, axis=0), snp.nanmin(a, axis=0), snp.nanmean(a, axis=0)), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = [np.nanmax(x, axis=0), np.nanmin(x, axis=0), np.nanmean(x, axis=0)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_creation_defaults_and_keywords():
    x = np.ones((2, 3), np.int32)
    outs = evaluate(lambda a: (snp.zeros_like(a), snp.full_like(a, 7, dtype="float64", shape=(4,)), snp.empty((2,)),
                               snp.eye(3), snp.linspace(0, 1, 3), snp.asarray(a, dtype="float32", copy=True)), x)
    assert [o.dtype for o in outs] == [np.int32, np.float64, np.float32, np.float32, np.float32, np.float32]
    np.testing.assert_array_equal(outs[1], [7.0] * 4)
    np.testing.assert_array_equal(outs[2], [0.0, 0.0])  # a program has no uninitialised memory: zeros
    np.testing.assert_array_equal(outs[4], [0.0, 0.5, 1.0])


def test_constants_and_dtype_names_are_numpys():
    assert (snp.pi, snp.e, snp.inf, snp.newaxis) == (np.pi, np.e, np.inf, None) and np.isnan(snp.nan)
    assert snp.float32 is np.float32 and snp.int64 is np.int64 and snp.bool is np.bool_
    assert snp.finfo("float32").eps == np.finfo(np.float32).eps and snp.iinfo("int8").max == 127
    (y,) = evaluate(lambda a: a[:, snp.newaxis] * snp.pi, np.ones(3))
    assert y.shape == (3, 1)


@pytest.mark.parametrize("call, match", [
    (lambda a: snp.split(a, 4, axis=1), "split into 4 equal sections needs a dim they divide"),
    (lambda a: snp.repeat(a, [1, 2], axis=1), r"repeat needs non-negative counts, one or one per entry"),
    (lambda a: snp.tril(a[0]), "tril needs an array of rank >= 2"),
    (lambda a: snp.eye(a.shape[0], k=1.5), "eye's k must be a static int"),
    (lambda a: snp.linalg.norm(a, 3), "matrix_norm's ord must be one of"),
    (lambda a: snp.linalg.vector_norm(a, ord="fro"), "vector_norm's ord must be"),
    (lambda a: snp.take_along_axis(a, a, axis=0), "take_along_axis needs integer indices"),
    (lambda a: snp.take_along_axis(a, np.zeros(3, np.int64), axis=0), "indices of arr's rank"),
    (lambda a: snp.asarray(np.ones(2), copy=False), r"asarray\(copy=False\) cannot avoid a copy"),
    (lambda a: snp.zeros_like(a, device="gpu:0"), "device= must be None"),
    (lambda a: snp.meshgrid(a, indexing="xx"), "indexing must be 'xy' or 'ij'"),
    (lambda a: snp.var(a, ddof=1, correction=1), "var takes ddof or correction, not both"),
    (lambda a: snp.cumulative_sum(a), "cumulative_sum needs axis= for an array of rank > 1"),
    (lambda a: snp.diagonal(a, 0, 1, 1), "diagonal needs two different axes"),
    (lambda a: snp.tensordot(a, a, ([0], [1])), "tensordot contracts pairs of equal-size axes"),
])
def test_bad_input_is_refused_naming_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        sr.trace(call, sr.TensorSpec((3, 5)))


# ---------------------------------------------------------------- gradients against central differences
def _numeric_grad(f, x, eps=1e-6):
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        out[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return out


def _desc(m, a, axis):
    return -np.sort(-a, axis=axis) if m is np else m.sort(a, axis=axis, descending=True)


GRADS = [
    ("sort", lambda m, a: m.sort(a, axis=0) + _desc(m, a, 1)),
    ("take_along_axis", lambda m, a: m.take_along_axis(a, np.array([[0, 0, -1, 2]] * 4), axis=1)),
    ("prod_with_a_zero", lambda m, a: m.prod(a * m.asarray(np.array([1.0, 0.0, 1.0, 1.0, 1.0])), axis=1)
     + m.prod(a, axis=0).sum()),
    ("prod_all", lambda m, a: m.prod(a[:2, :3])),
    ("cumprod", lambda m, a: m.cumprod(a, axis=1) + m.cumulative_prod(a, axis=0, include_initial=True)[1:]),
    ("std_var", lambda m, a: m.std(a, axis=0, correction=1) + m.var(a, axis=0, ddof=2)),
    ("norms", lambda m, a: m.linalg.norm(a, axis=1) + m.linalg.norm(a, 1, axis=1) + m.linalg.norm(a, np.inf, axis=1)
     + m.linalg.norm(a) + m.linalg.norm(a, 1) + m.linalg.norm(a, np.inf)),
    ("diagonal_trace", lambda m, a: m.diagonal(a, 1) + m.trace(a, -1)),
    ("tril_triu", lambda m, a: m.tril(a, 1) * m.triu(a)),
    ("tile_repeat", lambda m, a: m.tile(a, (2, 1))[:4] + m.repeat(a, [2, 0, 1, 1, 1], axis=1)),
    ("split_diff_stack", lambda m, a: m.hstack(m.split(a, [1, 3], axis=1)[::-1]) + m.diff(a, axis=1, append=a[:, :1])),
    ("average_nanmean", lambda m, a: m.average(a, axis=1, weights=np.arange(1.0, 6.0))
     + m.nanmean(m.where(a > 1.5, m.nan, a), axis=1)),
    ("tensordot_vecdot", lambda m, a: m.tensordot(a, a, ([1], [1])).sum(0) + m.vecdot(a, a[::-1])),
    ("linspace_bounds", lambda m, a: m.linspace(a[:, 0], a[:, 1], 4, axis=1)),
]


@pytest.mark.parametrize("fn", [f for _, f in GRADS], ids=[n for n, _ in GRADS])
def test_vjp_matches_central_differences(fn):
    x = np.random.default_rng(6).uniform(0.5, 2.0, (4, 5))
    w = np.random.default_rng(7).standard_normal(np.shape(fn(np, x)))
    (got,) = evaluate(grad(lambda a: snp.sum(fn(snp, a) * w)), x)
    np.testing.assert_allclose(got, _numeric_grad(lambda a: np.sum(fn(np, a) * w), x), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh, spec", [(MESH_4, ("x", None)), (MESH_2x3, ("x", "y")), (MESH_2x3, ("y", "x"))],
                         ids=["4-rows", "2x3", "2x3-swapped"])
def test_gradients_partitioned(mesh, spec):
    """sort, take_along_axis and prod gradients partitioned, uneven (7 x 5), against the reference evaluator."""
    x = np.random.default_rng(8).uniform(0.5, 2.0, (7, 5))
    w = np.random.default_rng(9).standard_normal((7, 5))
    loss = lambda a: snp.sum(snp.sort(a, axis=0) * w) + snp.sum(snp.prod(a, axis=1)) + snp.sum(  # noqa: E731
        snp.take_along_axis(a, snp.argsort(a, axis=1)[:, :2], axis=1)) + snp.linalg.norm(snp.cumprod(a, axis=0))
    graph = sr.trace(grad(loss), x)
    program = sr.partition(graph, mesh, in_specs=[spec])
    assert_all_ranks(program, [x], sr.evaluate(graph, x), tol=1e-10)


def test_tensor_methods_of_the_coverage():
    x = np.random.default_rng(10).standard_normal((4, 5))
    got = evaluate(lambda a: (a.prod(axis=0), a.flatten(), a.ravel(), a.sort(axis=0), (a > 0).any(), (a > -9).all(1),
                              a.std(ddof=1), a.trace(), a.diagonal(1), a.cumprod(1), a.cumsum(0), a.argsort(),
                              a.repeat(2, axis=0)), x)
    want = (np.prod(x, 0), x.flatten(), x.ravel(), np.sort(x, 0), (x > 0).any(), (x > -9).all(1), x.std(ddof=1),
            x.trace(), x.diagonal(1), x.cumprod(1), x.cumsum(0), x.argsort(kind="stable"), x.repeat(2, axis=0))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
