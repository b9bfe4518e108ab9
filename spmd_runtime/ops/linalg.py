"""Linear algebra composed of ``einsum`` and the core reductions (NumPy / jax.numpy / Array API 2023.12 names).

No op of its own: ``outer`` / ``inner`` / ``tensordot`` are einsums with spelled-out letters (so they partition
by the einsum rule's letter strategies), ``diagonal`` masks the matrix with two iotas and sums each row (each
shard reads only its block; the result is then sliced to the diagonal's length), the norms are reductions
of ``abs`` (the global 2-norm of a split tensor is one local sum of squares and one all-reduce). Real dtypes:
``vdot`` / ``vecdot`` conjugate nothing. ``spmd_runtime/numpy_linalg.py`` is the ``snp.linalg`` namespace.
"""
from __future__ import annotations

import string

import numpy as np

from ..trace import Tensor
from . import core
from .core import normalize_axis
from .creation import eye
from .decompositions import inv, svdvals
from .einsum import einsum, matmul
from .slicing import broadcasted_iota, concatenate, slice_in_dim

__all__ = ["outer", "inner", "tensordot", "vdot", "vecdot", "diagonal", "trace", "matrix_transpose", "matmul",
           "vector_norm", "matrix_norm", "norm", "cross", "matrix_power", "matrix_rank"]

VECTOR_ORDS = "2, 1, inf, -inf, 0 or any other number"
MATRIX_ORDS = ("fro", "nuc", 1, -1, 2, -2, np.inf, -np.inf)


def outer(a, b) -> Tensor:
    return einsum("i,j->ij", core.reshape(a, -1), core.reshape(b, -1))


def tensordot(a, b, axes=2) -> Tensor:
    """Sum over ``axes``: an int N (a's last N with b's first N) or a pair of axis sequences."""
    a, b = core.asarray(a), core.asarray(b)
    if isinstance(axes, (int, np.integer)):
        n = int(axes)
        if not 0 <= n <= min(a.ndim, b.ndim):
            raise ValueError(f"tensordot's axes={n} must be in [0, min(a.ndim, b.ndim) = {min(a.ndim, b.ndim)}]")
        left, right = list(range(a.ndim - n, a.ndim)), list(range(n))
    else:
        left, right = (list(core.as_tuple(t)) for t in axes)
        left = [normalize_axis(i, a.ndim) for i in left]
        right = [normalize_axis(i, b.ndim) for i in right]
    if len(left) != len(right) or any(a.shape[i] != b.shape[j] for i, j in zip(left, right)):
        raise ValueError(f"tensordot contracts pairs of equal-size axes; got a {a.shape} axes {left}, b {b.shape} "
                         f"axes {right}")
    letters = iter(string.ascii_letters)
    ta = [next(letters) for _ in range(a.ndim)]
    tb = [next(letters) for _ in range(b.ndim)]
    for i, j in zip(left, right):
        tb[j] = ta[i]
    out = [c for i, c in enumerate(ta) if i not in left] + [c for j, c in enumerate(tb) if j not in right]
    return einsum(f"{''.join(ta)},{''.join(tb)}->{''.join(out)}", a, b)


def inner(a, b) -> Tensor:
    a, b = core.asarray(a), core.asarray(b)
    if a.ndim == 0 or b.ndim == 0:
        return core.multiply(a, b)
    return tensordot(a, b, ([-1], [-1]))


def vdot(a, b) -> Tensor:
    """The dot product of the flattened arrays (real dtypes: no conjugation)."""
    return einsum("i,i->", core.reshape(a, -1), core.reshape(b, -1))


def vecdot(x1, x2, /, *, axis=-1) -> Tensor:
    """Array API vecdot: the dot product along ``axis`` of the broadcast operands (real dtypes)."""
    (x1, x2), _, shape = core._operands(x1, x2)
    return core.sum(core.multiply(x1, x2), axis=normalize_axis(axis, len(shape)))


