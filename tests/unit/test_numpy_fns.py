"""The non-elementwise NumPy coverage (issue 28: ops/creation.py, manipulation.py, sorting.py, reductions.py,
linalg.py, the prod reduction kind): the case table against NumPy (reference evaluator) and partitioned on the
simulated meshes (1..8 ranks, 1-d and 2-d, reordered devices, even and uneven), the plans' collectives
(sorted axis gathered, product all-reduce), edge semantics, bad input, and VJPs by central differences."""
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from op_cases_numpy_fns import CASES
from simulated import assert_all_ranks, collectives

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x3 = sr.Mesh((2, 3), ("x", "y"))


def evaluate(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)
