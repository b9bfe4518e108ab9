"""The op table under real MPI: every case and sharding on every 1-d and 2-d mesh of
this world size (plus a device-reordered one), against the reference evaluator.

Run as ``mpiexec -n N python -m pytest --with-mpi tests/mpi``; the parameters are
built from N at collection time, so each world size runs its own meshes. From 3 ranks up each case and
sharding runs on one mesh, one that splits two axes where the world has it (2x2; 2x4, 4x2), and on a sample of the others
(``sample_at_large_world``, tests/mpi/conftest.py).
"""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.exec.backend import to_host

from mesh_cases import meshes_for, splits_two_axes
from op_cases import all_cases, partition_case, tolerance

CASES = all_cases()

WORLD = MPI.COMM_WORLD.Get_size()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in meshes_for(WORLD)]


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
@pytest.mark.sample_at_large_world(group=lambda case, specs, mesh: f"{case.name}-{specs}",
                                   specific=lambda case, specs, mesh: splits_two_axes(mesh.shape))
def test_partitioned_matches_reference(case, specs, mesh):
    graph, program, args, expected = partition_case(case, specs, mesh)
    got = sr.run(program, *args)
    tol = tolerance(case.dtype)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(to_host(g), e, rtol=tol, atol=tol)


@pytest.mark.mpi
def test_run_local_returns_this_ranks_shards():
    mesh = sr.Mesh((WORLD,), ("x",))
    x = np.arange(WORLD * 6 * 4, dtype=np.float64).reshape(WORLD * 6, 4)
    program = sr.partition(sr.trace(lambda a: a * 2.0, x), mesh, in_specs=[("x", None)])
    rank = MPI.COMM_WORLD.Get_rank()
    local = x[rank * 6:(rank + 1) * 6]
    (out,) = sr.run_local(program, local)
    np.testing.assert_array_equal(to_host(out), 2.0 * local)


@pytest.mark.mpi
def test_bad_input_on_one_rank_raises_on_every_rank():
    mesh = sr.Mesh((WORLD,), ("x",))
    program = sr.partition(sr.trace(lambda a: a.sum(), sr.TensorSpec((WORLD * 2, 3), "float64")), mesh, in_specs=[("x", None)])
    rank = MPI.COMM_WORLD.Get_rank()
    x = np.ones((WORLD * 2, 3)) if rank != WORLD - 1 else np.ones((WORLD * 2, 4))
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{WORLD - 1}\].*'a' must be float64\[{WORLD * 2}, 3\]"):
        sr.run(program, x)
    # the world is still usable afterwards: nobody is stuck in a collective
    assert MPI.COMM_WORLD.allreduce(1) == WORLD
