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
of bools or narrow integers sums in the default integer first, as JAX's does (``sum_dtype``).

Promotion follows JAX's type promotion lattice (``LATTICE``, its table below it; ``result_type``): Python scalars
are weak, float32 by default, float64 only where asked for or with ``sr.config.update("enable_x64", True)`` /
``$SPMD_ENABLE_X64=1`` (JAX's ``jax_enable_x64``).
"""
from __future__ import annotations

import os

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


# ================================================================ promotion (JAX's rules)
X64_ENV = "SPMD_ENABLE_X64"


class Config:
    """Switches of the front end, JAX's ``jax.config`` style: ``sr.config.update("enable_x64", True)`` (also
    spelled ``"jax_enable_x64"``), or ``$SPMD_ENABLE_X64=1`` before the first trace. Read when a function is
    traced: set it before tracing (a jit's cached program keeps the dtypes it was traced with)."""

    def __init__(self):
        self._x64 = None  # None: the environment decides

    @property
    def enable_x64(self) -> bool:
        if self._x64 is not None:
            return self._x64
        return os.environ.get(X64_ENV, "0").lower() not in ("0", "", "false", "no")

    def update(self, name: str, value) -> None:
        if name not in ("enable_x64", "jax_enable_x64"):
            raise ValueError(f"sr.config.update knows 'enable_x64' (or 'jax_enable_x64'); got {name!r}")
        self._x64 = bool(value)

    def __repr__(self):
        return f"Config(enable_x64={self.enable_x64})"


config = Config()

# JAX's type promotion lattice (docs.jax.dev/en/latest/type_promotion.html), ONE table: each node and the nodes
# directly above it. ``i*``, ``f*``, ``c*`` are the weak types of Python int, float and complex scalars: they take
# the kind of a strong operand without widening it. The promotion of several operands is their join (least upper
# bound) on this lattice. Its binary table (row, column -> result; x64 rules below):
#
#         b1  u1  u2  u4  u8  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i*  f*  c*
#    b1   b1  u1  u2  u4  u8  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i*  f*  c*
#    u1   u1  u1  u2  u4  u8  i2  i2  i4  i8  bf  f2  f4  f8  c8  c16 u1  f*  c*
#    u2   u2  u2  u2  u4  u8  i4  i4  i4  i8  bf  f2  f4  f8  c8  c16 u2  f*  c*
#    u4   u4  u4  u4  u4  u8  i8  i8  i8  i8  bf  f2  f4  f8  c8  c16 u4  f*  c*
#    u8   u8  u8  u8  u8  u8  f*  f*  f*  f*  bf  f2  f4  f8  c8  c16 u8  f*  c*
#    i1   i1  i2  i4  i8  f*  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i1  f*  c*
#    i2   i2  i2  i4  i8  f*  i2  i2  i4  i8  bf  f2  f4  f8  c8  c16 i2  f*  c*
#    i4   i4  i4  i4  i8  f*  i4  i4  i4  i8  bf  f2  f4  f8  c8  c16 i4  f*  c*
#    i8   i8  i8  i8  i8  f*  i8  i8  i8  i8  bf  f2  f4  f8  c8  c16 i8  f*  c*
#    bf   bf  bf  bf  bf  bf  bf  bf  bf  bf  bf  f4  f4  f8  c8  c16 bf  bf  c8
#    f2   f2  f2  f2  f2  f2  f2  f2  f2  f2  f4  f2  f4  f8  c8  c16 f2  f2  c8
#    f4   f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f8  c8  c16 f4  f4  c8
#    f8   f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  c16 c16 f8  f8  c16
#    c8   c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c16 c8  c16 c8  c8  c8
#    c16  c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16
#    i*   i*  u1  u2  u4  u8  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i*  f*  c*
#    f*   f*  f*  f*  f*  f*  f*  f*  f*  f*  bf  f2  f4  f8  c8  c16 f*  f*  c*
#    c*   c*  c*  c*  c*  c*  c*  c*  c*  c*  c8  c8  c8  c16 c8  c16 c*  c*  c*
#
# A weak result (all operands Python scalars, or e.g. uint64 with int8) becomes the default dtype: without x64
# int32 / float32 / complex64, with x64 int64 / float64 / complex128. Without x64 (the default) nothing is
# widened to 64 bits that was not 64 bits already: a join of 64-bit width no strong operand has (uint32 with
# int32 -> int64) is its 32-bit twin (int32, as JAX without x64), and NumPy scalars and arrays that are operands
# of an op (``x * np.float64(2)``, ``x + np.arange(4.0)``) count as their 32-bit twins (JAX canonicalizes them;
# a NumPy array converted on purpose, ``snp.asarray(a)``, keeps its dtype: a float64 program's constants stay exact).
# Traced tensors (arguments and values) of a 64-bit dtype keep it: float64 comes only from where it was asked
# for. Results are strong: a traced tensor carries no weak flag (JAX's weakly typed arrays), so
# ``snp.where(c, 1.0, 2.0)`` is float32 and then promotes like any float32.
LATTICE = {
    "b1": ("i*",), "i*": ("u1", "i1"), "u1": ("u2", "i2"), "u2": ("u4", "i4"), "u4": ("u8", "i8"), "u8": ("f*",),
    "i1": ("i2",), "i2": ("i4",), "i4": ("i8",), "i8": ("f*",), "f*": ("c*", "f2", "bf"), "bf": ("f4",),
    "f2": ("f4",), "f4": ("c8", "f8"), "f8": ("c16",), "c*": ("c8",), "c8": ("c16",), "c16": (),
}
_CODES = {"b1": "bool", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "i1": "int8", "i2": "int16",
          "i4": "int32", "i8": "int64", "bf": "bfloat16", "f2": "float16", "f4": "float32", "f8": "float64",
          "c8": "complex64", "c16": "complex128"}
_WEAK = {bool: "b1", int: "i*", float: "f*", complex: "c*"}  # a Python bool is a strong bool, as in JAX
# np.dtype -> its lattice node, looked up by the dtype itself: ``dt.name`` is computed in Python (~20 us), and
# tracing asks for a result type on every operation
_CODE_OF = {np.dtype(name): code for code, name in _CODES.items() if name != "bfloat16" or BFLOAT16 is not None}
_DEFAULT = {False: {"i*": "i4", "f*": "f4", "c*": "c8"}, True: {"i*": "i8", "f*": "f8", "c*": "c16"}}
_NARROW = {"i8": "i4", "u8": "u4", "f8": "f4", "c16": "c8"}  # a 64-bit type's 32-bit twin (x64 off)


def _above(code: str) -> frozenset:
    """``code`` and every node above it on the lattice."""
    out, todo = {code}, [code]
    while todo:
        for up in LATTICE[todo.pop()]:
            if up not in out:
                out.add(up)
                todo.append(up)
    return frozenset(out)


_UPPER = {code: _above(code) for code in LATTICE}


def join(*codes: str) -> str:
    """The least upper bound of lattice nodes ``codes``: the one common upper node below all others."""
    common = frozenset.intersection(*(_UPPER[c] for c in codes))
    return next(c for c in common if common <= _UPPER[c])


def _code(x, x64: bool) -> tuple[str, bool]:
    """(lattice node, whether it is strong as given) of operand ``x``: a traced tensor's or a DArray's dtype, or a
    dtype named on its own, is kept; a NumPy array or scalar (or a list) counts as its 32-bit twin without x64."""
    if type(x) in _WEAK:
        return _WEAK[type(x)], False
    if isinstance(x, (np.dtype, type, str)):
        dt, kept = np.dtype(x), True
    elif isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "dtype"):
        dt, kept = np.asarray(x).dtype, False
    else:
        dt, kept = np.dtype(x.dtype), True
    code = _CODE_OF.get(dt)
    if code is None:
        raise TypeError(f"type promotion knows {', '.join(sorted(set(_CODES.values())))} and Python scalars; "
                        f"got {dt} ({type(x).__name__})")
    return (code if x64 or kept else _NARROW.get(code, code)), kept