def matrix_transpose(x, /) -> Tensor:
    x = core.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"matrix_transpose needs an array of rank >= 2; got shape {x.shape}")
    return core.swapaxes(x, -1, -2)


# ---------------------------------------------------------------- diagonals
def diagonal(a, offset=0, axis1=0, axis2=1) -> Tensor:
    """NumPy diagonal: entries ``a[..., i, i + offset]`` of the (axis1, axis2) planes, as a last dim."""
    x = core.asarray(a)
    if x.ndim < 2:
        raise ValueError(f"diagonal needs an array of rank >= 2; got shape {x.shape}")
    a1, a2 = normalize_axis(axis1, x.ndim), normalize_axis(axis2, x.ndim)
    if a1 == a2:
        raise ValueError(f"diagonal needs two different axes; got axis1={axis1}, axis2={axis2}")
    offset = int(offset)
    rest = [i for i in range(x.ndim) if i not in (a1, a2)]
    x = core.transpose(x, rest + [a1, a2])
    n1, n2 = x.shape[-2:]
    on = core.equal(broadcasted_iota("int64", (n1, n2), 1), broadcasted_iota("int64", (n1, n2), 0) + offset)
    picked = core.where(core.broadcast_to(on, x.shape), x, np.zeros((), x.dtype))
    rows = core.reduce("max", picked, axis=-1) if x.dtype == np.bool_ else core.sum(picked, axis=-1, dtype=x.dtype)
    first = max(-offset, 0)
    length = max(0, min(n1 - first, n2 - max(offset, 0)))
    return slice_in_dim(rows, first, first + length, axis=-1)


def trace(a, offset=0, axis1=0, axis2=1, dtype=None) -> Tensor:
    """NumPy trace: the sum of ``diagonal(a, offset, axis1, axis2)``."""
    return core.sum(diagonal(a, offset, axis1, axis2), axis=-1, dtype=dtype)


# ---------------------------------------------------------------- norms
def _float_abs(x) -> Tensor:
    return core.absolute(core._float(core.asarray(x)))


def vector_norm(x, /, *, axis=None, keepdims=False, ord=2) -> Tensor:
    """Array API vector_norm over ``axis`` (all dims when None, as one flattened vector)."""
    a = _float_abs(x)
    if ord == 2:
        return core.sqrt(core.sum(core.multiply(a, a), axis, keepdims))
    if ord == 1:
        return core.sum(a, axis, keepdims)
    if ord == np.inf:
        return core.max(a, axis, keepdims)
    if ord == -np.inf:
        return core.min(a, axis, keepdims)
    if ord == 0:
        return core.sum(core.astype(core.not_equal(a, 0), a.dtype), axis, keepdims)
    if isinstance(ord, (int, float, np.number)) and not isinstance(ord, bool):
        p = float(ord)
        return core.power(core.sum(core.power(a, p), axis, keepdims), 1.0 / p)
    raise ValueError(f"vector_norm's ord must be {VECTOR_ORDS}; got ord={ord!r}")


def matrix_norm(x, /, *, keepdims=False, ord="fro") -> Tensor:
    """Array API matrix_norm over the last two dims: 'fro', 1 / -1 (max / min column sum), inf / -inf (rows)."""
    return _matrix_norm(x, (-2, -1), keepdims, ord)


def _matrix_norm(x, axes, keepdims, ord) -> Tensor:
    a = _float_abs(x)
    if a.ndim < 2:
        raise ValueError(f"a matrix norm needs an array of rank >= 2; got shape {a.shape}")
    rows, cols = (normalize_axis(i, a.ndim) for i in axes)
    if ord in ("fro", None):
        return core.sqrt(core.sum(core.multiply(a, a), (rows, cols), keepdims))
    if ord in (2, -2, "nuc") and not isinstance(ord, bool):  # from the singular values of the (rows, cols) planes
        x = core._float(core.asarray(x))  # the singular values of x itself (|x| has others)
        s = svdvals(core.transpose(x, [i for i in range(x.ndim) if i not in (rows, cols)] + [rows, cols]))
        out = core.sum(s, -1) if ord == "nuc" else (core.max if ord == 2 else core.min)(s, -1)
        return core.expand_dims(out, (rows, cols)) if keepdims else out
    if ord in (1, -1, np.inf, -np.inf) and not isinstance(ord, bool):
        summed, across = (rows, cols) if ord in (1, -1) else (cols, rows)
        sums = core.sum(a, summed, keepdims=True)
        pick = core.max if ord > 0 else core.min
        out = pick(sums, across, keepdims=True)
        return out if keepdims else core.squeeze(out, (rows, cols))
    raise ValueError(f"matrix_norm's ord must be one of {MATRIX_ORDS}; got ord={ord!r}")


