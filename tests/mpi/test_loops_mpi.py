"""Loops under real MPI: every loop case (scan, fori_loop, while_loop, cond, remat, nested, pytree carries)
on one mesh of this world size (2-d where the size factors, else 1-d), against the reference evaluator.
The simulated tests (tests/unit/test_loops.py) cover 1-d and 2-d meshes of every size."""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.exec.backend import to_host

from loop_cases import CASES, build_case
from mesh_cases import meshes_for

WORLD = MPI.COMM_WORLD.Get_size()
MESHES = ([m for m in meshes_for(WORLD) if len(m.shape) == 2 and min(m.shape) > 1] or meshes_for(WORLD))[:1]


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_loop_matches_reference(case, mesh):
    graph, program, args, expected = build_case(case, mesh)
    got = sr.run(program, *args)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(to_host(g), e, rtol=1e-9, atol=1e-11)


@pytest.mark.mpi
def test_a_body_that_changes_the_carry_fails_on_every_rank():
    def bad(x):
        return sr.scan(lambda c, _: (c[:1], None), x, length=2)[0]
    try:
        sr.trace(bad, sr.TensorSpec((4,)))
        message = ""
    except TypeError as e:
        message = str(e)
    messages = MPI.COMM_WORLD.allgather(message)
    assert all("carry leaf 0" in m for m in messages), messages
