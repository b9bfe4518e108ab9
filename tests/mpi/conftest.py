"""Shared fixtures for tests run under mpiexec (``pytest --with-mpi``)."""
import pytest
from mpi4py import MPI

from mesh_cases import meshes_for


@pytest.fixture(scope="session")
def world_meshes():
    """Every 1-d and 2-d mesh (plus a device-reordered one) for this MPI world size."""
    return meshes_for(MPI.COMM_WORLD.Get_size())
