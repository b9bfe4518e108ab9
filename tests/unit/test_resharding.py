"""The resharding planner: exact plans for the table in resharding.py, and every
(source, target) pair of 2-d shardings on several meshes moved for real in the
simulated world."""
import itertools

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated
from spmd_runtime.partition.resharding import plan_cost, plan_reshard

S = sr.Sharding
MESH = sr.Mesh((2, 4), ("x", "y"))

def sh(d0, d1, partial=(), op="sum"):
    """2-d sharding from per-dim axis strings: sh("x", "") is [x, R]; sh("xy", "") is [(x,y), R]."""
    return S((tuple(d0), tuple(d1)), tuple(partial), op)


PLANS = [
    (sh("x", ""), sh("", "x"), [("all_to_all", {"axes": ("x",), "split_dim": 1, "concat_dim": 0})]),
    (sh("x", ""), sh("", ""), [("all_gather", {"axes": ("x",), "dim": 0})]),
    (sh("", ""), sh("x", "y"), [("shard_slice", {"dim": 0, "axes": ("x",)}),
                                ("shard_slice", {"dim": 1, "axes": ("y",)})]),
    (sh("x", "", "y"), sh("x", ""), [("all_reduce", {"axes": ("y",), "op": "sum"})]),
    (sh("x", "", "y"), sh("x", "y"), [("reduce_scatter", {"axes": ("y",), "dim": 1, "op": "sum"})]),
    (sh("", "", "xy", "max"), sh("", ""), [("all_reduce", {"axes": ("x", "y"), "op": "max"})]),
    (sh("", "", "y"), sh("x", ""), [("shard_slice", {"dim": 0, "axes": ("x",)}),
                                    ("all_reduce", {"axes": ("y",), "op": "sum"})]),
    (sh("xy", ""), sh("", ""), [("all_gather", {"axes": ("x", "y"), "dim": 0})]),
    (sh("xy", ""), sh("", "xy"), [("all_to_all", {"axes": ("x", "y"), "split_dim": 1, "concat_dim": 0})]),
]


@pytest.mark.parametrize("src,dst,expected", PLANS, ids=lambda v: str(v) if isinstance(v, S) else "")
def test_plan_table(src, dst, expected):
    plan = plan_reshard(src, dst, (8, 8), MESH)
    assert [(s.op, s.attrs) for s in plan.steps] == expected
    assert plan.steps[-1].result == dst


def test_device_order_change_is_one_permute_that_moves_every_block_once():
    plan = plan_reshard(sh("xy", ""), sh("yx", ""), (8, 8), MESH)
    assert [s.op for s in plan.steps] == ["collective_permute"]
    pairs = plan.steps[0].attrs["pairs"]
    assert sorted(p[0] for p in pairs) == sorted(p[1] for p in pairs) == list(range(8))
    # block i under (x,y) order is held by rank x*4+y; under (y,x) by the rank with y*2+x == i
    for src, dst in pairs:
        i = MESH.index_along(src, ("x", "y"))
        assert MESH.index_along(dst, ("y", "x")) == i


def test_costs_follow_the_formulas():
    s, itemsize = (8, 8), 8
    assert plan_cost(sh("x", ""), sh("", ""), s, "float64", MESH) == pytest.approx(1 / 2 * 64 * itemsize)
    assert plan_cost(sh("x", "", "y"), sh("x", ""), s, "float64", MESH) == pytest.approx(
        2 * 3 / 4 * 32 * itemsize)


def test_rematerialisation_is_reported():
    plan = plan_reshard(sh("xy", ""), sh("y", ""), (8, 8), MESH)
    assert plan.notes and "rematerialisation" in plan.notes[0]


def all_shardings(mesh, ndim=2):
    axes = mesh.axis_names
    per_dim = [p for r in range(len(axes) + 1) for p in itertools.permutations(axes, r)]
    for dims in itertools.product(per_dim, repeat=ndim):
        flat = [a for d in dims for a in d]
        if len(flat) == len(set(flat)):
            yield S(dims)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh", [sr.Mesh((2, 4), ("x", "y")), sr.Mesh((3, 2), ("x", "y")),
                                  sr.Mesh((2, 2), ("x", "y"), devices=(3, 1, 2, 0))], ids=str)
@pytest.mark.parametrize("shape", [(24, 24), (10, 7), (5, 3)], ids=str)
def test_every_pair_of_shardings_moves_data_correctly(mesh, shape):
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    shardings = list(all_shardings(mesh))
    programs = []
    for src, dst in itertools.product(shardings, shardings):
        graph = sr.trace(lambda a: a * 1.0, x)
        programs.append(sr.partition(graph, mesh, in_specs=[src], out_specs=[dst]))

    def body(comm):
        from spmd_runtime.exec.runner import shard
        bad = []
        for p in programs:
            local = shard(x, p.inputs[0].sharding, mesh, comm.Get_rank())
            out = sr.run_local(p, local, comm=comm)[0]
            if not np.array_equal(out, shard(x, p.outputs[0].sharding, mesh, comm.Get_rank())):
                bad.append(f"{p.inputs[0].sharding} -> {p.outputs[0].sharding}")
        return bad
    results = run_simulated(mesh.size, body)
    assert results == [[]] * mesh.size
    assert len(programs) == len(shardings) ** 2