def result_type(*xs) -> np.dtype:
    """The dtype JAX's rules give operands ``xs`` (traced tensors, arrays, NumPy or Python scalars, dtypes): their
    join on ``LATTICE``; a weak join is the default dtype; without x64 no new 64-bit width (see the table)."""
    x64 = config.enable_x64
    codes = [_code(x, x64) for x in xs]
    out = join(*(c for c, _ in codes))
    out = _DEFAULT[x64].get(out, out)
    if not x64 and out in _NARROW and not any(c in _NARROW for c, _ in codes):
        out = _NARROW[out]
    return dtype(_CODES[out])


def default_float() -> np.dtype:
    """float32, or float64 with x64: what a Python float, ints in a true division or an int's exp become."""
    return np.dtype(_CODES[_DEFAULT[config.enable_x64]["f*"]])


def default_int() -> np.dtype:
    """int32, or int64 with x64: what a Python int becomes on its own."""
    return np.dtype(_CODES[_DEFAULT[config.enable_x64]["i*"]])


def canonical(dt) -> np.dtype:
    """``dt`` as a NumPy value that is not a traced tensor counts (JAX's canonical dtype): its 32-bit twin
    without x64, itself with x64."""
    code, _ = _code(np.empty((), dtype(dt)), config.enable_x64)
    return dtype(_CODES[code])


