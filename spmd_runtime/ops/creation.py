"""Array creation (NumPy / jax.numpy / Array API 2023.12 names and keywords), composed of core ops and iotas.

No op of its own: constants are broadcast scalars, ``eye`` / ``tri`` / ``tril`` / ``triu`` compare two
iotas (each shard computes its own block of the mask, the global array never exists), ``linspace`` /
``logspace`` scale an iota, ``meshgrid`` broadcasts. Default dtype float32 (float64 with x64, as jax.numpy's); ``*_like`` keep the
operand's dtype. ``device=`` is accepted for the Array API and must be None, "cpu" or a mesh (a traced tensor
has no device: its placement is the partitioner's).
"""
from __future__ import annotations

import numpy as np

from ..dtypes import default_float
from ..trace import Tensor
from . import core
from .slicing import broadcasted_iota

__all__ = ["asarray", "empty", "empty_like", "zeros_like", "ones_like", "full_like", "eye", "identity", "tri",
           "tril", "triu", "linspace", "logspace", "meshgrid"]



_no_device = core.check_device


def asarray(obj, dtype=None, *, copy=None, device=None) -> Tensor:
    """Array API asarray: tensors pass through (cast when ``dtype`` differs), arrays and scalars become
    constants. ``copy=False`` refuses what needs a copy (a cast, or a host array); tensors are immutable,
    so ``copy=True`` is the same value."""
    _no_device(device, "asarray")
    if copy is False and (not isinstance(obj, Tensor) or (dtype is not None and np.dtype(dtype) != obj.dtype)):
        raise ValueError(f"asarray(copy=False) cannot avoid a copy here (a host value becomes a program constant, "
                         f"a cast makes a new tensor); pass copy=None; got {type(obj).__name__}, dtype={dtype!r}")
    return core.asarray(obj, dtype)


def _float(dtype) -> np.dtype:
    """``dtype``, or the default float type (float32; float64 with x64, as jax.numpy's) for None."""
    return default_float() if dtype is None else np.dtype(dtype)


def _shape(shape) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)


def empty(shape, dtype=None, *, device=None) -> Tensor:
    """Zeros: a traced program has no uninitialised memory to hand out."""
    _no_device(device, "empty")
    return core.zeros(_shape(shape), _float(dtype))


def full_like(a, fill_value, dtype=None, shape=None, *, device=None) -> Tensor:
    _no_device(device, "full_like")
    a = core.asarray(a)
    return core.full(a.shape if shape is None else _shape(shape), fill_value, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, shape=None, *, device=None) -> Tensor:
    return full_like(a, 0, dtype, shape, device=device)


def ones_like(a, dtype=None, shape=None, *, device=None) -> Tensor:
    return full_like(a, 1, dtype, shape, device=device)


def empty_like(a, dtype=None, shape=None, *, device=None) -> Tensor:
    return full_like(a, 0, dtype, shape, device=device)


# ---------------------------------------------------------------- masks from two iotas
def _static_int(v, what: str) -> int:
    if isinstance(v, Tensor) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what} must be a static int (use static_argnums for a jit argument); got {v!r}")
    return int(v)


def _below_diagonal(n: int, m: int, k: int) -> Tensor:
    """Bool (n, m): j <= i + k."""
    rows, cols = broadcasted_iota("int64", (n, m), 0), broadcasted_iota("int64", (n, m), 1)
    return core.less_equal(cols, rows + k)


def eye(N, M=None, k=0, dtype=None, *, device=None) -> Tensor:
    """Ones on the ``k``-th diagonal of an ``N`` x ``M`` matrix."""
    _no_device(device, "eye")
    n = _static_int(N, "eye's N")
    m, k = n if M is None else _static_int(M, "eye's M"), _static_int(k, "eye's k")
    rows, cols = broadcasted_iota("int64", (n, m), 0), broadcasted_iota("int64", (n, m), 1)
    return core.astype(core.equal(cols, rows + k), _float(dtype))


def identity(n, dtype=None) -> Tensor:
    return eye(n, dtype=dtype)


