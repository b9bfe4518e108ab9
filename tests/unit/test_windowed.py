"""Windowed einsum (partition/windowed.py): an all-gather before an einsum, or a reduce-scatter after it, as a
ring of collective_permutes, each hidden behind one step of the einsum. Table: (pattern, mesh, axes) ->
the gather or reduce-scatter gone, k - 1 permutes in its place, each permute's start and done with an einsum
between them, and the result equal to the reference evaluator's on every rank: 1-d and 2-d meshes of 2, 3,
4, 6 and 8 ranks (device-reordered ones too), one axis or two, even and uneven shapes."""
import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated
from spmd_runtime.cost import CostModel, collective_kind
from spmd_runtime.partition.windowed import WINDOWED_ENV
from spmd_runtime.program_check import check_program

from mesh_cases import meshes_for
from windowed_cases import PATTERNS, window_axes, windowed_program


def _cases():
    for n in (2, 3, 4, 6, 8):
        for mesh in meshes_for(n):
            for a in window_axes(mesh):
                for size in (24, 7):
                    for pattern in PATTERNS:
                        yield pytest.param(pattern, mesh, a, size, id=f"{pattern}-{mesh}-{'.'.join(a)}-{size}")


_program = windowed_program


def _kinds(program):
    return [c["kind"] for c in program.comm_summary()]


@pytest.mark.parametrize("pattern,mesh,axes,size", list(_cases()))
def test_ring_replaces_the_collective_and_agrees_with_the_reference(pattern, mesh, axes, size):
    graph, args, program = _program(pattern, mesh, axes, size)
    k = mesh.axis_size(axes)
    kinds = _kinds(program)
    assert kinds.count("collective_permute") == k - 1, str(program)
    assert not {"all_gather", "reduce_scatter", "all_reduce"} & set(kinds), str(program)
    _assert_each_permute_hides_behind_an_einsum(program)
    check_program(program)  # the ring's ops (shard_slice shift, rotated_concat) pass the program-file checks
    want = sr.evaluate(graph, *args)[0]
    for outs in run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm)):
        np.testing.assert_allclose(outs[0], want, rtol=1e-12, atol=1e-12)


def _assert_each_permute_hides_behind_an_einsum(program):
    instrs = program.instrs
    for ins in instrs:
        if ins.op == "collective_permute_done":
            between = [i.op for i in instrs[ins.args[0] + 1:ins.out]]
            assert "einsum" in between, f"nothing computes during %{ins.args[0]}'s permute:\n{program}"
    assert not [i for i in instrs if i.op == "collective_permute"], f"a permute left blocking:\n{program}"


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_off_by_default_and_below_the_threshold(pattern, monkeypatch):
    monkeypatch.delenv(WINDOWED_ENV, raising=False)
    mesh = sr.Mesh((4,), ("x",))
    plain = _kinds(_program(pattern, mesh, ("x",), 24, windowed=None)[2])
    assert "collective_permute" not in plain and {"all_gather", "reduce_scatter"} & set(plain)
    assert _kinds(_program(pattern, mesh, ("x",), 24, windowed=1 << 30)[2]) == plain
    monkeypatch.setenv(WINDOWED_ENV, "0")
    assert _kinds(_program(pattern, mesh, ("x",), 24, windowed=None)[2]).count("collective_permute") == 3
    # without the overlap pass nothing would hide the permutes: the collective stays
    assert _kinds(_program(pattern, mesh, ("x",), 24, windowed=0, overlap=False)[2]) == plain


def test_a_costly_permute_keeps_the_collective():
    """A measured profile whose permutes pay a large per-message latency: (k - 1) exposed permutes cost more
    than the one collective, and the cost model keeps it."""
    mesh = sr.Mesh((4,), ("x",))
    slow = CostModel("slow permutes", (("collective_permute", 4, 1e-3, 1e-10),))
    for pattern in PATTERNS:
        plain = _kinds(_program(pattern, mesh, ("x",), 24, windowed=None)[2])
        assert _kinds(_program(pattern, mesh, ("x",), 24, cost_profile=slow)[2]) == plain


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_threshold_is_refused_naming_it(value, monkeypatch):
    monkeypatch.setenv(WINDOWED_ENV, value)
    with pytest.raises(ValueError, match=WINDOWED_ENV):
        _program("gather_kept", sr.Mesh((2,), ("x",)), ("x",), 24, windowed=None)
    with pytest.raises(ValueError, match="windowed_einsum must be a whole number of bytes >= 0"):
        _program("gather_kept", sr.Mesh((2,), ("x",)), ("x",), 24, windowed=-5)


def test_the_listing_shows_the_ring():
    _, _, program = _program("gather_kept", sr.Mesh((4,), ("x",)), ("x",), 24)
    text = str(program)
    assert text.count("collective_permute_start") == 3 and "rotated_concat" in text
    _, _, program = _program("reduce_scatter", sr.Mesh((4,), ("x",)), ("x",), 24)
    assert [i.attrs["shift"] for i in program.instrs if i.op == "shard_slice"] == [1, 2, 3, 0]
    assert all(collective_kind(i.op) in (None, "collective_permute") for i in program.instrs)


@pytest.mark.parametrize("size", [24, 7])
def test_a_second_user_of_the_gathered_operand_takes_the_rings_blocks(size):
    """x gathered for x @ w1 and x @ w2 (attention's q, k, v projections): one ring; the second einsum reads
    the ring's blocks joined, not a second ring."""
    mesh = sr.Mesh((4,), ("x",))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s) for s in [(size, 16), (16, 480), (16, 480)]]
    graph = sr.trace(lambda x, w1, w2: (x @ w1) * (x @ w2), *args)
    program = sr.partition(graph, mesh, in_specs=[("x", None), (None, "x"), (None, "x")], out_specs=[(None, "x")],
                           windowed_einsum=0)
    assert _kinds(program) == ["collective_permute"] * 3, str(program)
    want = sr.evaluate(graph, *args)[0]
    for outs in run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm)):
        np.testing.assert_allclose(outs[0], want, rtol=1e-12, atol=1e-12)
