"""Floating-point dtypes, including the 16-bit ones, and the dtypes the collectives carry.

- ``float16``: NumPy's IEEE half. CuPy supports it natively (cuBLAS matmuls with
  float32 accumulation).
- ``bfloat16``: from the optional ``ml_dtypes`` package (the one JAX uses; install
  the ``bf16`` extra). Importing this module registers the name with NumPy so
  ``np.dtype("bfloat16")`` resolves everywhere a dtype travels as a string (graph
  nodes, saved programs, checkpoints). NumPy sees it as kind ``'V'``, not a
  subtype of ``np.floating``: use ``is_floating`` instead of ``np.issubdtype``.
  CuPy has no bfloat16 dtype, so bfloat16 runs on the NumPy backend only; the CuPy
  backend refuses it with an error (``check_backend``) rather than emulating it.

Numerics of 16-bit values (decided here once, used by kernels and collectives):
matmuls/einsums and sum reductions read 16-bit operands, accumulate in float32
and round the result to 16 bits once (what GPU tensor cores do); collectives move
16-bit buffers and reduce in float32 (``comm/low_precision.py``).

What the collectives carry (``COLLECTIVE_DTYPES``, decided here once; ``comm/`` maps it to MPI): bool, the
integers, the floats above and complex64/128, in native byte order. Reductions reduce as NumPy's ufuncs do:
a sum in bool is NumPy's ``add`` on bools, a logical or (``np.sum(x, dtype=bool)`` is ``x.any()``), max/min of
bools a logical or/and; complex numbers are summed, but not ordered (``collective_refusal``). A traced ``sum``
of bools or narrow integers sums in the platform integer first, as NumPy's does (``sum_dtype``).
"""
from __future__ import annotations

import numpy as np

from .devices import is_cupy

try:
    import ml_dtypes
except ImportError:  # optional: float16 works without it
    ml_dtypes = None

if ml_dtypes is not None and "bfloat16" not in np.sctypeDict:
    np.sctypeDict["bfloat16"] = ml_dtypes.bfloat16

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None
LOW_PRECISION = tuple(d for d in (FLOAT16, BFLOAT16) if d is not None)
ACCUMULATE = np.dtype(np.float32)  # what 16-bit matmuls, sums and collective reductions accumulate in
FLOATING = ("float16", "bfloat16", "float32", "float64")
COLLECTIVE_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", *FLOATING,
                     "complex64", "complex128")
_CARRIED = frozenset(np.dtype(name) for name in COLLECTIVE_DTYPES if name != "bfloat16" or BFLOAT16 is not None)
_PLATFORM_INT, _PLATFORM_UINT = np.dtype(np.int_), np.dtype(np.uint)


def dtype(name) -> np.dtype:
    """``np.dtype(name)``, with a clear error for bfloat16 when ml_dtypes is missing."""
    if isinstance(name, str) and name == "bfloat16" and BFLOAT16 is None:
        raise TypeError("dtype 'bfloat16' needs the ml_dtypes package; got it missing "
                        "(pip install -e '.[bf16]', or pip install ml_dtypes)")
    return np.dtype(name)


def is_floating(dt) -> bool:
    """True for float16/32/64 and bfloat16 (which NumPy does not count as np.floating)."""
    dt = np.dtype(dt)
    return np.issubdtype(dt, np.floating) or is_bfloat16(dt)


def is_bfloat16(dt) -> bool:
    """``dt`` is bfloat16 (compared only when ml_dtypes is there: ``np.dtype(x) == None`` is True for float64)."""
    return BFLOAT16 is not None and np.dtype(dt) == BFLOAT16


def is_low_precision(dt) -> bool:
    """True for the 16-bit floating dtypes (float16, bfloat16)."""
    return np.dtype(dt) in LOW_PRECISION


def result_type(*xs) -> np.dtype:
    """``np.result_type`` with Python scalars weak (NEP 50) for bfloat16 too: ml_dtypes promotes
    ``bfloat16`` with a Python float to float64, JAX's rule keeps bfloat16."""
    strong = [x.dtype if hasattr(x, "dtype") else x for x in xs if not isinstance(x, (bool, int, float))]
    if strong and any(is_bfloat16(d) for d in strong):
        out = np.result_type(*strong)
        if is_floating(out):
            return out
    return np.result_type(*[x.dtype if hasattr(x, "dtype") else x for x in xs])


def sum_dtype(dt) -> np.dtype:
    """The dtype NumPy's ``sum`` of ``dt`` values has: bools and integers narrower than the platform integer sum
    in it (unsigned ones in its unsigned twin); every other dtype in itself."""
    dt = np.dtype(dt)
    if dt == np.bool_ or (dt.kind == "i" and dt.itemsize < _PLATFORM_INT.itemsize):
        return _PLATFORM_INT
    if dt.kind == "u" and dt.itemsize < _PLATFORM_UINT.itemsize:
        return _PLATFORM_UINT
    return dt


def collective_refusal(kind: str, dt, op: str | None = None) -> str | None:
    """Why collective ``kind`` (its name) cannot carry ``dt`` arrays, reduced with ``op`` ('sum' | 'max' | 'min'
    or None for a move), or None when it can. One dict lookup (an MPI call costs microseconds more)."""
    dt = np.dtype(dt)
    if dt not in _CARRIED or not dt.isnative:
        name = dt.name if dt.isnative else f"{dt.str} (non-native byte order)"
        return (f"not supported: {kind} of {name} (the collectives carry {', '.join(COLLECTIVE_DTYPES)} in "
                f"native byte order; cast first, e.g. x.astype('float64'))")
    if dt.kind == "c" and op in ("max", "min"):
        return (f"not supported: {kind} of {dt.name} with op {op!r} (NumPy orders complex numbers "
                f"lexicographically, real part first, and MPI's MAX and MIN are defined on real numbers only: "
                f"reduce x.real, x.imag or abs(x) instead)")
    return None


def finfo(dt):
    """``np.finfo`` that also knows bfloat16."""
    dt = np.dtype(dt)
    return ml_dtypes.finfo(dt) if is_bfloat16(dt) else np.finfo(dt)


def check_backend(xp, dt) -> None:
    """Refuse a dtype the array module ``xp`` cannot hold (CuPy has no bfloat16)."""
    if is_bfloat16(dt) and is_cupy(xp):
        raise TypeError("the CuPy backend has no bfloat16 dtype (float16 is native); got a bfloat16 value: "
                        "use float16 on GPUs or SPMD_BACKEND=numpy")


__all__ = ["FLOAT16", "BFLOAT16", "LOW_PRECISION", "ACCUMULATE", "FLOATING", "COLLECTIVE_DTYPES", "dtype",
           "is_floating", "is_low_precision", "result_type", "sum_dtype", "collective_refusal", "finfo",
           "check_backend"]