def tri(N, M=None, k=0, dtype=None) -> Tensor:
    """Ones at and below the ``k``-th diagonal."""
    n = _static_int(N, "tri's N")
    m = n if M is None else _static_int(M, "tri's M")
    return core.astype(_below_diagonal(n, m, _static_int(k, "tri's k")), _float(dtype))


def _triangle(x, k, lower: bool, what: str) -> Tensor:
    x = core.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{what} needs an array of rank >= 2 (its last two dims are the matrix); got shape {x.shape}")
    n, m = x.shape[-2:]
    k = _static_int(k, f"{what}'s k")
    keep = _below_diagonal(n, m, k) if lower else core.logical_not(_below_diagonal(n, m, k - 1))
    return core.where(core.broadcast_to(keep, x.shape), x, np.zeros((), x.dtype))


def tril(m, k=0) -> Tensor:
    """``m`` with the entries above the ``k``-th diagonal zeroed (last two dims)."""
    return _triangle(m, k, True, "tril")


def triu(m, k=0) -> Tensor:
    """``m`` with the entries below the ``k``-th diagonal zeroed (last two dims)."""
    return _triangle(m, k, False, "triu")


# ---------------------------------------------------------------- ranges
def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0, *, device=None):
    """``num`` evenly spaced values from ``start`` to ``stop`` (included when ``endpoint``), NumPy's formula:
    start + i * step, the last entry exactly ``stop``. Scalar or array bounds (broadcast, samples along
    ``axis``); computed in ``dtype`` when given and floating, else in the traced bounds' floating dtype, else
    float32 (JAX without x64)."""
    _no_device(device, "linspace")
    num = _static_int(num, "linspace's num")
    if num < 0:
        raise ValueError(f"linspace needs num >= 0; got num={num}")
    traced = [v.dtype for v in (start, stop) if isinstance(v, Tensor)]
    computed = np.result_type(*traced) if traced else np.dtype(_float(dtype))
    computed = computed if computed.kind in "fc" else default_float()
    start, stop = (core.astype(core.asarray(v), computed) for v in (start, stop))
    bounds = np.broadcast_shapes(start.shape, stop.shape)
    div = num - 1 if endpoint else num
    step = core.divide(core.subtract(stop, start), max(div, 1))
    shape = (num,) + bounds
    index = core.astype(broadcasted_iota("int64", shape, 0), computed)
    ramp = core.add(core.broadcast_to(start, shape), core.multiply(index, core.broadcast_to(step, shape)))
    if endpoint and num > 1:
        ramp = core.where(core.equal(broadcasted_iota("int64", shape, 0), num - 1), core.broadcast_to(stop, shape),
                          ramp)
    if bounds:
        ramp = core.moveaxis(ramp, 0, core.normalize_axis(axis, len(shape)))
    out = core.astype(ramp, computed if dtype is None else dtype)
    return (out, step if div else core.full(bounds, np.nan, computed)) if retstep else out


def logspace(start, stop, num=50, endpoint=True, base=10.0, dtype=None, axis=0) -> Tensor:
    """``base ** linspace(start, stop, num)``."""
    exponents = linspace(start, stop, num, endpoint, dtype=dtype, axis=axis)
    out = core.power(np.asarray(base, exponents.dtype), exponents)
    return out if dtype is None else core.astype(out, dtype)


def meshgrid(*xi, copy=True, sparse=False, indexing="xy") -> list[Tensor]:
    """Coordinate grids from 1-d arrays: ``indexing='xy'`` (Cartesian: the first two axes swapped) or
    ``'ij'`` (matrix); ``sparse`` keeps size-1 dims instead of broadcasting."""
    if indexing not in ("xy", "ij"):
        raise ValueError(f"meshgrid's indexing must be 'xy' or 'ij'; got {indexing!r}")
    xs = [core.reshape(core.asarray(x), -1) for x in xi]
    sizes = [x.shape[0] for x in xs]
    if indexing == "xy" and len(xs) > 1:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    out = []
    for i, x in enumerate(xs):
        dim = (1 - i if i < 2 else i) if indexing == "xy" and len(xs) > 1 else i
        shape = tuple(s if d == dim else 1 for d, s in enumerate(sizes)) if sparse else tuple(sizes)
        out.append(core.broadcast_in_dim(x, shape, (dim,)))
    return out
