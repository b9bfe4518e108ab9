"""Slicing family: static slices and basic indexing, pads, concatenate/stack, reverse, iota/arange,
dynamic_slice / dynamic_update_slice.

The case table (op_cases_slicing.py) runs on every test mesh in the simulated world against the
reference evaluator, which is itself checked against NumPy. Partitioner tests assert the exact
collectives each plan chooses on split dims (shift = collective_permute halo, owned window =
all-reduce / reduce-scatter, gather = all_gather + a note), as XLA's spmd_partitioner_test does.
"""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.cost import collective_kind

from op_cases import make_inputs, partition_case, tolerance
from simulated import assert_all_ranks, collectives, run_everywhere
from op_cases_slicing import CASES

MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3), (2, 4), (4, 2))] + [
    sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x4 = sr.Mesh((2, 4), ("x", "y"))
I64 = sr.TensorSpec((), "int64")


# ---------------------------------------------------------------- the case table
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    tol = tolerance(case.dtype)
    want = case.fn(np, *args)
    got = sr.evaluate(graph, *args)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    graph, program, args, expected = partition_case(case, specs, mesh)
    assert_all_ranks(program, args, expected, tolerance(case.dtype))


# ---------------------------------------------------------------- partitioner table: collectives per plan
def shift_left(x):
    return x[1:]


def drop_last(x):
    return x[:-1]


def head(x):
    return x[:2]


def every_other(x):
    return x[1::2]


def flip_rows(x):
    return snp.flip(x, 0)


def pad_shift(x):
    return snp.lax_pad(x, -1.0, [(1, -1, 0), (0, 0, 0)])


def pad_grow(x):
    return snp.pad(x, ((2, 2), (0, 0)))


def concat_rows(x, y):
    return snp.concatenate([x, y], axis=0)


def concat_cols(x, y):
    return snp.concatenate([x, y], axis=1)


def window(size):
    def fn(x, s):
        return snp.dynamic_slice(x, [s, 0], (size, x.shape[1]))
    fn.__name__ = f"window_{size}"
    return fn


def update_rows(x, u, s):
    return snp.dynamic_update_slice(x, u, [s, 0])


def plus_iota(x):
    return x + snp.arange(x.shape[0] * 1.0).reshape(x.shape[0], 1)


R, SPLIT = (None, None), ("x", None)
# (name, fn, specs of the arguments, mesh, in_specs, out_specs, expected (kind, axes), note substring or None)
TABLE = [
    ("halo_shift_left", shift_left, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [("collective_permute", ("x",))], None),
    ("shift_offset_zero_is_local", drop_last, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [], None),
    ("uneven_halo", shift_left, [(10, 8)], MESH_4, [SPLIT], [SPLIT], [("collective_permute", ("x",))], None),
    ("shift_to_replicated_gathers", shift_left, [(16, 8)], MESH_4, [SPLIT], [R], [("all_gather", ("x",))],
     "gathered on split dims [0]"),
    ("small_slice_owned_all_reduce", head, [(16, 8)], MESH_4, [SPLIT], [R], [("all_reduce", ("x",))], None),
    ("strided_slice_rows_stay_home", every_other, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [], None),
    ("unsplit_dim_slice_is_local", every_other, [(16, 8)], MESH_4, [(None, "x")], [(None, "x")], [], None),
    ("reverse_even", flip_rows, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [("collective_permute", ("x",))], None),
    ("reverse_uneven", flip_rows, [(10, 8)], MESH_4, [SPLIT], [SPLIT],
     [("collective_permute", ("x",)), ("collective_permute", ("x",))], None),
    ("reverse_2d_axes", flip_rows, [(16, 8)], MESH_2x4, [(("x", "y"), None)], [(("x", "y"), None)],
     [("collective_permute", ("x", "y"))], None),
    ("pad_same_size_shift", pad_shift, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [("collective_permute", ("x",))],
     None),
    ("pad_growing_split_dim_gathers", pad_grow, [(16, 8)], MESH_4, [SPLIT], [R], [("all_gather", ("x",))],
     "pad %1 [16, 8]->[20, 8]: operand %0 is gathered on split dims [0] ([x, R] -> [R, R])"),
    ("concat_split_axis_gathers", concat_rows, [(16, 8), (16, 8)], MESH_4, [SPLIT, SPLIT], [R],
     [("all_gather", ("x",)), ("all_gather", ("x",))], "concatenate %2 [32, 8] along split dim 0"),
    ("concat_other_axis_is_local", concat_cols, [(16, 8), (16, 4)], MESH_4, [SPLIT, SPLIT], [SPLIT], [], None),
    ("dynamic_slice_small_window_all_reduce", window(2), [(16, 8), I64], MESH_4, [SPLIT, None], [R],
     [("all_reduce", ("x",))], None),
    ("dynamic_slice_large_window_gathers", window(12), [(16, 8), I64], MESH_4, [SPLIT, None], [R],
     [("all_gather", ("x",))], "dynamic_slice %3 [16, 8]->[12, 8]: operand %0 is gathered"),
    ("dynamic_slice_split_result_reduce_scatter", window(8), [(16, 8), I64], MESH_4, [SPLIT, None], [SPLIT],
     [("reduce_scatter", ("x",))], None),
    ("dynamic_slice_2d_axes", window(1), [(16, 8), I64], MESH_2x4, [(("x", "y"), None), None], [R],
     [("all_reduce", ("x", "y"))], None),
    ("dynamic_slice_unsplit_dim_local", window(3), [(16, 8), I64], MESH_4, [(None, "x"), None], [(None, "x")],
     [], None),
    ("dynamic_update_slice_split_no_comm", update_rows, [(16, 8), (3, 8), I64], MESH_4, [SPLIT, R, None],
     [SPLIT], [], None),
    ("iota_split_is_local", plus_iota, [(16, 8)], MESH_4, [SPLIT], [SPLIT], [], None),
]


def _args(specs, rng):
    out = []
    for s in specs:
        spec = s if isinstance(s, sr.TensorSpec) else sr.TensorSpec(s, "float64")
        out.append(np.int64(rng.integers(-3, 20)) if spec.dtype == "int64" else rng.standard_normal(spec.shape))
    return out


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("name,fn,specs,mesh,in_specs,out_specs,expected,note", TABLE, ids=[t[0] for t in TABLE])
def test_collectives_notes_and_numerics(name, fn, specs, mesh, in_specs, out_specs, expected, note):
    rng = np.random.default_rng(3)
    graph = sr.trace(fn, *[s if isinstance(s, sr.TensorSpec) else sr.TensorSpec(s, "float64") for s in specs])
    program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=out_specs)
    assert collectives(program) == expected, str(program)
    if note is None:
        assert program.notes == [], program.notes
    else:
        assert any(note in n for n in program.notes), program.notes
    for _ in range(3):  # several random starts (in and out of range)
        args = _args(specs, rng)
        assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_halo_shift_moves_one_row_from_the_next_shard():
    """x[1:] kept split: block j is rows [1, 4) of its own block and row 0 of block j+1: one row per rank."""
    program = sr.partition(sr.trace(shift_left, sr.TensorSpec((16, 8), "float64")), MESH_4, in_specs=[SPLIT],
                           out_specs=[SPLIT])
    (permute,) = [i for i in program.instrs if collective_kind(i.op) == "collective_permute"]
    assert sorted(permute.attrs["pairs"]) == [(1, 0), (2, 1), (3, 2)]  # shard 3 receives nothing: its padding
    assert program.wire_bytes == 1 * 8 * 8


