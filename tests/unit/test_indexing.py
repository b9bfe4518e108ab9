"""argmax / argmin / logsumexp / softmax (ops/indexing.py): NumPy semantics (first occurrence on ties,
int64), the table of cases on the simulated meshes (even and uneven), ties across shard boundaries,
and the exact collectives (value all-reduce max/min, then index all-reduce min)."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad
from spmd_runtime.comm import run_simulated
from spmd_runtime.cost import collective_kind

from op_cases_gather import INDEXING_CASES, check_partitioned, check_reference, simulated_meshes

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in INDEXING_CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_8 = sr.Mesh((8,), ("x",))
MESH_2x4 = sr.Mesh((2, 4), ("x", "y"))


def run_everywhere(fn, mesh, in_specs, *args, out_specs=None):
    """(program, every rank's outputs) of ``fn`` partitioned over ``mesh``."""
    program = sr.partition(sr.trace(fn, *args), mesh, in_specs=in_specs, out_specs=out_specs)
    return program, run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm))


def collectives_with_op(program):
    """(kind, axes, reduction op) of every collective, in program order."""
    ops = [i.attrs.get("op") for i in program.instrs if collective_kind(i.op) in
           ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")]  # a start counts
    return [(c["kind"], c["axes"], op) for c, op in zip(program.comm_summary(), ops)]


# ---------------------------------------------------------------- semantics and the case table
LOG_OF_ZERO = "ignore:divide by zero encountered in log:RuntimeWarning"  # an all -inf row: log(0) = -inf, wanted


@pytest.mark.filterwarnings(LOG_OF_ZERO)
@pytest.mark.parametrize("case", INDEXING_CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner", LOG_OF_ZERO)
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


# ---------------------------------------------------------------- ties across shard boundaries
TIES = [  # (positions holding the extreme value in a vector of 10, why)
    ((2, 3), "blocks of 3 on 4 ranks: the tie spans ranks 0 and 1"),
    ((5, 6), "ranks 1 and 2 on 4 ranks; rank 2 and 3 on 8 ranks"),
    ((3, 9), "the later one is the last real element, beside padding"),
    ((9,), "only the last real element"),
    (tuple(range(10)), "every element ties: index 0"),
    ((1, 4, 7, 8), "ties in several ranks and twice in one"),
]


@pytest.mark.parametrize("mesh", [MESH_4, MESH_8, sr.Mesh((3,), ("x",))], ids=str)
@pytest.mark.parametrize("positions,why", TIES, ids=[str(t[0]) for t in TIES])
def test_first_occurrence_wins_across_shards(positions, why, mesh):
    x = np.zeros(10)
    x[list(positions)] = 3.0
    _, outs = run_everywhere(lambda v: (snp.argmax(v), snp.argmin(-v)), mesh, [("x",)], x)
    for got_max, got_min in outs:
        assert int(got_max) == int(got_min) == positions[0] == np.argmax(x), why


@pytest.mark.parametrize("dtype,fill", [("float64", -np.inf), ("int64", np.iinfo(np.int64).min),
                                        ("int32", np.iinfo(np.int32).min)])
def test_values_equal_to_the_padding_identity_still_index_real_elements(dtype, fill):
    """A column entirely at the identity used for padding: the answer is 0, never a padding position."""
    x = np.full((10, 3), fill, dtype)
    x[6, 1] = 5
    _, outs = run_everywhere(lambda v: (snp.argmax(v, axis=0), snp.argmin(-v if dtype == "float64" else v, 0)),
                             MESH_8, [("x", None)], x)
    want_min = np.argmin(-x if dtype == "float64" else x, axis=0)
    for got_max, got_min in outs:
        np.testing.assert_array_equal(got_max, np.argmax(x, axis=0))
        np.testing.assert_array_equal(got_min, want_min)
        assert got_max.dtype == got_min.dtype == np.int64


def test_boolean_input():
    x = np.random.default_rng(0).standard_normal((7, 9)) > 0.8
    _, outs = run_everywhere(lambda v: (snp.argmax(v, axis=1), snp.argmin(v, axis=0)), MESH_4, [(None, "x")], x)
    for got_max, got_min in outs:
        np.testing.assert_array_equal(got_max, np.argmax(x, axis=1))
        np.testing.assert_array_equal(got_min, np.argmin(x, axis=0))


# ---------------------------------------------------------------- exact collectives
def test_argmax_along_split_dim_is_value_max_then_index_min():
    x = np.random.default_rng(1).standard_normal((8, 16))
    program, outs = run_everywhere(lambda v: snp.argmax(v, axis=1), MESH_4, [(None, "x")], x)
    assert collectives_with_op(program) == [("all_reduce", ("x",), "max"), ("all_reduce", ("x",), "min")]
    for (out,) in outs:
        np.testing.assert_array_equal(out, np.argmax(x, axis=1))


def test_argmin_on_2d_mesh_reduces_only_along_the_split_axis():
    x = np.random.default_rng(2).standard_normal((8, 13))  # 13 columns on 4: uneven
    program, outs = run_everywhere(lambda v: snp.argmin(v, axis=1), MESH_2x4, [("x", "y")], x)
    assert collectives_with_op(program) == [("all_reduce", ("y",), "min"), ("all_reduce", ("y",), "min")]
    assert program.outputs[0].sharding == sr.Sharding((("x",),))
    for (out,) in outs:
        np.testing.assert_array_equal(out, np.argmin(x, axis=1))


def test_argmax_along_unsplit_dim_is_local():
    x = np.random.default_rng(3).standard_normal((8, 16))
    program, outs = run_everywhere(lambda v: snp.argmax(v, axis=0), MESH_4, [(None, "x")], x)
    assert program.collectives() == [] and program.outputs[0].sharding == sr.Sharding((("x",),))
    for (out,) in outs:
        np.testing.assert_array_equal(out, np.argmax(x, axis=0))


def test_result_wanted_split_on_the_searched_axis_moves_the_operand_instead():
    """The result takes the axis that splits the searched dim: one all-to-all, then a local search."""
    x = np.random.default_rng(4).standard_normal((8, 16))
    program, outs = run_everywhere(lambda v: snp.argmax(v, axis=1), MESH_4, [(None, "x")], x, out_specs=[("x",)])
    assert collectives_with_op(program) == [("all_to_all", ("x",), None)]
    for (out,) in outs:
        np.testing.assert_array_equal(out, np.argmax(x, axis=1))


def test_logsumexp_along_split_dim_is_max_then_sum():
    x = np.random.default_rng(5).standard_normal((8, 16))
    program, outs = run_everywhere(lambda v: snp.logsumexp(v, axis=1), MESH_4, [(None, "x")], x)
    assert collectives_with_op(program) == [("all_reduce", ("x",), "max"), ("all_reduce", ("x",), "sum")]
    for (out,) in outs:
        np.testing.assert_allclose(out, np.log(np.sum(np.exp(x), axis=1)), rtol=1e-12)


# ---------------------------------------------------------------- logsumexp / softmax numerics
def np_logsumexp(x, axis):
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    return np.squeeze(np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak, axis=axis)


@pytest.mark.filterwarnings(LOG_OF_ZERO, "ignore:overflow encountered in exp:RuntimeWarning")  # the +inf row
def test_logsumexp_is_safe_for_huge_and_infinite_inputs():
    x = np.random.default_rng(6).standard_normal((4, 10)) * 1e4  # exp overflows unshifted
    x[1] = -np.inf
    x[2, 3] = np.inf
    _, outs = run_everywhere(lambda v: snp.logsumexp(v, axis=1), MESH_4, [(None, "x")], x)
    want = np_logsumexp(x, 1)
    assert want[1] == -np.inf and want[2] == np.inf and np.isfinite(want[[0, 3]]).all()
    for (out,) in outs:
        np.testing.assert_allclose(out, want, rtol=1e-12)


def test_logsumexp_keepdims_and_all_axes():
    x = np.random.default_rng(7).standard_normal((5, 6))
    _, outs = run_everywhere(lambda v: (snp.logsumexp(v, axis=0, keepdims=True), snp.logsumexp(v)),
                             MESH_2x4, [("x", "y")], x)
    for keep, total in outs:
        assert keep.shape == (1, 6) and total.shape == ()
        np.testing.assert_allclose(keep, np_logsumexp(x, 0)[None], rtol=1e-12)
        np.testing.assert_allclose(total, np_logsumexp(x, (0, 1)), rtol=1e-12)


def test_gradient_of_logsumexp_is_softmax():
    x = np.random.default_rng(8).standard_normal((6, 10)) * 50.0
    graph = sr.trace(grad(lambda v: snp.sum(snp.logsumexp(v, axis=1))), x)
    program = sr.partition(graph, MESH_2x4, in_specs=[("x", "y")])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    for (out,) in run_simulated(8, lambda comm: sr.run(program, x, comm=comm)):
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("call,match", [
    (lambda v: snp.argmax(v, axis=2), r"argmax needs an axis in \[-2, 2\); got axis 2"),
    (lambda v: snp.argmin(snp.zeros((0, 3))), "argmin of an empty sequence has no answer; got size 0"),
])
def test_errors_state_the_rule_and_what_was_given(call, match):
    with pytest.raises(ValueError, match=match):
        sr.trace(call, sr.TensorSpec((3, 4)))
