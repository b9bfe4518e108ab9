"""Array-backend selection: NumPy on the host, or CuPy on a GPU (the names the package has always offered here).

The backends themselves, their registry and ``SPMD_BACKEND`` live in ``exec/backends/``; whether an array
is a device array, and the optional cupy import, in ``spmd_runtime.devices``; the GPU of each rank
(``SPMD_DEVICE``) in ``exec/backends/cupy.py``. Whether MPI may be handed GPU buffers directly
(SPMD_CUDA_AWARE) is decided in spmd_runtime.comm.gpu.cuda_aware_mpi.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from ..devices import array_module_of, is_device_array, to_host
from .backends import NAMES, backend_name, backend_of, get_array_module
from .backends.cupy import gpu_available, select_device

BACKENDS = NAMES


def to_device(x: Any, xp: ModuleType) -> Any:
    """Return ``x`` as an array of module ``xp`` (host->GPU copy for cupy)."""
    return backend_of(xp).to_device(x, xp)


__all__ = [
    "BACKENDS",
    "array_module_of",
    "backend_name",
    "get_array_module",
    "gpu_available",
    "is_device_array",
    "select_device",
    "to_device",
    "to_host",
]
