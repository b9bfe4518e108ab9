"""take / scatter_add (ops/gather.py): NumPy semantics with clamped indices, the table of cases on the
simulated meshes (even and uneven), and XLA-style partitioner tests asserting the exact collectives."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import value_and_grad
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.exec.runner import communicator

from op_cases_gather import GATHER_CASES, check_partitioned, check_reference, simulated_meshes

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in GATHER_CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x4 = sr.Mesh((2, 4), ("x", "y"))


def np_scatter_add(operand, indices, updates):
    out = operand.copy()
    np.add.at(out, np.clip(indices, 0, len(operand) - 1), updates)
    return out


# ---------------------------------------------------------------- semantics
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


def test_take_clamps_out_of_range_indices_like_numpy_clip():
    table = np.arange(12.0).reshape(4, 3)
    ids = np.array([[-7, 0], [3, 99]])
    graph = sr.trace(lambda t, i: snp.take(t, i, axis=0, mode="clip"), table, ids)
    got = sr.evaluate(graph, table, ids)[0]
    np.testing.assert_array_equal(got, np.take(table, ids, axis=0, mode="clip"))
    np.testing.assert_array_equal(got[0, 0], table[0])
    np.testing.assert_array_equal(got[1, 1], table[3])


def test_scatter_add_accumulates_repeats_and_clamps():
    operand, ids, upd = np.zeros((3, 2)), np.array([1, 1, -5, 40]), np.ones((4, 2))
    graph = sr.trace(lambda o, i, u: snp.scatter_add(o, i, u), operand, ids, upd)
    np.testing.assert_array_equal(sr.evaluate(graph, operand, ids, upd)[0], [[1, 1], [2, 2], [1, 1]])


def test_scatter_add_broadcasts_and_casts_updates():
    operand, ids = np.zeros((4, 2), "float32"), np.array([0, 2, 2])
    graph = sr.trace(lambda o, i: snp.scatter_add(o, i, 1.5), operand, ids)
    got = sr.evaluate(graph, operand, ids)[0]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np_scatter_add(operand, ids, np.full((3, 2), 1.5, "float32")))


@pytest.mark.parametrize("call,error,match", [
    (lambda t, i: snp.take(t, i.astype("float64")), TypeError, "integer indices; got dtype float64"),
    (lambda t, i: snp.take(t, i, mode="raise"), ValueError, r"mode is one of .*; got mode='raise'"),
    (lambda t, i: snp.take(t, i, axis=2), ValueError, r"axis in \[-2, 2\); got axis 2"),
    (lambda t, i: snp.scatter_add(t, i, snp.ones((3, 5))), ValueError,
     r"broadcastable to .* = \(2, 4\); got shape \(3, 5\)"),
    (lambda t, i: snp.take(snp.zeros((0, 4)), i), ValueError, "non-empty axis"),
])
def test_errors_state_the_rule_and_what_was_given(call, error, match):
    with pytest.raises(error, match=match):
        sr.trace(call, sr.TensorSpec((6, 4), "float64"), sr.TensorSpec((2,), "int64"))


# ---------------------------------------------------------------- partitioned numerics, every mesh
@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


# ---------------------------------------------------------------- partitioner: exact collectives
def embed(table, ids):
    return snp.take(table, ids, axis=0, mode="clip")


def scatter(operand, ids, updates):
    return snp.scatter_add(operand, ids, updates)


F, I = "float64", "int64"
# (name, fn, [(shape, dtype)], mesh, in_specs, out_specs, expected [(kind, axes)] in program order)
TABLE = [
    ("vocab_split_1d", embed, [((64, 8), F), ((2, 4), I)], MESH_4, [("x", None), None], None,
     [("all_reduce", ("x",))]),
    ("vocab_split_on_y_batch_on_x", embed, [((64, 8), F), ((4, 4), I)], MESH_2x4, [("y", None), ("x", None)], None,
     [("all_reduce", ("y",))]),
    ("vocab_split_result_wanted_split", embed, [((64, 8), F), ((8,), I)], MESH_4, [("x", None), (None,)],
     [("x", None)], [("reduce_scatter", ("x",))]),
    # ids left free take the result's split by propagation: gathering 8 ids is cheaper than the table
    ("vocab_split_ids_split_by_propagation", embed, [((64, 8), F), ((8,), I)], MESH_4, [("x", None), None],
     [("x", None)], [("all_gather", ("x",)), ("reduce_scatter", ("x",))]),
    ("uneven_vocab_split", embed, [((50, 8), F), ((2, 3), I)], MESH_4, [("x", None), None], None,
     [("all_reduce", ("x",))]),
    ("small_table_gathered_instead", embed, [((8, 4), F), ((16, 8), I)], MESH_4, [("x", None), None], None,
     [("all_gather", ("x",))]),
    ("indices_split_is_local", embed, [((64, 8), F), ((8, 4), I)], MESH_4, [None, ("x", None)], None, []),
    ("table_split_on_features_is_local", embed, [((64, 8), F), ((2, 4), I)], MESH_4, [(None, "x"), None], None, []),
    ("vocab_x_features_y", embed, [((64, 8), F), ((2, 4), I)], MESH_2x4, [("x", "y"), None], None,
     [("all_reduce", ("x",))]),
    ("scatter_rows_split_no_comm", scatter, [((64, 8), F), ((6,), I), ((6, 8), F)], MESH_4,
     [("x", None), None, None], None, []),
    ("scatter_updates_split_partial", scatter, [((8, 4), F), ((64,), I), ((64, 4), F)], MESH_4,
     [None, ("x",), ("x", None)], None, [("all_reduce", ("x",))]),
    ("scatter_updates_split_result_split", scatter, [((8, 4), F), ((64,), I), ((64, 4), F)], MESH_4,
     [None, ("x",), ("x", None)], [("x", None)], [("reduce_scatter", ("x",))]),
    ("scatter_rows_x_updates_y", scatter, [((16, 4), F), ((64,), I), ((64, 4), F)], MESH_2x4,
     [("x", None), ("y",), ("y", None)], None, [("all_reduce", ("y",))]),
]


def make_args(shapes, seed=1):
    """Floats standard normal; indices over [-3, n + 3) of the first argument's dim 0 (clamping exercised)."""
    rng, rows = np.random.default_rng(seed), shapes[0][0][0]
    return [rng.integers(-3, rows + 3, size=s) if d == I else rng.standard_normal(s) for s, d in shapes]


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_specs,expected", TABLE, ids=[t[0] for t in TABLE])
def test_collectives_and_numerics(name, fn, shapes, mesh, in_specs, out_specs, expected):
    args = make_args(shapes)
    graph = sr.trace(fn, *args)
    program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=out_specs)
    assert [(c["kind"], c["axes"]) for c in program.comm_summary()] == expected, str(program)
    want = sr.evaluate(graph, *args)[0]
    for (out,) in run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm)):
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_vocab_split_embedding_never_moves_the_table():
    """Masked local lookup: one all-reduce of the (small) result, 2(k-1)/k of its bytes, the table stays put."""
    graph = sr.trace(embed, sr.TensorSpec((64, 8), "float64"), sr.TensorSpec((2, 4), I))
    program = sr.partition(graph, MESH_4, in_specs=[("x", None), None])
    assert "all_gather" not in program.collectives() and "take_block" in [i.op for i in program.instrs]
    assert program.wire_bytes == pytest.approx(2 * 3 / 4 * (2 * 4 * 8 * 8))


