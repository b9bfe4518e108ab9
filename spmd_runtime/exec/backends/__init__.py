"""Array backends: what the runtime asks of the array library it computes with, and the registry of them.

A backend is one array library and the code generated for it: ``numpy_c`` (NumPy on the host, fused chains
as ufuncs or generated C loops) and ``cupy`` (CuPy on a GPU, fused chains as generated CUDA kernels). Each
is an object of the ``ArrayBackend`` protocol below, registered by name; ``backend(name)`` finds it,
``backend_of(xp)`` the one of an array module, ``get_array_module`` picks the array module to run with.
Where an array lives (host or device) is ``spmd_runtime.devices``'s to say (the comm layer reads it too);
MPI staging of device buffers is ``comm/gpu.py``'s.

Environment:
    SPMD_BACKEND     "numpy" | "cupy" | "auto" (default auto: cupy when it
                     imports and a GPU is visible, else numpy)

Adding a backend: a module here with an object of this protocol, added to ``REGISTRY`` (and to ``AUTO``
if ``auto`` should try it).
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Protocol, runtime_checkable

from ...devices import is_cupy
from .cupy import CUPY
from .numpy_c import NUMPY_C
from .steps import Fusion, Scratch


@runtime_checkable
class ArrayBackend(Protocol):
    """One array library as the runtime uses it. The kernel methods return None where this backend has no
    kernel of that kind for ``xp`` (the caller then runs the steps as plain ``xp`` calls, exec/fused.py)."""

    name: str  # what SPMD_BACKEND / ``backend=`` call it

    def array_module(self) -> ModuleType:
        """The array module (``xp``), imported; a RuntimeError saying what is missing where it cannot run."""

    def to_device(self, x: Any, xp: ModuleType) -> Any:
        """``x`` (any array) as an array of ``xp`` (a host -> device copy where ``xp``'s memory is a device's);
        device -> host is ``devices.to_host``."""

    def synchronize(self) -> None:
        """Wait until the kernels queued on the current device are done (a timer's end, before MPI reads)."""

    def fusion_kernel(self, fusion: Fusion, xp: ModuleType, operand_dtypes, scratch: Scratch,
                      out=None) -> Callable | None:
        """``f(*operands) -> result`` for a fused elementwise chain; ``out``: a buffer planned for the result
        (exec/buffers.py), where the backend writes into one."""

    def group_kernel(self, interp, group) -> Callable | None:
        """``compute(operands) -> [result per member]`` for a sibling group (exec/groups.Group): one loop."""

    def reduction_kernel(self, fusion: Fusion, xp: ModuleType, operand_dtypes, kind: str, axes,
                         planned) -> Callable | None:
        """``f(*operands) -> result``: a chain reduced (``kind`` over ``axes``) in one kernel, into ``planned``
        when given."""


REGISTRY: dict[str, ArrayBackend] = {b.name: b for b in (NUMPY_C, CUPY)}
AUTO = (CUPY.name, NUMPY_C.name)  # what "auto" tries, in order: the first whose array module loads
NAMES = tuple(REGISTRY)


def backend(name: str) -> ArrayBackend:
    """The backend called ``name`` ("numpy", "cupy")."""
    if name not in REGISTRY:
        raise ValueError(f"an array backend is one of {NAMES}; got {name!r}")
    return REGISTRY[name]


def backend_name(xp: ModuleType) -> str:
    """ "cupy" for the cupy module, else "numpy"."""
    return CUPY.name if is_cupy(xp) else NUMPY_C.name


def backend_of(xp: ModuleType) -> ArrayBackend:
    """The backend of array module ``xp`` (NumPy's for any module but cupy)."""
    return REGISTRY[backend_name(xp)]


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
    if name in NAMES:
        return name
    raise ValueError(f"unknown array backend {backend!r} (from {source}); expected one of {NAMES} or 'auto'")


def get_array_module(backend: str | None = None) -> ModuleType:
    """Return the array module (``numpy`` or ``cupy``) to compute with.

    ``backend``: "numpy", "cupy", "auto" or None. None reads ``SPMD_BACKEND``;
    "auto" (or unset) picks cupy when it imports and a GPU is visible, else
    numpy. Asking for "cupy" without cupy or without a GPU raises RuntimeError.
    """
    name = _normalize(backend)
    if name != "auto":
        return REGISTRY[name].array_module()
    for candidate in AUTO[:-1]:
        try:
            return REGISTRY[candidate].array_module()
        except RuntimeError:
            continue
    return REGISTRY[AUTO[-1]].array_module()


__all__ = ["AUTO", "NAMES", "REGISTRY", "ArrayBackend", "backend", "backend_name", "backend_of",
           "get_array_module"]
