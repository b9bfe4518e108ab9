"""Every op of the slice under several shardings on many meshes, in the in-process
simulated world (real data movement between simulated ranks), against the
reference evaluator; the reference itself is checked against NumPy."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

from op_cases import CASES, make_inputs, partition_case, tolerance

# The family tables (tests/op_cases_<family>.py) run in their own test_<family>.py; the MPI suite runs all.

MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3), (3, 2), (2, 4), (4, 2))] + [
    sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]

PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(sr.evaluate(graph, *args)[0], case.fn(np, *args), rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    graph, program, args, expected = partition_case(case, specs, mesh)
    outs = run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm))
    tol = tolerance(case.dtype)
    for rank, got in enumerate(outs):
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, f"rank {rank}"
            np.testing.assert_allclose(g, e, rtol=tol, atol=tol, err_msg=f"rank {rank}")