def norm(x, ord=None, axis=None, keepdims=False) -> Tensor:
    """NumPy's linalg.norm: a vector norm over an int ``axis`` (or of a 1-d array, or of everything when
    ``ord`` is None and ``axis`` is None), a matrix norm over a pair of axes (or of a 2-d array)."""
    x = core.asarray(x)
    if axis is None:
        if ord is None:
            return vector_norm(x, axis=None, keepdims=keepdims)
        axis = tuple(range(x.ndim))
        if x.ndim not in (1, 2):
            raise ValueError(f"norm with an ord needs a 1-d or 2-d array or an axis; got shape {x.shape}, ord={ord!r}")
    axes = core.as_tuple(axis)
    if len(axes) == 1:
        return vector_norm(x, axis=axes[0], keepdims=keepdims, ord=2 if ord is None else ord)
    if len(axes) == 2:
        return _matrix_norm(x, axes, keepdims, "fro" if ord is None else ord)
    raise ValueError(f"norm takes one axis (a vector norm) or two (a matrix norm); got axis={axis!r}")


# ---------------------------------------------------------------- the rest of the Array API's linalg
def cross(x1, x2, /, *, axis=-1) -> Tensor:
    """The cross product of 3-vectors along ``axis`` of the broadcast operands."""
    (a, b), _, shape = core._operands(x1, x2)
    axis = normalize_axis(axis, len(shape)) if shape else 0
    if not shape or shape[axis] != 3:
        raise ValueError(f"cross needs size 3 along axis {axis}; got broadcast shape {shape}")
    part = lambda t, i: slice_in_dim(t, i, i + 1, axis=axis)  # noqa: E731
    return concatenate([part(a, (i + 1) % 3) * part(b, (i + 2) % 3) - part(a, (i + 2) % 3) * part(b, (i + 1) % 3)
                        for i in range(3)], axis=axis)


def matrix_power(x, n, /) -> Tensor:
    """``x`` multiplied by itself ``n`` times (a static int; the identity for 0, powers of ``inv(x)`` below 0), by
    repeated squaring."""
    x = core.asarray(x)
    if isinstance(n, Tensor) or not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise ValueError(f"matrix_power takes a static int n; got n={n!r}")
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"matrix_power takes a stack of square matrices; got shape {x.shape}")
    n = int(n)
    if n < 0:
        x, n = inv(x), -n
    out = core.broadcast_to(eye(x.shape[-1], dtype=x.dtype), x.shape) if n == 0 else None
    while n:
        if n & 1:
            out = x if out is None else matmul(out, x)
        n >>= 1
        if n:
            x = matmul(x, x)
    return out


def matrix_rank(x, /, *, rtol=None) -> Tensor:
    """The number of singular values of each matrix above ``rtol`` times the largest (default rtol: max(M, N) times
    the dtype's eps; an array of rtol broadcasts against the stack)."""
    s = svdvals(x)
    if rtol is None:
        rtol = max(core.asarray(x).shape[-2:]) * float(np.finfo(s.dtype).eps)
    elif isinstance(rtol, Tensor) and rtol.ndim:
        rtol = core.expand_dims(rtol, -1)
    tol = core.multiply(core.max(s, -1, keepdims=True), rtol)
    return core.sum(core.greater(s, tol), -1, dtype="int64")
