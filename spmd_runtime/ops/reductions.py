"""Reductions and scans composed of the core reductions (NumPy / Array API 2023.12 names and keywords).

No op of its own: ``any`` / ``all`` are the max / min of bools (a partial one combines by MPI's LOR / LAND),
``prod`` is the core ``prod`` kind, the ``nan*`` reductions replace NaNs by the reduction's identity first,
``std`` is the square root of ``core.var``. ``cumulative_prod`` is a log-step (Hillis-Steele) scan of shifted
products (``slicing`` ops, so it partitions with their halo exchanges and differentiates like them); its
exclusive form also gives ``prod``'s gradient without dividing by zeros (``autodiff/rules/core.py``).
"""
from __future__ import annotations

import math

import numpy as np

from ..trace import Tensor
from . import core
from .core import as_tuple, normalize_axis
from .slicing import concatenate, slice_in_dim
from .windows import cumsum

__all__ = ["any", "all", "prod", "std", "var", "count_nonzero", "cumulative_sum", "cumulative_prod", "cumprod",
           "nansum", "nanmean", "nanmax", "nanmin", "nanprod", "average", "ptp", "exclusive_cumprod"]

prod, var = core.prod, core.var


def any(x, axis=None, keepdims=False) -> Tensor:  # noqa: A001  (NumPy's name)
    """Whether any entry is true: the max of bools (partial ones combine by a logical-or all-reduce)."""
    return core.reduce("max", core.astype(x, "bool"), axis, keepdims)  # empty: False


def all(x, axis=None, keepdims=False) -> Tensor:  # noqa: A001  (NumPy's name)
    """Whether every entry is true: the min of bools (partial ones combine by a logical-and all-reduce)."""
    return core.reduce("min", core.astype(x, "bool"), axis, keepdims)  # empty: True


def std(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, correction=None) -> Tensor:
    return core.sqrt(core.var(x, axis, dtype, out, ddof, keepdims, correction=correction))


def count_nonzero(x, axis=None, keepdims=False) -> Tensor:
    """The number of nonzero entries (NumPy: the platform integer)."""
    return core.sum(core.not_equal(x, 0), axis, keepdims, dtype="int64")


def ptp(x, axis=None, keepdims=False) -> Tensor:
    """Peak to peak: max - min."""
    return core.subtract(core.max(x, axis, keepdims), core.min(x, axis, keepdims))


def average(a, axis=None, weights=None, returned=False, keepdims=False):
    """NumPy's weighted mean: sum(a * w) / sum(w); weights 1-d along a single ``axis`` or of a's shape."""
    a = core.asarray(a)
    if weights is None:
        avg = core.mean(a, axis, keepdims)
        axes = range(a.ndim) if axis is None else [normalize_axis(i, a.ndim) for i in as_tuple(axis)]
        count = math.prod(a.shape[i] for i in axes)
        return (avg, core.full(avg.shape, count, avg.dtype)) if returned else avg
    w = core.asarray(weights)
    if w.shape != a.shape:
        along = axis is not None and len(as_tuple(axis)) == 1 and w.ndim == 1
        if not along or w.shape[0] != a.shape[normalize_axis(as_tuple(axis)[0], a.ndim)]:
            raise ValueError(f"average needs weights of a's shape {a.shape}, or 1-d weights along one axis of "
                             f"its length; got weights {w.shape}, axis {axis!r}")
        w = core.broadcast_in_dim(w, a.shape, (normalize_axis(as_tuple(axis)[0], a.ndim),))
    dtype = np.result_type(a.dtype, w.dtype, np.float32 if a.dtype.itemsize < 8 else np.float64)
    a, w = core.astype(a, dtype), core.astype(w, dtype)
    total = core.sum(w, axis, keepdims)
    avg = core.divide(core.sum(core.multiply(a, w), axis, keepdims), total)
    return (avg, core.broadcast_to(core.astype(total, avg.dtype), avg.shape)) if returned else avg


# ---------------------------------------------------------------- NaN-ignoring reductions
def _is_nan(x: Tensor) -> Tensor:
    return core.not_equal(x, x)


def _nan_to(x, value) -> Tensor:
    x = core.asarray(x)
    return x if x.dtype.kind not in "fc" else core.where(_is_nan(x), np.asarray(value, x.dtype), x)


