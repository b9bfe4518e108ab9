"""Every op of the slice under several shardings on many meshes, in the in-process
simulated world (real data movement between simulated ranks), against the
reference evaluator; the reference itself is checked against NumPy."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

from op_cases import CASES, make_inputs, resolve

MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3), (3, 2), (2, 4), (4, 2))] + [
    sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]

PARAMS = [pytest.param(c, s, id=f"{c.name}-spec{i}") for c in CASES for i, s in enumerate(c.specs)]


def tol(dtype):
    return {"float32": 1e-4, "float64": 1e-10}.get(dtype, 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    np.testing.assert_allclose(sr.evaluate(graph, *args)[0], case.fn(np, *args), rtol=tol(case.dtype), atol=tol(case.dtype))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case,specs", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    expected = sr.evaluate(graph, *args)
    program = sr.partition(graph, mesh, in_specs=[resolve(s, mesh) for s in specs])
    outs = run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm))
    for rank, got in enumerate(outs):
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, f"rank {rank}"
            np.testing.assert_allclose(g, e, rtol=tol(case.dtype), atol=tol(case.dtype), err_msg=f"rank {rank}")
