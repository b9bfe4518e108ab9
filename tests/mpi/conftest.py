"""Shared fixtures for tests run under mpiexec (``pytest --with-mpi``).

The suite runs on whichever array backend ``SPMD_BACKEND`` selects (scripts/gpu_check.sh runs
it with ``SPMD_BACKEND=cupy``): ``sr.run`` then returns CuPy arrays, so tests compare
``spmd_runtime.exec.backend.to_host(out)`` with NumPy, never ``out`` itself.
"""
import os

import pytest
from mpi4py import MPI

from mesh_cases import meshes_for
from spmd_runtime.exec import backend


@pytest.fixture(scope="session")
def world_meshes():
    """Every 1-d and 2-d mesh (plus a device-reordered one) for this MPI world size."""
    return meshes_for(MPI.COMM_WORLD.Get_size())


@pytest.fixture(scope="session")
def array_backend() -> str:
    """ "numpy" or "cupy": the array module ``sr.run`` uses in this run (from SPMD_BACKEND)."""
    return backend.backend_name(backend.get_array_module())


def describe_backend() -> str:
    """One line: the array backend, its GPU and whether MPI takes device buffers (shown in pytest's header)."""
    try:
        xp = backend.get_array_module()
    except (RuntimeError, ValueError) as e:  # shown, not raised: the tests report it themselves
        return f"spmd_runtime backend: unavailable ({e})"
    line = f"spmd_runtime backend: {backend.backend_name(xp)} (SPMD_BACKEND={os.environ.get('SPMD_BACKEND', '')!r})"
    if backend.backend_name(xp) == "cupy":
        from spmd_runtime.comm.gpu import cuda_aware_mpi
        transfer = "direct (CUDA-aware)" if cuda_aware_mpi() else "staged through pinned host memory"
        line += (f", {xp.cuda.runtime.getDeviceCount()} GPU(s) visible, SPMD_DEVICE="
                 f"{os.environ.get('SPMD_DEVICE', '')!r}, MPI transfers {transfer}")
    return line


def pytest_report_header(config):
    return [f"{describe_backend()}; {MPI.Get_library_version().splitlines()[0].strip()}"]