def test_uneven_vocab_rows_past_the_true_size_never_match():
    """50 rows on 8 ranks: blocks of 7, the last block holds 1 real row and 6 padding rows, here NaN;
    indices at the last real row and past it (clamped to it) must read row 49 only, never padding."""
    mesh = sr.Mesh((8,), ("x",))
    table, ids = np.random.default_rng(3).standard_normal((50, 4)), np.array([49, 50, 55, 1000, 48, -1])
    program = sr.partition(sr.trace(embed, table, ids), mesh, in_specs=[("x", None), None])
    padded = np.concatenate([table, np.full((6, 4), np.nan)])

    def rank_body(comm):
        mc = communicator(mesh, comm)
        return Interpreter(program, mc, np).run([padded[7 * mc.rank:7 * mc.rank + 7], ids])[0]
    for out in run_simulated(8, rank_body):
        np.testing.assert_array_equal(out, np.take(table, ids, axis=0, mode="clip"))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int32", "uint64"])
def test_narrow_and_unsigned_indices_take_the_shard_offset(dtype):
    """Indices are widened to int64 before the offset is subtracted (uint8 - offset would wrap)."""
    table = np.random.default_rng(4).standard_normal((300, 2))
    ids = np.array([0, 100, 127, 5, 2 if dtype.startswith("u") else -1], dtype)
    graph = sr.trace(lambda t, i: (snp.take(t, i, mode="clip"), snp.scatter_add(t, i, 1.0)), table, ids)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None), None])
    want_take, want_scatter = np.take(table, ids, axis=0, mode="clip"), np_scatter_add(table, ids, np.ones((5, 2)))
    for got_take, got_scatter in run_simulated(4, lambda comm: sr.run(program, table, ids, comm=comm)):
        np.testing.assert_array_equal(got_take, want_take)
        np.testing.assert_allclose(got_scatter, want_scatter, rtol=1e-15)


# ---------------------------------------------------------------- gradients: take and scatter_add transpose
def test_embedding_gradient_is_scatter_add_and_partitions_without_moving_the_table():
    def loss(table, ids):
        return snp.sum(snp.take(table, ids) ** 2.0)
    table, ids = make_args([((64, 8), F), ((2, 5), I)])
    graph = sr.trace(lambda t, i: value_and_grad(loss)(t, i), table, ids)
    rows = np.take(table, ids, axis=0, mode="clip")
    want = np_scatter_add(np.zeros_like(table), ids.reshape(-1), 2.0 * rows.reshape(-1, 8))
    np.testing.assert_allclose(sr.evaluate(graph, table, ids)[1], want, rtol=1e-12)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None), None], out_specs=[(), ("x", None)])
    assert "all_gather" not in program.collectives(), str(program)
    for value, grad in run_simulated(4, lambda comm: sr.run(program, table, ids, comm=comm)):
        np.testing.assert_allclose(value, np.sum(rows ** 2), rtol=1e-12)
        np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-12)


