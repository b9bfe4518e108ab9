"""Sorting: ``sort`` / ``argsort`` (one op, ``sort``) and ``take_along_axis`` (one op), NumPy / Array API
2023.12 semantics, plus ``searchsorted`` composed of comparisons and a sum.

``sort(x, axis=-1, descending=False, stable=True)``: always a stable sort (``stable=False`` permits any order
of equal entries, a stable one among them); descending keeps equal entries in their original order, as the
Array API and jax.numpy (NaNs: last ascending, first descending). ``argsort`` returns int64 positions (NumPy's
intp, as ``argmax``). A graph node has one result, so the op has ``output="values"`` or ``"indices"``.

``take_along_axis(arr, indices, axis)``: NumPy's, the non-axis dims of both broadcast; negative indices count
from the end; out-of-range ones follow ``mode``: "fill" (jax.numpy's default: NaN for floats, the dtype's
minimum for signed integers, maximum for unsigned, True for bools) or "clip".

Both need their axis whole on every rank (``partition/rules/sorting.py``: the other dims keep their split);
the VJPs (``autodiff/rules/sorting.py``): sort's values take the cotangent back through the inverse permutation
(a ``take_along_axis``), ``take_along_axis`` scatters its cotangent by a one-hot sum.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core
from .core import normalize_axis
from .slicing import broadcasted_iota, concatenate, slice_in_dim, stack
from .windows import cumsum

__all__ = ["sort", "argsort", "take_along_axis", "searchsorted", "nonzero", "flatnonzero", "argwhere", "unique",
           "unique_values", "unique_counts", "unique_inverse", "unique_all", "UniqueAllResult", "UniqueCountsResult",
           "UniqueInverseResult"]

SORT = define("sort")
UniqueAllResult = namedtuple("UniqueAllResult", ["values", "indices", "inverse_indices", "counts"])
UniqueCountsResult = namedtuple("UniqueCountsResult", ["values", "counts"])
UniqueInverseResult = namedtuple("UniqueInverseResult", ["values", "inverse_indices"])
TAKE_ALONG_AXIS = define("take_along_axis")
OUTPUTS = ("values", "indices")
INDEX_DTYPE = "int64"  # as argmax / NumPy's intp
MODES = ("fill", "clip")


# ================================================================ traced API
def _sorted(x, axis, descending, stable, output) -> Tensor:
    x = core.asarray(x)
    if axis is None:  # NumPy: the flattened array
        x, axis = core.reshape(x, -1), 0
    if x.ndim == 0:
        raise ValueError(f"sort needs an array of rank >= 1; got shape {x.shape}")
    if stable not in (True, False, None):
        raise ValueError(f"sort's stable must be a bool; got stable={stable!r}")
    axis = normalize_axis(axis, x.ndim)
    dtype = x.dtype if output == "values" else np.dtype(INDEX_DTYPE)
    return emit(SORT, [x], {"axis": axis, "descending": bool(descending), "output": output}, x.shape, dtype)


def sort(a, axis=-1, *, descending=False, stable=True, kind=None, order=None) -> Tensor:
    """The entries of ``a`` sorted along ``axis`` (the flattened array when None)."""
    if order is not None:
        raise ValueError(f"sort orders plain arrays (no structured fields); got order={order!r}")
    return _sorted(a, axis, descending, stable, "values")


def argsort(a, axis=-1, *, descending=False, stable=True, kind=None, order=None) -> Tensor:
    """The int64 positions that sort ``a`` along ``axis``; equal entries in their original order."""
    if order is not None:
        raise ValueError(f"argsort orders plain arrays (no structured fields); got order={order!r}")
    return _sorted(a, axis, descending, stable, "indices")


def take_along_axis(arr, indices, axis, mode=None, fill_value=None) -> Tensor:
    """``out[..., j, ...] = arr[..., indices[..., j, ...], ...]`` along ``axis`` (None: the flattened arr)."""
    x, idx = core.asarray(arr), core.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"take_along_axis needs integer indices; got {idx.dtype}")
    if axis is None:
        x, idx, axis = core.reshape(x, -1), core.reshape(idx, -1), 0
    if x.ndim != idx.ndim or x.ndim == 0:
        raise ValueError(f"take_along_axis needs indices of arr's rank (>= 1); got arr {x.shape}, indices {idx.shape}")
    mode = "fill" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"take_along_axis's mode must be one of {MODES}; got {mode!r}")
    axis = normalize_axis(axis, x.ndim)
    others = np.broadcast_shapes(*[s[:axis] + (1,) + s[axis + 1:] for s in (x.shape, idx.shape)])
    x = core.broadcast_to(x, others[:axis] + (x.shape[axis],) + others[axis + 1:])
    idx = core.broadcast_to(idx, others[:axis] + (idx.shape[axis],) + others[axis + 1:])
    fill = _fill_value(x.dtype) if fill_value is None else fill_value
    attrs = {"axis": axis, "clip": mode == "clip", "fill": np.asarray(fill, x.dtype).item()}
    return emit(TAKE_ALONG_AXIS, [x, idx], attrs, idx.shape, x.dtype)


def searchsorted(a, v, side="left", sorter=None) -> Tensor:
    """Where ``v``'s entries would go in the sorted 1-d ``a`` (NumPy: int64, NaNs sorted last): the number of
    entries of ``a`` before each, counted by one comparison against all of ``a`` (``v.size * a.size`` work)."""
    a, v = core.asarray(a), core.asarray(v)
    if a.ndim != 1:
        raise ValueError(f"searchsorted needs a 1-d sorted array; got shape {a.shape}")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted's side must be 'left' or 'right'; got {side!r}")
    if sorter is not None:
        a = take_along_axis(a, core.asarray(sorter), 0)
    dtype = np.result_type(a.dtype, v.dtype)
    a, v = core.astype(a, dtype), core.astype(v, dtype)
    grid = v.shape + a.shape
    table = core.broadcast_in_dim(a, grid, (v.ndim,))
    probe = core.broadcast_in_dim(v, grid, tuple(range(v.ndim)))
    before = core.less(table, probe) if side == "left" else core.less_equal(table, probe)
    if dtype.kind in "fc":  # NaN sorts after every number: a NaN probe goes after them (and after NaNs, right)
        nan_probe = core.not_equal(probe, probe)
        table_number = core.equal(table, table)
        before = core.logical_or(before, nan_probe if side == "right" else core.logical_and(nan_probe, table_number))
    return core.sum(before, axis=-1, dtype=INDEX_DTYPE)


# ---------------------------------------------------------------- static-size selections (jax.numpy's size=)
def _static_size(size, what: str) -> int:
    if size is None or isinstance(size, Tensor) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"{what} has a data-dependent length: a traced program needs a static size= (JAX's), the "
                         f"result padded with fill_value; got size={size!r}")
    return int(size)


def _first_true(flags: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """(positions of the first ``size`` true entries of the 1-d ``flags`` in order, whether each is real): a
    stable argsort of ``not flags`` lists the true positions first."""
    order = argsort(core.logical_not(flags), stable=True)
    n = flags.shape[0]
    if size > n:  # more slots than entries: the extra ones are padding
        order = concatenate([order, core.zeros((size - n,), INDEX_DTYPE)])
    picked = slice_in_dim(order, 0, size)
    count = core.sum(flags, dtype=INDEX_DTYPE)
    return picked, core.less(broadcasted_iota(INDEX_DTYPE, (size,), 0), count)


def nonzero(a, *, size=None, fill_value=None) -> tuple[Tensor, ...]:
    """The coordinates of the nonzero entries in C order, one int64 array per dim, ``size`` long (static, as
    jax.numpy's ``size=``): padded with ``fill_value`` (0 by default; one per dim or one for all)."""
    x = core.asarray(a)
    size = _static_size(size, "nonzero")
    if x.ndim == 0:
        raise ValueError("nonzero of a 0-d array is deprecated in NumPy and refused here: use atleast_1d first")
    flat = core.reshape(core.not_equal(x, np.zeros((), x.dtype)), -1)
    picked, real = _first_true(flat, size)
    fills = core.as_tuple(0 if fill_value is None else fill_value)
    if len(fills) not in (1, x.ndim):
        raise ValueError(f"nonzero's fill_value must be one value or one per dim ({x.ndim}); got {fill_value!r}")
    out = []
    for d in range(x.ndim):
        coords = core.reshape(broadcasted_iota(INDEX_DTYPE, x.shape, d), -1)
        fill = np.asarray(fills[d % len(fills)], INDEX_DTYPE)
        out.append(core.where(real, take_along_axis(coords, picked, 0, mode="clip"), fill))
    return tuple(out)


def data_dependent(count):
    """Mark a function of static ``size=`` whose eager call (on DArrays, outside a trace) may leave it None:
    ``count(*args, **kwargs)`` (traced, a 0-d int) gives the size, computed by a first program (JAX's eager
    ``jnp.nonzero`` needs no size either). Under a trace ``size=`` stays required."""
    def mark(fn):
        fn.eager_size = count
        return fn
    return mark


def _count_nonzero(a, **kwargs) -> Tensor:
    return core.sum(core.not_equal(core.asarray(a), 0), dtype=INDEX_DTYPE)


nonzero = data_dependent(_count_nonzero)(nonzero)


@data_dependent(_count_nonzero)
def flatnonzero(a, *, size=None, fill_value=None) -> Tensor:
    return nonzero(core.reshape(core.asarray(a), -1), size=size, fill_value=fill_value)[0]


@data_dependent(_count_nonzero)
def argwhere(a, *, size=None, fill_value=None) -> Tensor:
    """``(size, ndim)`` coordinates of the nonzero entries (``nonzero`` stacked as columns)."""
    x = core.asarray(a)
    x = core.reshape(x, (1,)) if x.ndim == 0 else x
    return stack(nonzero(x, size=size, fill_value=fill_value), axis=1)


def unique(ar, return_counts=False, axis=None, *, equal_nan=True, size=None, fill_value=None):
    """The sorted distinct values of the flattened ``ar``, ``size`` long (static, as jax.numpy's ``size=``),
    padded with ``fill_value`` (the smallest value by default, as JAX); NaNs collapse to one when
    ``equal_nan``. ``return_counts``: also each value's count (0 for the padding)."""
    if axis is not None:
        raise ValueError(f"unique works on the flattened array here; got axis={axis!r}")
    size = _static_size(size, "unique")
    s = sort(core.reshape(core.asarray(ar), -1))
    n = s.shape[0]
    if n == 0:
        raise ValueError("unique of an empty array has no fill value to pad with")
    hi, lo = slice_in_dim(s, 1, n), slice_in_dim(s, 0, n - 1)
    differs = core.not_equal(hi, lo)
    if equal_nan and s.dtype.kind in "fc":
        differs = core.logical_and(differs, core.logical_not(core.logical_and(core.not_equal(hi, hi),
                                                                              core.not_equal(lo, lo))))
    first = concatenate([core.ones((1,), "bool"), differs])  # where each run of equal values starts
    picked, real = _first_true(first, size + 1)  # one more start: where the last counted run ends
    fill = slice_in_dim(s, 0, 1) if fill_value is None else core.asarray(np.asarray(fill_value, s.dtype))
    head = lambda t: slice_in_dim(t, 0, size)  # noqa: E731
    values = core.where(head(real), take_along_axis(s, head(picked), 0, mode="clip"), core.reshape(fill, ()))
    if not return_counts:
        return values
    starts = core.where(real, picked, n)  # padding starts at n: a count is the next start minus its own
    return values, core.subtract(slice_in_dim(starts, 1, size + 1), head(starts))


# ---------------------------------------------------------------- the Array API's unique_* (NaNs all distinct)
def _runs(x, size: int):
    """(sorted flat x, the stable order that sorts it, where each run of equal values starts, the positions of the
    first ``size + 1`` run starts, whether each is real) of ``x``; NaNs compare unequal, so each is a run."""
    flat = core.reshape(core.asarray(x), -1)
    order = argsort(flat, stable=True)
    s = take_along_axis(flat, order, 0)
    n = s.shape[0]
    first = concatenate([core.ones((1,), "bool"), core.not_equal(slice_in_dim(s, 1, n), slice_in_dim(s, 0, n - 1))])
    picked, real = _first_true(first, size + 1)
    return s, order, first, picked, real


def _count_runs(x, **kwargs) -> Tensor:
    flat = core.reshape(core.asarray(x), -1)
    n = flat.shape[0]
    if n == 0:
        return core.zeros((), INDEX_DTYPE)
    s = sort(flat)
    return core.sum(core.not_equal(slice_in_dim(s, 1, n), slice_in_dim(s, 0, n - 1)), dtype=INDEX_DTYPE) + 1


def _unique(x, size, want):
    """The parts of ``unique_all`` in ``want``, each ``size`` long (``inverse_indices``: x's shape)."""
    x = core.asarray(x)
    size = _static_size(size, "unique_" + want[-1])
    if x.size == 0:
        empty = core.zeros((0,), x.dtype)
        parts = {"values": empty, "indices": core.zeros((0,), INDEX_DTYPE), "counts": core.zeros((0,), INDEX_DTYPE),
                 "inverse_indices": core.zeros(x.shape, INDEX_DTYPE)}
        return [parts[w] for w in want]
    s, order, first, picked, real = _runs(x, size)
    n = s.shape[0]
    head = lambda t: slice_in_dim(t, 0, size)  # noqa: E731
    at = head(picked)
    parts = {"values": lambda: take_along_axis(s, at, 0, mode="clip"),
             "indices": lambda: take_along_axis(order, at, 0, mode="clip"),
             "counts": lambda: (lambda starts: core.subtract(slice_in_dim(starts, 1, size + 1), head(starts)))(
                 core.where(real, picked, n)),
             "inverse_indices": lambda: core.reshape(take_along_axis(
                 cumsum(first, dtype=INDEX_DTYPE) - 1, argsort(order, stable=True), 0), x.shape)}
    return [parts[w]() for w in want]


@data_dependent(_count_runs)
def unique_values(x, /, *, size=None):
    """The Array API's ``unique_values``: the sorted distinct values of the flattened ``x`` (each NaN distinct);
    ``size`` (static) is their number, given under a trace."""
    return _unique(x, size, ["values"])[0]


@data_dependent(_count_runs)
def unique_counts(x, /, *, size=None) -> UniqueCountsResult:
    return UniqueCountsResult(*_unique(x, size, ["values", "counts"]))


@data_dependent(_count_runs)
def unique_inverse(x, /, *, size=None) -> UniqueInverseResult:
    """The distinct values and, for each entry of ``x``, the position of its value among them (x's shape)."""
    return UniqueInverseResult(*_unique(x, size, ["values", "inverse_indices"]))


@data_dependent(_count_runs)
def unique_all(x, /, *, size=None) -> UniqueAllResult:
    """The distinct values, the first position of each in the flattened ``x``, each entry's value position and
    each value's count."""
    return UniqueAllResult(*_unique(x, size, ["values", "indices", "inverse_indices", "counts"]))


def _fill_value(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if dtype.kind == "i" else info.max
    return np.nan


# ================================================================ kernels
def _stable(xp) -> dict:
    """NumPy's keyword for a stable sort; CuPy's sorts are always stable and refuse any ``kind``."""
    return {"kind": "stable"} if xp is np else {}


def stable_order(xp, x, axis: int, descending: bool):
    """Positions sorting ``x`` along ``axis``, equal entries in their original order. Descending: a stable
    ascending sort of the reversed axis lists equal values from the highest position down; read backwards,
    it gives descending values with equal ones from the lowest position up."""
    if not descending:
        return xp.argsort(x, axis=axis, **_stable(xp))
    n = x.shape[axis]
    flipped = xp.flip(x, axis)
    return n - 1 - xp.flip(xp.argsort(flipped, axis=axis, **_stable(xp)), axis)


@opdef.kernel(SORT)
def _sort_kernel(xp, x, axis, descending, output):
    if output == "values" and not descending:
        return xp.sort(x, axis=axis, **_stable(xp))
    order = stable_order(xp, x, axis, descending)
    return xp.take_along_axis(x, order, axis=axis) if output == "values" else order.astype(INDEX_DTYPE, copy=False)


@opdef.kernel(TAKE_ALONG_AXIS)
def _take_along_axis_kernel(xp, x, indices, axis, clip, fill):
    n = x.shape[axis]
    wrapped = xp.where(indices < 0, indices + n, indices)
    out = xp.take_along_axis(x, xp.clip(wrapped, 0, max(n - 1, 0)), axis=axis)
    if clip:
        return out
    return xp.where((wrapped >= 0) & (wrapped < n), out, xp.asarray(fill, dtype=x.dtype))
