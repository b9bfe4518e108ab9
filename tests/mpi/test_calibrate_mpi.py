"""calibrate under real MPI: one fit per collective and group size dividing the world, the same on every rank,
and the CLI writes a profile the partitioner loads."""
import pytest
from mpi4py import MPI

from spmd_runtime.calibrate import KINDS, calibrate

WORLD = MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi
def test_calibrate_fits_every_collective_per_group_size():
    doc = calibrate(MPI.COMM_WORLD, sizes=(256, 8192), repeats=2)
    ks = [k for k in range(2, WORLD + 1) if WORLD % k == 0]
    assert [(f["op"], f["k"]) for f in doc["fits"]] == [(op, k) for k in ks for op in KINDS]
    assert all(f["alpha"] >= 0 and f["beta"] >= 0 for f in doc["fits"])
    assert MPI.COMM_WORLD.allgather(doc["fits"]) == [doc["fits"]] * WORLD