def test_scatter_add_gradient_wrt_operand_and_updates():
    def loss(operand, updates, ids):
        return snp.sum(snp.scatter_add(operand, ids, updates) ** 2.0)
    operand, updates, ids = make_args([((6, 3), F), ((5, 3), F), ((5,), I)])

    def value_and_grads(o, u, i):
        value, (d_operand, d_updates) = value_and_grad(loss, argnums=(0, 1))(o, u, i)
        return value, d_operand, d_updates
    graph = sr.trace(value_and_grads, operand, updates, ids)
    out = np_scatter_add(operand, ids, updates)
    _, d_operand, d_updates = sr.evaluate(graph, operand, updates, ids)
    np.testing.assert_allclose(d_operand, 2.0 * out, rtol=1e-12)
    np.testing.assert_allclose(d_updates, np.take(2.0 * out, ids, axis=0, mode="clip"), rtol=1e-12)


def test_saved_program_with_masked_lookup_runs_the_same(tmp_path):
    table, ids = make_args([((10, 3), F), ((4,), I)])
    program = sr.partition(sr.trace(embed, table, ids), MESH_4, in_specs=[("x", None), None])
    program.save(tmp_path / "p.json")
    loaded = sr.load_program(tmp_path / "p.json")
    assert loaded.hash == program.hash
    for (out,) in run_simulated(4, lambda comm: sr.run(loaded, table, ids, comm=comm)):
        np.testing.assert_array_equal(out, np.take(table, ids, axis=0, mode="clip"))


@pytest.mark.parametrize("axis, rows_shape", [(0, (12,)), (1, (3, 4)), (2, (5,)), (0, (0,)), (0, (40,))])
def test_rows_are_added_as_np_add_at_does_repeats_included(axis, rows_shape):
    from spmd_runtime.ops.gather import _add_rows
    rng = np.random.default_rng(7)
    operand = rng.standard_normal((4, 6, 5)).astype(np.float32)
    rows = rng.integers(0, operand.shape[axis], rows_shape)  # more indices than rows: repeats
    updates = rng.standard_normal(operand.shape[:axis] + rows_shape + operand.shape[axis + 1:]).astype(np.float32)
    want = operand.copy()
    np.add.at(np.moveaxis(want, axis, 0), rows.reshape(-1),
              np.moveaxis(updates, tuple(range(axis, axis + rows.ndim)), tuple(range(rows.ndim))).reshape(
                  (rows.size,) + np.moveaxis(want, axis, 0).shape[1:]))
    got = _add_rows(np, operand, rows, updates, axis)
    np.testing.assert_array_equal(got, want)  # the same bits: each row sums its updates in index order
    assert not np.shares_memory(got, operand)


@pytest.mark.parametrize("max_passes", [1, 3, 100])
def test_rows_repeated_more_than_the_pass_limit_go_to_add_at_with_the_same_bits(monkeypatch, max_passes):
    from spmd_runtime.ops import gather
    monkeypatch.setattr(gather, "MAX_ROW_PASSES", max_passes)
    rng = np.random.default_rng(3)
    rows = np.repeat(np.arange(5), [1, 7, 2, 2, 9])[rng.permutation(21)]
    values = rng.standard_normal((21, 8)).astype(np.float32)
    want, got = np.zeros((5, 8), np.float32), np.zeros((5, 8), np.float32)
    np.add.at(want, rows, values)
    gather._add_sorted(got, rows, values)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shard", [0, 1, 3])
def test_a_vocab_block_adds_only_the_updates_aimed_at_it_with_np_add_ats_bits(shard):
    """A Megatron embedding gradient: 4 blocks of 5 rows, 60 token rows mostly aimed at other blocks (their
    misses once went to row 0 as zeros, repeating it past the pass limit)."""
    from spmd_runtime.ops.gather import scatter_add_block
    rng = np.random.default_rng(11)
    operand = rng.standard_normal((5, 3)).astype(np.float32)
    indices = rng.integers(-2, 22, (6, 10))  # out of range clamps to the first/last row, as take does
    updates = rng.standard_normal((6, 10, 3)).astype(np.float32)
    rows = np.clip(indices, 0, 19).reshape(-1) - shard * 5
    hit = (rows >= 0) & (rows < 5)
    want = operand.copy()
    np.add.at(want, rows[hit], updates.reshape(-1, 3)[hit])
    got = scatter_add_block(np, operand, indices, updates, shard, axis=0, size=20)
    np.testing.assert_array_equal(got, want)
    assert not np.shares_memory(got, operand)