def nansum(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    return core.sum(_nan_to(x, 0), axis, keepdims, dtype)


def nanprod(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    return core.prod(_nan_to(x, 1), axis, keepdims, dtype)


def nanmean(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    """The mean of the non-NaN entries (NaN where there are none, as NumPy)."""
    x = core._float(core.asarray(x if dtype is None else core.astype(x, dtype)))
    count = core.sum(core.logical_not(_is_nan(x)), axis, keepdims, dtype=x.dtype)
    return core.divide(nansum(x, axis, keepdims), count)


def _nan_extreme(reduce, x, axis, keepdims, fill):
    """``reduce`` of the non-NaN entries; NaN where every entry is NaN (as NumPy, without its warning)."""
    x = core.asarray(x)
    if x.dtype.kind not in "fc":
        return reduce(x, axis, keepdims)
    found = reduce(_nan_to(x, fill), axis, keepdims)
    return core.where(all(_is_nan(x), axis, keepdims), np.asarray(np.nan, x.dtype), found)


def nanmax(x, axis=None, keepdims=False) -> Tensor:
    return _nan_extreme(core.max, x, axis, keepdims, -np.inf)


def nanmin(x, axis=None, keepdims=False) -> Tensor:
    return _nan_extreme(core.min, x, axis, keepdims, np.inf)


# ---------------------------------------------------------------- scans
def _scan_axis(x, axis, what: str):
    """(x, axis): NumPy's axis=None scans the flattened array; the Array API needs an axis above 1-d."""
    x = core.asarray(x)
    if axis is None:
        return core.reshape(x, -1), 0
    if x.ndim == 0:
        raise ValueError(f"{what} needs an array of rank >= 1 along axis {axis}; got a 0-d array")
    return x, normalize_axis(axis, x.ndim)


def _with_initial(y: Tensor, axis: int, initial) -> Tensor:
    """``initial`` prepended along ``axis`` (Array API ``include_initial=True``)."""
    shape = y.shape[:axis] + (1,) + y.shape[axis + 1:]
    return concatenate([core.full(shape, initial, y.dtype), y], axis=axis)


def cumulative_sum(x, /, *, axis=None, dtype=None, include_initial=False) -> Tensor:
    """Array API cumulative_sum: running sums along ``axis`` (required above 1-d), ``0`` first when asked."""
    x = core.asarray(x)
    if axis is None and x.ndim > 1:
        raise ValueError(f"cumulative_sum needs axis= for an array of rank > 1; got shape {x.shape}")
    x, axis = _scan_axis(x, axis, "cumulative_sum")
    y = cumsum(x, axis=axis, dtype=dtype)
    return _with_initial(y, axis, 0) if include_initial else y


def cumulative_prod(x, /, *, axis=None, dtype=None, include_initial=False) -> Tensor:
    """Array API cumulative_prod: running products along ``axis`` (required above 1-d), ``1`` first when asked."""
    x = core.asarray(x)
    if axis is None and x.ndim > 1:
        raise ValueError(f"cumulative_prod needs axis= for an array of rank > 1; got shape {x.shape}")
    x, axis = _scan_axis(x, axis, "cumulative_prod")
    y = _inclusive_products(_prod_operand(x, dtype), axis)
    return _with_initial(y, axis, 1) if include_initial else y


def cumprod(x, axis=None, dtype=None) -> Tensor:
    """NumPy's cumprod: running products along ``axis`` (the flattened array when None)."""
    x, axis = _scan_axis(x, axis, "cumprod")
    return _inclusive_products(_prod_operand(x, dtype), axis)


def exclusive_cumprod(x, axis: int, reverse: bool = False) -> Tensor:
    """Products of the entries strictly before each one along ``axis`` (after it when ``reverse``)."""
    n = x.shape[axis]
    if reverse:
        shifted = concatenate([slice_in_dim(x, 1, n, axis=axis), _ones_at(x, axis)], axis=axis)
        return _inclusive_products(shifted, axis, reverse=True)
    shifted = concatenate([_ones_at(x, axis), slice_in_dim(x, 0, n - 1, axis=axis)], axis=axis)
    return _inclusive_products(shifted, axis)


def _prod_operand(x: Tensor, dtype) -> Tensor:
    if dtype is None and core.sum_dtype(x.dtype) != x.dtype:
        dtype = core.sum_dtype(x.dtype)
    return x if dtype is None else core.astype(x, dtype)


def _ones_at(x: Tensor, axis: int, width: int = 1) -> Tensor:
    return core.ones(x.shape[:axis] + (width,) + x.shape[axis + 1:], x.dtype)


def _inclusive_products(x: Tensor, axis: int, reverse: bool = False) -> Tensor:
    """Hillis-Steele scan: after step s every entry holds the product of the 2**s entries ending at it;
    ceil(log2 n) steps of a shifted copy (ones shifted in) times the running value."""
    n, step = x.shape[axis], 1
    while step < n:
        if reverse:
            shifted = concatenate([slice_in_dim(x, step, n, axis=axis), _ones_at(x, axis, step)], axis=axis)
        else:
            shifted = concatenate([_ones_at(x, axis, step), slice_in_dim(x, 0, n - step, axis=axis)], axis=axis)
        x, step = core.multiply(x, shifted), step * 2
    return x