def test_reverse_even_swaps_blocks_and_uneven_moves_one_block_per_rank():
    even = sr.partition(sr.trace(flip_rows, sr.TensorSpec((16, 8), "float64")), MESH_4, in_specs=[SPLIT], out_specs=[SPLIT])
    (permute,) = [i for i in even.instrs if collective_kind(i.op) == "collective_permute"]
    assert sorted(permute.attrs["pairs"]) == [(0, 3), (1, 2), (2, 1), (3, 0)]
    assert even.wire_bytes == 4 * 8 * 8
    uneven = sr.partition(sr.trace(flip_rows, sr.TensorSpec((10, 8), "float64")), MESH_4, in_specs=[SPLIT], out_specs=[SPLIT])
    # blocks of 3 rows, 2 rows of padding: block j = row 2 of reversed block 3-j + rows 0..1 of block 2-j
    assert uneven.wire_bytes == 3 * 8 * 8


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_dynamic_slice_on_split_dim_plan_and_bytes():
    """The issue's required check: a 2-row window of 16 rows on 4 shards is an owned window (zeros outside
    each shard's rows) plus ONE all-reduce of the 2-row result, not a gather of the operand."""
    graph = sr.trace(window(2), sr.TensorSpec((16, 8), "float64"), I64)
    program = sr.partition(graph, MESH_4, in_specs=[SPLIT, None], out_specs=[R])
    assert [i.op for i in program.instrs if i.op not in ("parameter", "constant")] == [
        "shard_index", "owned_dynamic_slice", "all_reduce"]  # the constant: the start 0 of dim 1
    (summary,) = program.comm_summary()
    assert (summary["kind"], summary["axes"], summary["bytes_in"]) == ("all_reduce", ("x",), 2 * 8 * 8)
    gather = sr.partition(sr.trace(window(12), sr.TensorSpec((16, 8), "float64"), I64), MESH_4, in_specs=[SPLIT, None],
                          out_specs=[R])
    assert gather.wire_bytes < 2 * 3 / 4 * 12 * 8 * 8  # cheaper than all-reducing the 12-row result


