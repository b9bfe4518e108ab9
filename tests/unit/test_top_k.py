"""top_k (ops/top_k.py): jax.lax.top_k semantics against a NumPy reference written here, the case table on
the simulated meshes (1..8 ranks, 1-d and 2-d, uneven), the collectives of the split-last-axis plan, and
the gradient by central finite differences."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from op_cases_top_k import CASES, np_top_k
from simulated import assert_all_ranks, collectives

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x4 = sr.Mesh((2, 4), ("x", "y"))


def test_semantics_descending_ties_to_the_lower_index_int32():
    x = np.array([[1.0, 3.0, 3.0, -2.0, 3.0, 0.5], [-np.inf, 2.0, 2.0, 2.0, -np.inf, 7.0]])
    values, indices = sr.evaluate(sr.trace(lambda a: snp.top_k(a, 4), x), x)
    np.testing.assert_array_equal(values, [[3.0, 3.0, 3.0, 1.0], [7.0, 2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(indices, [[1, 2, 4, 0], [5, 1, 2, 3]])
    assert indices.dtype == np.int32 and values.dtype == x.dtype


def test_np_reference_agrees_with_a_python_loop():
    x = np.random.default_rng(1).integers(0, 4, (5, 9)).astype(np.float64)
    values, indices = np_top_k(x, 4)
    for row, v, i in zip(x, values, indices):
        want = sorted(range(len(row)), key=lambda j: (-row[j], j))[:4]
        assert list(i) == want and list(v) == [row[j] for j in want]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


@pytest.mark.parametrize("k", [0, 9, 2.0])
def test_bad_k_is_refused_naming_the_rule(k):
    with pytest.raises(ValueError, match=r"1 <= k <= x.shape\[-1\] = 8; got k="):
        sr.trace(lambda a: snp.top_k(a, k), sr.TensorSpec((3, 8)))


# ---------------------------------------------------------------- the partitioned plan
def test_split_last_axis_gathers_only_the_candidates():
    """64 entries on 4 ranks, k = 2: each rank's top 2 values and indices are all-gathered (8 per row), never
    the operand; both outputs share that one gather."""
    x = np.random.default_rng(0).standard_normal((3, 64))
    graph = sr.trace(lambda a: snp.top_k(a, 2), x)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x")])
    assert collectives(program) == [("all_gather", ("x",)), ("all_gather", ("x",))]
    assert [c["bytes_out"] for c in program.comm_summary()] == [3 * 8 * 8, 3 * 8 * 4]
    assert sum(i.op == "top_k_merge" for i in program.instrs) == 2
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


def test_uneven_split_masks_padding_and_keeps_global_ties():
    """10 entries in blocks of 3 on 4 ranks (2 padding slots on the last rank): the padding (0 before the
    mask) never beats a real -1, and equal values across ranks give the lowest global index."""
    x = -np.ones((3, 10))
    x[0] = 0.0
    x[2, 9] = -0.5  # the last real entry, beside the padding, is the largest
    graph = sr.trace(lambda a: snp.top_k(a, 1), x)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x")])
    ops = [i.op for i in program.instrs]
    assert "mask_padding" in ops and "top_k_merge" in ops
    values, indices = sr.evaluate(graph, x)
    np.testing.assert_array_equal(indices, [[0], [0], [9]])
    assert_all_ranks(program, [x], [values, indices])


def test_k_close_to_the_block_gathers_the_operand_instead():
    """k = 4 of 10 on 4 ranks: the candidates (4 ranks x 3 values + indices) would outweigh the row, so the
    chooser gathers the operand once and runs top_k locally."""
    x = np.random.default_rng(2).standard_normal((3, 10))
    graph = sr.trace(lambda a: snp.top_k(a, 4), x)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x")])
    assert collectives(program) == [("all_gather", ("x",))]
    assert "top_k_merge" not in [i.op for i in program.instrs]
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


def test_batch_dims_keep_their_split_without_communication():
    x = np.random.default_rng(3).standard_normal((8, 12))
    graph = sr.trace(lambda a: snp.top_k(a, 3), x)
    program = sr.partition(graph, MESH_2x4, in_specs=[(("x", "y"), None)])
    assert collectives(program) == []
    assert program.outputs[0].sharding == sr.Sharding(((("x", "y")), ()))
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


# ---------------------------------------------------------------- gradient
def test_vjp_scatters_the_cotangent_to_the_chosen_positions_by_finite_differences():
    rng = np.random.default_rng(4)
    x = rng.permutation(24).reshape(2, 12).astype(np.float64) * 0.1  # distinct: top_k is smooth here
    w = rng.standard_normal((2, 3))
    loss = lambda a: snp.sum(snp.top_k(a, 3)[0] * w)
    (g,) = sr.evaluate(sr.trace(grad(loss), x), x)
    eps, fd = 1e-6, np.zeros_like(x)
    f = lambda a: float(sr.evaluate(sr.trace(loss, a), a)[0])
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        fd[i] = (f(x + d) - f(x - d)) / (2 * eps)
    np.testing.assert_allclose(g, fd, atol=1e-8)
    assert np.count_nonzero(g) == 6


def test_gradient_partitioned_with_the_last_axis_split():
    rng = np.random.default_rng(5)
    x = rng.permutation(40).reshape(2, 20).astype(np.float64)
    w = rng.standard_normal((2, 2))
    graph = sr.trace(grad(lambda a: snp.sum(snp.top_k(a, 2)[0] * w)), x)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x")])
    assert_all_ranks(program, [x], sr.evaluate(graph, x), tol=1e-12)
