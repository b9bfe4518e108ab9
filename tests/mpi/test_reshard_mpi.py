"""The searched resharding plans under real MPI: block exchanges (all_to_allv) on the 2-d meshes of this world
size, uneven shape (the simulated all-pairs test in tests/unit/test_resharding.py covers every pair)."""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.exec.backend import to_host

from mesh_cases import meshes_for

WORLD = MPI.COMM_WORLD.Get_size()
MESHES = [m for m in meshes_for(WORLD) if min(m.shape) > 1] or meshes_for(WORLD)[:1]
PAIRS = [(("x", "y"), ("y", "x")), (("x", None), ("y", None)), (("y", None), ("x", None)),
         ((("x", "y"), None), ("y", None)), (("x", None), (None, ("y", "x")))]


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_exchanges_move_every_block_to_its_owner(mesh):
    x = np.arange(10 * 7, dtype=np.float64).reshape(10, 7)
    names = set(mesh.axis_names)
    for src, dst in PAIRS:
        if not all(a in names for spec in (src, dst) for d in spec if d for a in ((d,) if isinstance(d, str) else d)):
            continue
        program = sr.partition(sr.trace(lambda a: a * 1.0, x), mesh, in_specs=[src], out_specs=[dst])
        (out,) = sr.run(program, x)
        np.testing.assert_array_equal(to_host(out), x, err_msg=f"{src} -> {dst} on {mesh}\n{program}")
