"""Array-backend selection: NumPy on the host, or CuPy on a GPU.

``cupy`` is an optional dependency (``pip install spmd_runtime[gpu]``): it is
only ever imported inside functions here, so the package imports and runs on
machines without it. ``mpi4py.MPI`` is likewise imported lazily (importing it
initialises MPI).

Environment:
    SPMD_BACKEND     "numpy" | "cupy" | "auto" (default auto: cupy when it
                     imports and a GPU is visible, else numpy)
    SPMD_DEVICE      GPU id for this rank (default: node-local rank modulo the
                     number of visible GPUs)

Whether MPI may be handed GPU buffers directly (SPMD_CUDA_AWARE) is decided in
spmd_runtime.comm.gpu.cuda_aware_mpi.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

BACKENDS = ("numpy", "cupy")
_GPU_HINT = "pip install spmd_runtime[gpu]"


def _normalize(backend: str | None) -> str:
    """Return "numpy", "cupy" or "auto" for an argument / env value."""
    if backend is None:
        backend = os.environ.get("SPMD_BACKEND", "")
        source = "SPMD_BACKEND"
    else:
        source = "backend"
    name = str(backend).strip().lower()
    if name in ("", "auto"):
        return "auto"
    if name in BACKENDS:
        return name
    raise ValueError(f"unknown array backend {backend!r} (from {source}); expected one of {BACKENDS} or 'auto'")


def _import_cupy() -> ModuleType:
    """Import cupy or raise a RuntimeError that says what is missing."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except Exception as e:  # ImportError, or cupy failing to load its CUDA libraries
        kind = "ImportError" if isinstance(e, ImportError) else type(e).__name__
        raise RuntimeError(f"backend 'cupy' needs the cupy package ({_GPU_HINT}); got {kind}: {e}") from e
    return cupy


def _gpu_count(cupy: ModuleType) -> int:
    """Number of GPUs visible to this process; raises RuntimeError if none."""
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError when there is no driver / device
        raise RuntimeError(
            "backend 'cupy' needs a visible CUDA GPU; cupy.cuda.runtime.getDeviceCount() raised "
            f"{type(e).__name__}: {e}"
        ) from e
    if n <= 0:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""
        raise RuntimeError(f"backend 'cupy' needs a visible CUDA GPU; found none{extra}")
    return n


def gpu_available() -> bool:
    """True when cupy imports and at least one GPU is visible."""
    try:
        _gpu_count(_import_cupy())
    except RuntimeError:
        return False
    return True


def get_array_module(backend: str | None = None) -> ModuleType:
    """Return the array module (``numpy`` or ``cupy``) to compute with.

    ``backend``: "numpy", "cupy", "auto" or None. None reads ``SPMD_BACKEND``;
    "auto" (or unset) picks cupy when it imports and a GPU is visible, else
    numpy. Asking for "cupy" without cupy or without a GPU raises RuntimeError.
    """
    name = _normalize(backend)
    if name == "numpy":
        return np
    if name == "cupy":
        cupy = _import_cupy()
        _gpu_count(cupy)
        return cupy
    try:  # auto
        cupy = _import_cupy()
        _gpu_count(cupy)
    except RuntimeError:
        return np
    return cupy


def backend_name(xp: ModuleType) -> str:
    """ "cupy" for the cupy module, else "numpy"."""
    return "cupy" if getattr(xp, "__name__", "").split(".")[0] == "cupy" else "numpy"


def is_device_array(x: Any) -> bool:
    """True for a cupy array (checked without importing cupy)."""
    return type(x).__module__.split(".")[0] == "cupy"


def array_module_of(x: Any) -> ModuleType:
    """The module that owns array ``x``: cupy for cupy arrays, else numpy."""
    if is_device_array(x):
        return sys.modules["cupy"]
    return np


def to_host(x: Any) -> np.ndarray:
    """Copy ``x`` to a NumPy array (no copy if it already is one)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


def to_device(x: Any, xp: ModuleType) -> Any:
    """Return ``x`` as an array of module ``xp`` (host->GPU copy for cupy)."""
    if backend_name(xp) == "cupy":
        return xp.asarray(x)
    return to_host(x)


def _local_rank(comm: Any) -> int:
    """Rank of this process among the ranks on its node (collective on comm)."""
    if comm is None:
        from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI

        comm = MPI.COMM_WORLD
    if hasattr(comm, "Split_type"):
        MPI = sys.modules.get("mpi4py.MPI")  # already imported if comm is an mpi4py comm
        if MPI is None:
            from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            return int(local.Get_rank())
        finally:
            if hasattr(local, "Free"):
                local.Free()
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 0


def select_device(comm: Any = None, device: int | str | None = None) -> int | None:
    """Pick and activate this rank's GPU; return its id.

    The device is ``device`` if given, else ``SPMD_DEVICE`` if set, else the
    node-local rank (``comm.Split_type(COMM_TYPE_SHARED)``) modulo the number
    of visible GPUs. Collective over ``comm`` (default ``MPI.COMM_WORLD``) in
    that last case: call it on every rank.

    Without cupy or without a visible GPU it returns None (host run), unless a
    device was asked for explicitly (argument or SPMD_DEVICE): that raises a
    RuntimeError, as does an id outside ``0..count-1``.
    """
    origin = "device argument"
    if device is None:
        env = os.environ.get("SPMD_DEVICE", "").strip()
        if env:
            device, origin = env, "SPMD_DEVICE"
    requested = device is not None
    if requested:
        try:
            device = int(device)
        except (TypeError, ValueError):
            raise ValueError(f"{origin} must be an integer GPU id; got {device!r}") from None

    try:
        cupy = _import_cupy()
        count = _gpu_count(cupy)
    except RuntimeError as e:
        if requested:
            raise RuntimeError(f"{origin}={device} asks for a GPU, but: {e}") from e
        return None

    if not requested:
        device = _local_rank(comm) % count
    elif not 0 <= device < count:
        raise RuntimeError(f"{origin}={device} is out of range: {count} GPU(s) visible (ids 0..{count - 1})")
    cupy.cuda.Device(device).use()
    return device


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