@pytest.mark.parametrize("mesh,spec", [(MESH_4, SPLIT), (sr.Mesh((3,), ("x",)), SPLIT),
                                       (MESH_2x4, (("x", "y"), None)), (MESH_2x4, ("y", "x"))],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("n,size", [(10, 3), (7, 7), (10, 1)])
def test_dynamic_slice_and_update_clamp_globally_for_every_start(mesh, spec, n, size):
    """One program, every start from -3 to n + 3: the window must be the globally clamped one on every
    rank (a per-shard clamp would return rows of the wrong shard)."""
    def fn(x, u, s):
        outs = [snp.dynamic_slice(x, [s + t, 0], (size, 3)) for t in range(-3, n + 4)]
        ups = [snp.dynamic_update_slice(x, u, [s + t, s - t]) for t in range(-3, n + 4)]
        return snp.stack(outs), snp.stack(ups)
    graph = sr.trace(fn, sr.TensorSpec((n, 5), "float64"), sr.TensorSpec((size, 3), "float64"), I64)
    program = sr.partition(graph, mesh, in_specs=[spec, None, None])
    x, u = np.arange(n * 5.0).reshape(n, 5), -np.arange(1.0, size * 3 + 1).reshape(size, 3)
    clamp = lambda s, total, m: min(max(s, 0), total - m)
    want_slices = np.stack([x[clamp(t, n, size):clamp(t, n, size) + size, 0:3] for t in range(-3, n + 4)])
    want_updates = []
    for t in range(-3, n + 4):
        r, c = clamp(t, n, size), clamp(-t, 5, 3)
        y = x.copy()
        y[r:r + size, c:c + 3] = u
        want_updates.append(y)
    assert_all_ranks(program, [x, u, np.int64(0)], [want_slices, np.stack(want_updates)])


@pytest.mark.parametrize("fn,n", [(plus_iota, 16), (lambda x: x + snp.broadcasted_iota("float64", x.shape, 0), 10)],
                         ids=["arange_even", "broadcasted_iota_uneven"])
def test_iota_block_is_computed_per_shard_without_a_global_constant(fn, n):
    program = sr.partition(sr.trace(fn, sr.TensorSpec((n, 8), "float64")), MESH_4, in_specs=[SPLIT], out_specs=[SPLIT])
    (iota,) = [i for i in program.instrs if i.op == "iota"]
    assert iota.shape[0] == -(-n // 4) == iota.attrs["block"] and "shard_index" in [i.op for i in program.instrs]
    assert all(i.op != "constant" or np.size(i.attrs["value"]) <= 1 for i in program.instrs)
    assert collectives(program) == []
    assert_all_ranks(program, [np.zeros((n, 8))], [np.broadcast_to(np.arange(n * 1.0)[:, None], (n, 8))])


def test_owned_window_partial_sum_is_bitwise_exact():
    """Non-owners contribute -0.0, the exact additive identity: -0.0, NaN and -inf come through unchanged."""
    program = sr.partition(sr.trace(head, sr.TensorSpec((16, 4), "float64")), MESH_4, in_specs=[SPLIT], out_specs=[R])
    assert collectives(program) == [("all_reduce", ("x",))]
    x = np.ones((16, 4))
    x[1, 0], x[0, 1], x[0, 2] = -0.0, np.nan, -np.inf
    for (out,) in run_everywhere(program, x):
        np.testing.assert_array_equal(out, x[:2])
        assert np.signbit(out[1, 0])


def test_bool_data_never_takes_the_all_reduce_plan():
    """A partial sum of bools is not an MPI reduction: a bool window on a split dim moves its rows by an
    exchange (rank 0 sends its 2 rows of 8 bools to 3 ranks: 48 B, less than gathering 96 B)."""
    graph = sr.trace(lambda x: (x > 0)[:2], sr.TensorSpec((16, 8), "float64"))
    program = sr.partition(graph, MESH_4, in_specs=[SPLIT], out_specs=[R])
    assert collectives(program) == [("all_to_allv", ("x",))] and program.wire_bytes == 48
    x = np.random.default_rng(0).standard_normal((16, 8))
    assert_all_ranks(program, [x], [x[:2] > 0])


def test_program_with_halo_and_owned_ops_survives_save_and_load(tmp_path):
    def fn(x, s):
        return x[1:] * 2.0 + snp.flip(x, 0)[:-1], snp.dynamic_slice(x, [s, 1], (2, 3)) + snp.arange(3.0)
    graph = sr.trace(fn, sr.TensorSpec((10, 4), "float64"), I64)
    program = sr.partition(graph, MESH_4, in_specs=[SPLIT, None], out_specs=[SPLIT, None])
    program.save(tmp_path / "p.json")
    loaded = sr.load_program(tmp_path / "p.json")
    assert loaded.hash == program.hash
    x = np.random.default_rng(1).standard_normal((10, 4))
    assert_all_ranks(loaded, [x, np.int64(7)], sr.evaluate(graph, x, np.int64(7)), tol=1e-12)


# ---------------------------------------------------------------- indexing and API
KEYS = [np.s_[3], np.s_[-1], np.s_[2:9], np.s_[::3], np.s_[::-1], np.s_[8:1:-2], np.s_[-2::-3], np.s_[5:5],
        np.s_[7:2], np.s_[None], np.s_[..., 1], np.s_[1, ..., None, ::-2], np.s_[:, None, 2], np.s_[-3:, 1:4],
        np.s_[100:], np.s_[::-100], np.s_[None, ..., None], np.s_[()], np.s_[np.int64(2), 0, 0]]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_getitem_matches_numpy(key):
    x = np.random.default_rng(0).standard_normal((9, 6, 4))
    graph = sr.trace(lambda t: t[key] * 1.0, x)
    np.testing.assert_array_equal(sr.evaluate(graph, x)[0], x[key] * 1.0)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("key", [np.s_[::-1], np.s_[8:1:-2], np.s_[1, ..., None, ::-2], np.s_[-3:, 1:4]], ids=repr)
def test_getitem_partitioned_on_uneven_split(key):
    x = np.random.default_rng(0).standard_normal((9, 6, 4))
    graph = sr.trace(lambda t: t[key] * 1.0, x)
    for spec in [("x", None, None), (None, None, "x")]:
        assert_all_ranks(sr.partition(graph, MESH_4, in_specs=[spec]), [x], [x[key] * 1.0])


def test_traced_scalar_index_wraps_negatives_and_clamps():
    def fn(x, i):
        return x[i], x[-i, 1:]
    graph = sr.trace(fn, sr.TensorSpec((10, 4), "float64"), I64)
    program = sr.partition(graph, MESH_4, in_specs=[SPLIT, None])
    x = np.arange(40.0).reshape(10, 4)
    for i in (0, 3, 9, -1, -10, 12, -15):  # out of range: XLA clamps after the one wrap
        wrap = lambda v: min(max(v + 10 if v < 0 else v, 0), 9)
        assert_all_ranks(program, [x, np.int64(i)], [x[wrap(i)], x[wrap(-i), 1:]])


@pytest.mark.parametrize("key,error,match", [
    (np.s_[[0.5, 1]], IndexError, "integers or booleans; got dtype float64"),  # int arrays: test_index_update.py
    (np.s_[True], IndexError, "Tensor indices are ints"),
    (np.s_[9], IndexError, "out of bounds"),
    (np.s_[-10], IndexError, "out of bounds"),
    (np.s_[0, 0, 0, 0], IndexError, "too many indices"),
    (np.s_[..., 0, ...], IndexError, "single ellipsis"),
])
def test_getitem_errors_state_the_rule(key, error, match):
    with pytest.raises(error, match=match):
        sr.trace(lambda t: t[key], sr.TensorSpec((9, 6, 4), "float64"))


@pytest.mark.parametrize("fn,match", [
    (lambda x: snp.static_slice(x, (0, 5), (3, 4)), "0 <= start <= limit <= size"),
    (lambda x: snp.static_slice(x, (0, 0), (3, 4), (1, 0)), "stride >= 1"),
    (lambda x: snp.lax_pad(x, 0.0, [(0, 0, -1), (0, 0, 0)]), "interior >= 0"),
    (lambda x: snp.lax_pad(x, 0.0, [(-9, 0, 0), (0, 0, 0)]), "sizes >= 0"),
    (lambda x: snp.pad(x, ((1, 1), (1, 1)), constant_values=((1, 2), (1, 2))), "one constant value"),
    (lambda x: snp.concatenate([x, x.T], axis=0), "equal shapes except along axis 0"),
    (lambda x: snp.dynamic_slice(x, [0, 0], (10, 2)), "0 <= size <= dim"),
    (lambda x: snp.dynamic_slice(x, [0], (1, 2)), "one start index per dim"),
    (lambda x: snp.dynamic_slice(x, [x[0, 0], 0], (1, 2)), "0-d integer tensor"),
    (lambda x: snp.dynamic_update_slice(x, snp.ones((9, 1)), [0, 0]), "no larger than x"),
    (lambda x: snp.arange(0, 5, 0), "non-zero step"),
])
def test_api_errors_state_the_rule(fn, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sr.trace(fn, sr.TensorSpec((8, 5), "float64"))


@pytest.mark.parametrize("args,kwargs", [((7,), {}), ((2, 11, 3), {}), ((5, -4, -2), {}), ((0.5, 3.0, 0.25), {}),
                                         ((1, 2.5, 0.5), {}), ((4,), {"dtype": "float32"}), ((3, 3), {}),
                                         ((-2.5, 4), {"dtype": "float64"})], ids=str)
def test_arange_matches_numpy(args, kwargs):
    # NumPy's values; JAX's dtype without x64: Python bounds are weak, so int32 / float32 unless asked
    graph = sr.trace(lambda: snp.arange(*args, **kwargs) * 1)
    got, want = sr.evaluate(graph)[0], np.arange(*args, **kwargs)
    jax_dtype = want.dtype if kwargs else {"i": np.dtype("int32"), "f": np.dtype("float32")}[want.dtype.kind]
    assert got.dtype == jax_dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-7)


def test_static_api_shapes_and_folding():
    x = np.random.default_rng(0).standard_normal((6, 5))
    graph = sr.trace(lambda t: (snp.slice_in_dim(t, -4, None, 2, axis=0), snp.dynamic_slice(t, [9, -2], (2, 3)),
                                snp.iota("int32", 4), snp.broadcasted_iota("float32", (2, 3), 1),
                                snp.stack([t, t], axis=-1), snp.concatenate([t, t], axis=None),
                                snp.reverse(t, (0, -1))), x)
    outs = sr.evaluate(graph, x)
    want = [x[-4::2], x[4:6, 0:3], np.arange(4, dtype="int32"), np.broadcast_to(np.arange(3.0), (2, 3)),
            np.stack([x, x], -1), np.concatenate([x, x], None), x[::-1, ::-1]]
    for got, w in zip(outs, want):
        assert got.shape == w.shape
        np.testing.assert_array_equal(got, w)
    assert "dynamic_slice" not in [n.op for n in graph.nodes]  # static starts fold into a static slice
    assert outs[3].dtype == np.float32 and outs[2].dtype == np.int32


# ---------------------------------------------------------------- gradients (each op's transpose)
GRAD_FNS = {
    "getitem": lambda x, u: x[1:4, ::-2] * 1.0,
    "strided_slice": lambda x, u: snp.static_slice(x, (1, 0), (5, 4), (3, 2)),
    "pad": lambda x, u: snp.lax_pad(x, 2.0, [(1, -1, 1), (-2, 3, 2)]),
    "concatenate": lambda x, u: snp.concatenate([x, u * 3.0, x], axis=0),
    "stack_reverse": lambda x, u: snp.flip(snp.stack([x, x * 2.0]), (0, 2)),
    "dynamic_slice": lambda x, u: snp.dynamic_slice(x, [snp.asarray(np.int64(3)), snp.asarray(np.int64(-1))], (2, 3)),
    "dynamic_update_slice": lambda x, u: snp.dynamic_update_slice(x, u * u, [snp.asarray(np.int64(4)),
                                                                           snp.asarray(np.int64(1))]),
}


@pytest.mark.parametrize("name", GRAD_FNS)
def test_vjp_matches_finite_differences(name):
    from spmd_runtime.autodiff import value_and_grad
    fn = GRAD_FNS[name]
    w_of = lambda shape: np.random.default_rng(7).standard_normal(shape)

    def loss(x, u):
        out = fn(x, u)
        return snp.sum(out * w_of(out.shape))
    rng = np.random.default_rng(0)
    x, u = rng.standard_normal((6, 4)), rng.standard_normal((2, 4))
    graph = sr.trace(lambda a, b: value_and_grad(loss, (0, 1))(a, b)[1], x, u)
    got = sr.evaluate(graph, x, u)
    value = sr.trace(loss, x, u)
    f = lambda a, b: float(sr.evaluate(value, a, b)[0])
    for k, arg in enumerate((x, u)):
        numeric = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            plus, minus = [x.copy(), u.copy()], [x.copy(), u.copy()]
            plus[k][idx] += 1e-6
            minus[k][idx] -= 1e-6
            numeric[idx] = (f(*plus) - f(*minus)) / 2e-6
        np.testing.assert_allclose(got[k], numeric, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_partitioned_gradient_of_a_finite_difference_loss():
    from spmd_runtime.autodiff import grad

    def loss(x):
        d = x[1:] - x[:-1]
        return snp.sum(d * d) + snp.sum(snp.flip(x, 0)[:3] * x[:3])
    graph = sr.trace(grad(loss), sr.TensorSpec((10, 3), "float64"))
    program = sr.partition(graph, MESH_4, in_specs=[SPLIT], out_specs=[SPLIT])
    x = np.random.default_rng(2).standard_normal((10, 3))
    assert_all_ranks(program, [x], sr.evaluate(graph, x), tol=1e-12)
