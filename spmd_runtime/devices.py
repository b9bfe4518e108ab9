"""Device arrays, told apart one way, and the optional CuPy import (the floor: imports nothing of the package).

Whether an array lives on a device is decided by its type exporting ``__cuda_array_interface__`` (what
mpi4py reads of a CuPy array), so the comm layer's staging, the array backends (``exec/backends/``) and tests
without a GPU (host memory posing as device memory) all agree; the type is asked, not the array, so that CuPy
builds no interface dict for the question. ``cupy`` is an optional dependency (``pip install
spmd_runtime[gpu]``): it is only ever imported inside ``import_cupy``, so the package imports and runs on
machines without it.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

GPU_HINT = "pip install spmd_runtime[gpu]"


_FAILED: list = []  # the error of this process's failed cupy import, kept: retrying searches sys.path again


def import_cupy() -> ModuleType:
    """Import cupy or raise a RuntimeError that says what is missing. A failed import is tried once per
    process: every run resolves its backend (``backend="auto"`` tries cupy first), and each retry searched
    sys.path again, 0.14 ms per training step here. A module placed in ``sys.modules`` is taken as it is."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return cupy
    if not _FAILED:
        try:
            import cupy  # noqa: PLC0415 - optional dependency
            return cupy
        except Exception as e:  # ImportError, or cupy failing to load its CUDA libraries
            _FAILED.append(e)
    e = _FAILED[0]
    kind = "ImportError" if isinstance(e, ImportError) else type(e).__name__
    raise RuntimeError(f"backend 'cupy' needs the cupy package ({GPU_HINT}); got {kind}: {e}") from e


def is_device_array(x: Any) -> bool:
    """True for an array in device memory: its type exports ``__cuda_array_interface__`` (checked without
    importing cupy)."""
    return hasattr(type(x), "__cuda_array_interface__")


def is_cupy(xp: Any) -> bool:
    """Whether the array module ``xp`` is cupy (checked by name, without importing cupy)."""
    return getattr(xp, "__name__", "").split(".")[0] == "cupy"


def array_module_of(x: Any) -> ModuleType:
    """The module that owns array ``x``: cupy for device arrays, else numpy."""
    if is_device_array(x):
        return sys.modules["cupy"]
    return np


def to_host(x: Any) -> np.ndarray:
    """Copy ``x`` to a NumPy array (no copy if it already is one)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


def scatter_add(xp: ModuleType, target, rows, values) -> None:
    """``target[rows[i]] += values[i]`` in place on array module ``xp``, repeated rows accumulating: the ufunc's
    ``at`` where ``xp`` has it, else CuPy's ``cupyx.scatter_add``."""
    if hasattr(xp.add, "at"):
        xp.add.at(target, rows, values)
    else:  # CuPy without ufunc.at
        import cupyx  # here, not at the top: cupy is an optional dependency
        cupyx.scatter_add(target, rows, values)
