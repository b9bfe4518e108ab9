"""sr.shard_map under real MPI: every case of tests/shard_map_cases.py (ring attention over a sequence-split
axis, the hand-written reduce-scatter matmul, each collective, pytrees, a partially manual region) on a
mesh of this world size, values and gradients against the automatic version; bad input refused on every
rank. The simulated tests (tests/unit/test_shard_map.py) cover 1, 2, 4 and 8 ranks, 1-d and 2-d."""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime import P
from spmd_runtime.exec.backend import to_host

from shard_map_cases import CASES, build
from mesh_cases import meshes_for

WORLD = MPI.COMM_WORLD.Get_size()
MESH_1D = sr.Mesh((WORLD,), ("x",))
MESH_2D = next((m for m in meshes_for(WORLD) if len(m.shape) == 2 and min(m.shape) > 1), None)


def _meshes(case):
    return [m for m in (MESH_2D,) if m is not None] if case.two_d else [MESH_1D]


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("grad", [False, True], ids=["value", "grad"])
@pytest.mark.parametrize("case,mesh", [(c, m) for c in CASES for m in _meshes(c)],
                         ids=[f"{c.name}-{m}" for c in CASES for m in _meshes(c)])
def test_region_matches_the_automatic_version(case, mesh, grad):
    region, auto, args = build(case, mesh, grad)
    want = sr.evaluate(auto, *args)
    got = sr.run(sr.partition(region, mesh, in_specs=None if grad else case.in_specs), *args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_host(g), w, rtol=1e-9, atol=1e-11)


@pytest.mark.mpi
def test_ring_attention_collectives_in_comm_summary():
    region, _, args = build(next(c for c in CASES if c.name == "ring_attention"), MESH_1D)
    program = sr.partition(region, MESH_1D, in_specs=(P("x"),) * 3)
    assert program.collectives() == ["collective_permute"] * (2 * (WORLD - 1))


@pytest.mark.mpi
def test_a_collective_over_an_automatic_axis_fails_on_every_rank():
    mesh = sr.Mesh((WORLD, 1), ("x", "y"))
    region = sr.shard_map(lambda x: sr.psum(x, "y"), mesh, in_specs=P("x"), out_specs=P("x"), axis_names="x")
    messages = _messages(sr.jit(region, mesh=mesh), np.ones(2 * WORLD, "float32"))
    assert all("stay automatic" in m for m in messages), messages


def _messages(fn, *args, error=ValueError) -> list[str]:
    try:
        fn(*args)
        message = ""
    except error as e:
        message = str(e)
    return MPI.COMM_WORLD.allgather(message)


@pytest.mark.mpi
def test_a_reduction_over_an_unsupported_dtype_fails_on_every_rank():
    region = sr.shard_map(lambda x: sr.psum(x > 0, "x"), MESH_1D, in_specs=P("x"), out_specs=P())
    messages = _messages(sr.jit(region, mesh=MESH_1D), np.ones(2 * WORLD, "float32"),
                         error=TypeError)  # jit agrees the error, keeping its type
    assert all("TypeError: sr.psum reduces" in m and "got bool" in m for m in messages), messages


@pytest.mark.mpi
@pytest.mark.skipif(WORLD == 1, reason="every size splits evenly one way")
def test_a_block_shape_that_disagrees_with_the_specs_fails_on_every_rank():
    region = sr.shard_map(lambda x: sr.psum(x, "x"), MESH_1D, in_specs=P("x"), out_specs=P())
    messages = _messages(sr.jit(region, mesh=MESH_1D), np.ones(2 * WORLD + 1, "float32"))
    assert all("not divisible" in m for m in messages), messages