def sum_dtype(dt) -> np.dtype:
    """The dtype JAX's ``sum`` of ``dt`` values has: bools and integers narrower than the default integer sum in
    it (int32 without x64, int64 with), unsigned ones in its unsigned twin; every other dtype in itself."""
    dt, wide = np.dtype(dt), default_int()
    if dt == np.bool_ or (dt.kind == "i" and dt.itemsize < wide.itemsize):
        return wide
    if dt.kind == "u" and dt.itemsize < wide.itemsize:
        return np.dtype(f"uint{8 * wide.itemsize}")
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


def _dtype_of(x) -> np.dtype:
    """A dtype named on its own, or an array's (a traced tensor's, a DArray's, a NumPy one's)."""
    return np.dtype(x if isinstance(x, (np.dtype, type, str)) else x.dtype)


def can_cast(from_, to, /) -> bool:
    """The Array API's ``can_cast`` (jax.numpy's): whether ``from_`` (a dtype or an array) casts to ``to`` without
    losing values (NumPy's "safe" casting)."""
    return bool(np.can_cast(_dtype_of(from_), np.dtype(to), casting="safe"))


def isdtype(dtype, kind) -> bool:
    """The Array API's ``isdtype``: whether ``dtype`` is of ``kind`` (a dtype, a kind name such as "integral" or
    "real floating", or a tuple of them)."""
    return bool(np.isdtype(np.dtype(dtype), kind))


def check_backend(xp, dt) -> None:
    """Refuse a dtype the array module ``xp`` cannot hold (CuPy has no bfloat16)."""
    if is_bfloat16(dt) and is_cupy(xp):
        raise TypeError("the CuPy backend has no bfloat16 dtype (float16 is native); got a bfloat16 value: "
                        "use float16 on GPUs or SPMD_BACKEND=numpy")


__all__ = ["FLOAT16", "BFLOAT16", "LOW_PRECISION", "ACCUMULATE", "FLOATING", "COLLECTIVE_DTYPES", "dtype",
           "is_floating", "is_low_precision", "result_type", "sum_dtype", "config", "Config", "LATTICE", "join",
           "default_float", "default_int", "canonical", "X64_ENV", "collective_refusal", "finfo",
           "check_backend", "can_cast", "isdtype"]
