"""Slicing family: static slices and basic indexing, pads, concatenation, reversal, iota/arange,
dynamic slices and dynamic updates (XLA's Slice, Pad, Concatenate, Reverse, Iota, DynamicSlice,
DynamicUpdateSlice).

API (re-exported as ``spmd_runtime.numpy.<name>``): ``static_slice`` (XLA Slice: per-dim start, limit,
positive stride; defined here as ``lax_slice`` so the builtin ``slice`` stays usable) and
``slice_in_dim`` (one dim, JAX-style), ``pad`` (NumPy, constant mode) and ``lax_pad`` ((low, high,
interior) per dim), ``concatenate``, ``stack``, ``reverse`` / ``flip``, ``arange``, ``iota``,
``broadcasted_iota``, ``dynamic_slice``, ``dynamic_update_slice``. ``Tensor.__getitem__`` is
``getitem``: NumPy basic indexing (ints, slices with any step, None, Ellipsis) plus 0-d traced
integer indices (a size-1 dynamic slice, negative values wrapping once as in JAX).

Dynamic starts follow XLA: each is clamped to [0, n - size] of the GLOBAL dim (never per shard), and
negative starts are not wrapped. ``dynamic_slice`` with only Python ints folds into a static slice.

Partitioning (GSPMD's elementwise-like ops): a dim that keeps its size keeps its split (propagation
runs at the elementwise level on those dims only) and is computed locally, like an unsplit dim that
changes size. A split dim that changes size takes the plan with the fewest wire bytes among:

- shift (slice / pad with stride 1 and no interior, result split alike in blocks of the same size):
  result block j is the tail of operand block j+q and the head of block j+q+1, moved by at most two
  collective_permutes of the pieces (x[1:] moves one row: a halo exchange). ``reverse`` on a split
  dim is a local reverse plus the same assembly from blocks k-1-j-q and k-2-j-q (q, r from the
  uneven padding), so it moves one block per rank.
- owned (slice / dynamic_slice): each shard writes the result entries it holds into a zero buffer;
  every entry is owned by exactly one shard, so the result is a partial sum that the planner turns
  into an all-reduce, or a reduce-scatter when the result is wanted split.
- exchange: one all_to_allv sends every result block exactly the operand rows it reads (a window map per
  dim, interior padding included) when that moves fewer bytes than the plans above.
- gather: the planner all-gathers the dim, the op runs locally, and a note names the tensor and
  its shardings.
A concatenation along a split dim reads sliced operands straight from the slices' operand: ``roll`` (the
last s rows, then the rest) on a dim split evenly is a rotation of the blocks (at most two
collective_permutes, block numbers modulo k), on an uneven one a single exchange whose window wraps
around the dim; otherwise one exchange per operand writes its rows into the result. The slices then go unused and the partitioner drops them.
``dynamic_update_slice`` on a split dim: with static starts, one exchange sends each update row to the
shard that owns its place (written into its block); with traced starts each shard writes the part of the
(replicated) update that falls in its block.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

from .. import opdef
from ..opdef import ELEMENTWISE_LEVEL, define
from ..partition.propagation import combine
from ..partition.resharding import plan_cost, window_exchange
from ..partition.strategy import Strategy, choose
from ..sharding import Sharding, block_size
from ..trace import Tensor, emit
from . import core
from .spmd import ALL_TO_ALLV, block_pairs

__all__ = ["static_slice", "slice_in_dim", "pad", "lax_pad", "concatenate", "stack", "roll", "reverse", "flip",
           "arange", "iota", "broadcasted_iota", "dynamic_slice", "dynamic_update_slice"]

SLICE = define("slice")
PAD = define("pad")
CONCATENATE = define("concatenate")
REVERSE = define("reverse")
IOTA = define("iota")
DYNAMIC_SLICE = define("dynamic_slice")
DYNAMIC_UPDATE_SLICE = define("dynamic_update_slice")
OWNED_SLICE = define("owned_slice", "program")  # the result entries a shard's block holds, zeros elsewhere
OWNED_DYNAMIC_SLICE = define("owned_dynamic_slice", "program")
OWNED_DYNAMIC_UPDATE_SLICE = define("owned_dynamic_update_slice", "program")
FILL_OUTSIDE = define("fill_outside", "program")  # entries outside a global range set to a value



# ================================================================ traced API
def lax_slice(x, start_indices, limit_indices, strides=None) -> Tensor:
    """XLA Slice: dim d keeps x[start:limit:stride] (static, 0 <= start <= limit <= n, stride >= 1)."""
    x = core.asarray(x)
    start, limit = _ints(start_indices), _ints(limit_indices)
    strides = (1,) * x.ndim if strides is None else _ints(strides)
    ok = len(start) == len(limit) == len(strides) == x.ndim and all(
        0 <= a <= b <= n and s >= 1 for a, b, s, n in zip(start, limit, strides, x.shape))
    if not ok:
        raise ValueError(f"static_slice needs, per dim, 0 <= start <= limit <= size and stride >= 1; got start "
                         f"{start}, limit {limit}, strides {strides} for shape {x.shape}")
    shape = tuple(_count(a, b, s) for a, b, s in zip(start, limit, strides))
    if shape == x.shape:  # start 0 and all of every dim
        return x
    return emit(SLICE, [x], {"start": start, "limit": limit, "strides": strides}, shape, x.dtype)


static_slice = lax_slice


def slice_in_dim(x, start_index, limit_index, stride=1, axis=0) -> Tensor:
    """JAX's slice_in_dim: x[start:limit:stride] along ``axis`` (None and negative bounds as in Python)."""
    x = core.asarray(x)
    axis = core.normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    bound = lambda v, default: default if v is None else int(v) + n if int(v) < 0 else int(v)
    start, limit = [0] * x.ndim, list(x.shape)
    strides = [1] * x.ndim
    start[axis], limit[axis], strides[axis] = bound(start_index, 0), bound(limit_index, n), int(stride)
    return lax_slice(x, start, limit, strides)


def getitem(x, key) -> Tensor:
    """NumPy basic indexing: ints, slices (any step), None, Ellipsis; a 0-d traced integer index is a
    size-1 dynamic slice (clamped, negatives wrapped once). One static slice, then dynamic slices,
    then one reverse for negative steps, then the int-indexed dims are dropped and None dims added."""
    key = _expand_ellipsis(key if isinstance(key, tuple) else (key,), x.ndim)
    start, limit, strides, flips, dynamic, dropped, shape = [], [], [], [], {}, [], []
    dim = 0
    for k in key:
        if k is None:
            shape.append(None)
            continue
        n = x.shape[dim]
        if isinstance(k, slice):
            a, b, s, count, flip = _basic_slice(k, n)
            flips += [dim] if flip else []
            shape.append(count)
        elif isinstance(k, Tensor):
            a, b, s = 0, n, 1
            dynamic[dim] = _wrapped_index(k, n)
            dropped.append(dim)
        else:
            a, b, s = _int_index(k, n), _int_index(k, n) + 1, 1
            dropped.append(dim)
        start.append(a), limit.append(b), strides.append(s)
        dim += 1
    y = lax_slice(x, start, limit, strides)
    if dynamic:
        y = dynamic_slice(y, [dynamic.get(d, 0) for d in range(y.ndim)],
                          [1 if d in dynamic else y.shape[d] for d in range(y.ndim)])
    y = core.reshape(reverse(y, flips), [y.shape[d] for d in range(y.ndim) if d not in dropped])
    new_axes = [i for i, s in enumerate(shape) if s is None]
    return core.expand_dims(y, new_axes) if new_axes else y


def lax_pad(x, padding_value, padding_config) -> Tensor:
    """XLA Pad: per dim (low, high, interior); low/high may be negative (they crop), interior >= 0."""
    x = core.asarray(x)
    value = _scalar_attr(padding_value, x.dtype, "lax_pad padding_value")
    config = [tuple(int(v) for v in c) for c in padding_config]
    sizes = [_padded_size(n, *c) if len(c) == 3 else -1 for n, c in zip(x.shape, config)]
    if len(config) != x.ndim or any(len(c) != 3 or c[2] < 0 for c in config) or min(sizes, default=0) < 0:
        raise ValueError(f"lax_pad needs one (low, high, interior >= 0) per dim, leaving sizes >= 0; got "
                         f"{padding_config} for shape {x.shape}")
    if all(c == (0, 0, 0) for c in config):
        return x
    low, high, interior = (tuple(c[i] for c in config) for i in range(3))
    return emit(PAD, [x], {"low": low, "high": high, "interior": interior, "value": value}, sizes, x.dtype)


def pad(array, pad_width, mode="constant", constant_values=0) -> Tensor:
    """NumPy pad, constant mode with one scalar value: ``pad_width`` as NumPy takes it."""
    x = core.asarray(array)
    if mode != "constant":
        raise NotImplementedError(f"pad supports mode='constant'; got mode={mode!r}")
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (x.ndim, 2))
    values = np.unique(np.asarray(constant_values))
    if (widths < 0).any() or values.size != 1:
        raise ValueError(f"pad needs non-negative widths and one constant value; got pad_width {pad_width}, "
                         f"constant_values {constant_values}")
    return lax_pad(x, values[0], [(int(lo), int(hi), 0) for lo, hi in widths])


def concatenate(arrays, axis=0) -> Tensor:
    """NumPy concatenate (axis=None flattens first); dtypes promote as NumPy does."""
    xs = [core.asarray(a) for a in arrays]
    if not xs:
        raise ValueError("concatenate needs at least one array; got none")
    if axis is None:
        xs, axis = [core.reshape(x, -1) for x in xs], 0
    dtype = np.result_type(*[x.dtype for x in xs])
    xs = [core.astype(x, dtype) for x in xs]
    if xs[0].ndim == 0:
        raise ValueError("concatenate joins arrays of rank >= 1; got zero-dimensional arrays")
    axis = core.normalize_axis(axis, xs[0].ndim)
    other = lambda s: s[:axis] + s[axis + 1:]
    if any(x.ndim != xs[0].ndim or other(x.shape) != other(xs[0].shape) for x in xs):
        raise ValueError(f"concatenate needs equal shapes except along axis {axis}; got {[x.shape for x in xs]}")
    shape = xs[0].shape[:axis] + (sum(x.shape[axis] for x in xs),) + other(xs[0].shape)[axis:]
    xs = [x for x in xs if x.shape[axis]] or xs[:1]  # empty operands add nothing
    if len(xs) == 1:
        return xs[0]
    return emit(CONCATENATE, xs, {"axis": axis}, shape, dtype)


def stack(arrays, axis=0) -> Tensor:
    """NumPy stack: each array gets a new size-1 dim at ``axis``, then they are concatenated."""
    xs = [core.asarray(a) for a in arrays]
    if not xs or any(x.shape != xs[0].shape for x in xs):
        raise ValueError(f"stack needs one or more arrays of one shape; got {[x.shape for x in xs]}")
    axis = core.normalize_axis(axis, xs[0].ndim + 1)
    return concatenate([core.expand_dims(x, axis) for x in xs], axis)


def roll(a, shift, axis=None) -> Tensor:
    """NumPy roll along one axis (None: the flattened array): the last ``shift`` entries first. Traced as the
    concatenation of two slices, which the partitioner recognises as one rotation of the operand."""
    x = core.asarray(a)
    if axis is None:
        return core.reshape(roll(core.reshape(x, -1), shift, 0), x.shape)
    axis = core.normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    s = operator.index(shift) % n if n else 0
    if s == 0:
        return x
    return concatenate([slice_in_dim(x, n - s, n, axis=axis), slice_in_dim(x, 0, n - s, axis=axis)], axis)


def reverse(x, axes) -> Tensor:
    """XLA Rev: x with the order of each dim in ``axes`` reversed (np.flip)."""
    x = core.asarray(x)
    dims = sorted({core.normalize_axis(a, x.ndim) for a in core.as_tuple(axes)})
    dims = tuple(d for d in dims if x.shape[d] > 1)
    if not dims:
        return x
    return emit(REVERSE, [x], {"axes": dims}, x.shape, x.dtype)


def flip(m, axis=None) -> Tensor:
    """NumPy flip: reverse ``axis`` (all dims when None)."""
    x = core.asarray(m)
    return reverse(x, tuple(range(x.ndim)) if axis is None else axis)


def broadcasted_iota(dtype, shape, dimension) -> Tensor:
    """XLA Iota: an array of ``shape`` whose entries are their index along ``dimension``."""
    return _iota(tuple(int(s) for s in shape), int(dimension), dtype, 0, 1)


def iota(dtype, size) -> Tensor:
    """lax.iota: [0, 1, ..., size - 1]."""
    return _iota((int(size),), 0, dtype, 0, 1)


def arange(start, stop=None, step=1, dtype=None) -> Tensor:
    """NumPy arange with static bounds. Each shard computes its own block (the global array never exists)."""
    if stop is None:
        start, stop = 0, start
    if any(isinstance(v, Tensor) for v in (start, stop, step)) or step == 0:
        raise ValueError(f"arange takes static bounds and a non-zero step; got start={start}, stop={stop}, "
                         f"step={step}")
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(*[np.asarray(v).dtype
                                                                        for v in (start, stop, step)])
    if all(isinstance(v, (int, np.integer)) for v in (start, stop, step)):
        count = len(range(int(start), int(stop), int(step)))
    else:
        count = max(math.ceil((stop - start) / step), 0)
    return _iota((count,), 0, dtype, start, step)


def dynamic_slice(x, start_indices, slice_sizes) -> Tensor:
    """XLA DynamicSlice: x[s:s+size] per dim, each start (traced 0-d integer or int) clamped to
    [0, n - size]. With only Python ints this is a static slice."""
    x = core.asarray(x)
    starts, sizes = _start_list(start_indices, x.ndim, "dynamic_slice"), _ints(slice_sizes)
    if len(sizes) != x.ndim or any(not 0 <= m <= n for m, n in zip(sizes, x.shape)):
        raise ValueError(f"dynamic_slice needs one size per dim with 0 <= size <= dim; got {sizes} for "
                         f"shape {x.shape}")
    if not any(isinstance(s, Tensor) for s in starts):
        start = [min(max(int(s), 0), n - m) for s, n, m in zip(starts, x.shape, sizes)]
        return lax_slice(x, start, [a + m for a, m in zip(start, sizes)])
    return emit(DYNAMIC_SLICE, [x] + [_index_operand(s) for s in starts], {"sizes": sizes}, sizes, x.dtype)


def dynamic_update_slice(x, update, start_indices) -> Tensor:
    """XLA DynamicUpdateSlice: x with update written at the starts, each clamped to [0, n - m]
    (update is cast to x's dtype)."""
    x = core.asarray(x)
    update = core.astype(core.asarray(update), x.dtype)
    starts = _start_list(start_indices, x.ndim, "dynamic_update_slice")
    if update.ndim != x.ndim or any(m > n for m, n in zip(update.shape, x.shape)):
        raise ValueError(f"dynamic_update_slice needs an update of x's rank no larger than x in any dim; got "
                         f"update {update.shape} for x {x.shape}")
    if update.size == 0:
        return x
    return emit(DYNAMIC_UPDATE_SLICE, [x, update] + [_index_operand(s) for s in starts], {}, x.shape, x.dtype)


# ---------------------------------------------------------------- API helpers
def _iota(shape, dim, dtype, start, step) -> Tensor:
    dtype = np.dtype(dtype)
    if not 0 <= dim < max(len(shape), 1) or len(shape) == 0:
        raise ValueError(f"iota needs a dimension in [0, {len(shape)}) of a rank >= 1 shape; got dimension "
                         f"{dim} for shape {shape}")
    attrs = {"shape": shape, "dim": dim, "dtype": dtype.name, "start": np.asarray(start).item(),
             "step": np.asarray(step).item()}
    return emit(IOTA, [], attrs, shape, dtype)


def _ints(values) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


def _count(start, limit, stride) -> int:
    return max(-(-(limit - start) // stride), 0)


def _padded_size(n, low, high, interior) -> int:
    return low + high + n + max(n - 1, 0) * interior


def _scalar_attr(value, dtype, what):
    """A Python scalar of ``dtype`` (JSON-able attribute) for a static value."""
    if isinstance(value, Tensor) or np.ndim(value) != 0:
        raise TypeError(f"{what} must be a static scalar; got {value!r}")
    return np.asarray(value).astype(dtype).item()


def _expand_ellipsis(key, ndim):
    bad = [k for k in key if not (k is None or k is Ellipsis or isinstance(k, slice) or _is_int(k)
                                  or (isinstance(k, Tensor) and k.ndim == 0 and k.dtype.kind in "iu"))]
    if bad:
        raise TypeError(f"Tensor indexing takes ints, slices, None, Ellipsis and 0-d integer tensors (basic "
                        f"indexing); got {bad[0]!r}")
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError(f"an index can only have a single ellipsis; got {key}")
    used = sum(k is not None and k is not Ellipsis for k in key)
    if used > ndim:
        raise IndexError(f"too many indices: the tensor has {ndim} dims; got {used} indices in {key}")
    fill = (slice(None),) * (ndim - used)
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        return key[:at] + fill + key[at + 1:]
    return key + fill


def _is_int(k) -> bool:
    if isinstance(k, (bool, np.bool_)) or isinstance(k, Tensor):
        return False
    try:
        operator.index(k)
        return True
    except TypeError:
        return False


def _int_index(k, n) -> int:
    i = operator.index(k)
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for a dim of size {n}")
    return i % n


def _basic_slice(k: slice, n):
    """(start, limit, stride, count, flip) of a Python slice as a positive-stride slice (+ reverse)."""
    a, b, s = k.indices(n)
    count = len(range(a, b, s))
    if count == 0:
        return 0, 0, 1, 0, False
    if s > 0:
        return a, a + (count - 1) * s + 1, s, count, False
    first = a + (count - 1) * s  # smallest index taken; reversed afterwards
    return first, a + 1, -s, count, count > 1


def _wrapped_index(i: Tensor, n):
    return core.where(i < 0, i + n, i)


def _start_list(starts, ndim, what):
    if isinstance(starts, Tensor):
        if starts.ndim != 1:
            raise TypeError(f"{what} start indices are a sequence or a 1-d tensor; got {starts}")
        starts = [starts[i] for i in range(starts.shape[0])]
    starts = list(starts)
    if len(starts) != ndim:
        raise ValueError(f"{what} needs one start index per dim ({ndim}); got {len(starts)}")
    return starts


def _index_operand(s) -> Tensor:
    if isinstance(s, Tensor):
        if s.ndim != 0 or s.dtype.kind not in "iu":
            raise TypeError(f"a dynamic start index is a 0-d integer tensor or an int; got {s}")
        return s
    return core.asarray(np.int64(operator.index(s)))


# ================================================================ kernels
@opdef.kernel(SLICE)
def slice_kernel(xp, x, start, limit, strides):
    # copy: a view would keep the whole unsliced buffer alive
    return x[tuple(slice(a, b, s) for a, b, s in zip(start, limit, strides))].copy()


@opdef.kernel(PAD)
def pad_kernel(xp, x, low, high, interior, value):
    """Fill, place x every interior+1 entries after max(low, 0), then crop negative low/high."""
    inner = [n + max(n - 1, 0) * it for n, it in zip(x.shape, interior)]
    grown = [max(lo, 0) + m + max(hi, 0) for lo, m, hi in zip(low, inner, high)]
    out = xp.full(grown, value, dtype=x.dtype)
    out[tuple(slice(max(lo, 0), max(lo, 0) + m, it + 1) for lo, m, it in zip(low, inner, interior))] = x
    return out[tuple(slice(max(-lo, 0), g - max(-hi, 0)) for lo, hi, g in zip(low, high, grown))]


@opdef.kernel(CONCATENATE)
def concatenate_kernel(xp, *xs, axis):
    return xp.concatenate(xs, axis=axis)


@opdef.kernel(REVERSE)
def reverse_kernel(xp, x, axes):
    return xp.flip(x, axis=tuple(axes))


@opdef.kernel(IOTA)
def iota_kernel(xp, *shard, shape, dim, dtype, start=0, step=1, block=0):
    """start + step * index along ``dim``; given a shard operand, indices start at shard * block."""
    dtype, first = np.dtype(dtype), int(shard[0]) * block if shard else 0
    index = xp.arange(first, first + shape[dim], dtype=np.int64)
    if dtype.kind in "iu" and float(start).is_integer() and float(step).is_integer():
        values = index * int(step) + int(start)
    else:  # as np.arange: start + i * ((start + step) - start), in float64
        values = float(start) + index * ((float(start) + float(step)) - float(start))
    values = values.astype(dtype).reshape([-1 if d == dim else 1 for d in range(len(shape))])
    return xp.broadcast_to(values, tuple(shape))


@opdef.kernel(DYNAMIC_SLICE)
def dynamic_slice_kernel(xp, x, *starts, sizes):
    window = tuple(slice(s, s + m) for s, m in zip(_clamp(starts, x.shape, sizes), sizes))
    return x[window].copy()


@opdef.kernel(DYNAMIC_UPDATE_SLICE)
def dynamic_update_slice_kernel(xp, x, update, *starts):
    out = x.copy()
    out[tuple(slice(s, s + m) for s, m in zip(_clamp(starts, x.shape, update.shape), update.shape))] = update
    return out


def _clamp(starts, shape, sizes) -> list[int]:
    """XLA: each start clamped to [0, n - size]."""
    return [min(max(int(s), 0), n - m) for s, n, m in zip(starts, shape, sizes)]


# ---------------------------------------------------------------- rank-dependent local kernels
@opdef.kernel(OWNED_SLICE)
def owned_slice_kernel(xp, x, *shards, blocks, shape, start, strides, sizes):
    """Static slice of this shard's block: see ``_owned_window``; shards: one per dim with blocks[d] > 0."""
    shards = iter(shards)
    spans = [_span(b, shards, n, a, s, m) for b, n, a, s, m in zip(blocks, shape, start, strides, sizes)]
    return _owned_window(xp, x, spans)


@opdef.kernel(OWNED_DYNAMIC_SLICE)
def owned_dynamic_slice_kernel(xp, x, *operands, blocks, shape, sizes):
    """Dynamic slice of this shard's block; operands: one start per dim, then the shard indices."""
    starts, shards = _clamp(operands[:x.ndim], shape, sizes), iter(operands[x.ndim:])
    spans = [_span(b, shards, n, a, 1, m) for b, n, a, m in zip(blocks, shape, starts, sizes)]
    return _owned_window(xp, x, spans)


@opdef.kernel(OWNED_DYNAMIC_UPDATE_SLICE)
def owned_dynamic_update_slice_kernel(xp, x, update, *operands, blocks, shape, sizes):
    """Write the part of the update that falls in this shard's block (starts clamped globally)."""
    starts, shards = _clamp(operands[:x.ndim], shape, sizes), iter(operands[x.ndim:])
    dst, src = [], []
    for b, n, a, m in zip(blocks, shape, starts, sizes):
        span = _span(b, shards, n, a, 1, m)
        if span is None:
            dst.append(slice(None)), src.append(slice(None))
            continue
        j_lo, j_hi, local = _owned_range(*span)
        dst.append(slice(local, local + j_hi - j_lo)), src.append(slice(j_lo, j_hi))
    out = x.copy()
    out[tuple(dst)] = update[tuple(src)]
    return out


@opdef.kernel(FILL_OUTSIDE)
def fill_outside_kernel(xp, x, shard, dim, block, lo, hi, value):
    """x with the entries of ``dim`` whose global index (shard * block + local) is outside [lo, hi) set to value."""
    first, n = int(shard) * block, x.shape[dim]
    a = min(max(lo - first, 0), n)
    b = min(max(hi - first, a), n)
    if (a, b) == (0, n):
        return x
    out = x.copy()
    out[(slice(None),) * dim + (slice(0, a),)] = value
    out[(slice(None),) * dim + (slice(b, None),)] = value
    return out


def _span(block, shards, n, start, stride, size):
    """How one dim is windowed: None keeps the local block whole (blocks[d] == -1); 0 means unsplit
    (this 'shard' holds all n); otherwise this shard holds block [i*c, i*c+c) of c = ``block``."""
    if block < 0:
        return None
    i, c = (int(next(shards)), block) if block > 0 else (0, n)
    return i, c, n, start, stride, size


def _owned_range(i, c, n, start, stride, size):
    """(j_lo, j_hi, local): result entries j in [j_lo, j_hi) read global index start + j*stride, held by
    shard i (real entries [i*c, min(i*c+c, n))), at local index local + (j - j_lo)*stride."""
    lo, hi = i * c, min(i * c + c, n)
    j_lo = min(max(-(-(lo - start) // stride), 0), size)
    j_hi = min(max(-(-(hi - start) // stride), j_lo), size)
    return j_lo, j_hi, start + j_lo * stride - lo


def _owned_window(xp, x, spans):
    """Zeros except the result entries this shard holds (each entry is held by exactly one shard)."""
    shape, dst, src = list(x.shape), [], []
    for d, span in enumerate(spans):
        if span is None:
            dst.append(slice(None)), src.append(slice(None))
            continue
        j_lo, j_hi, local = _owned_range(*span)
        stride = span[4]
        shape[d] = span[5]
        dst.append(slice(j_lo, j_hi))
        src.append(slice(local, local + (j_hi - j_lo - 1) * stride + 1, stride) if j_hi > j_lo else slice(0, 0))
    out = xp.full(shape, _exact_zero(x.dtype), x.dtype)
    out[tuple(dst)] = x[tuple(src)]
    return out


def _exact_zero(dtype):
    """The zero that adds exactly: -0.0 for floats (-0.0 + v == v bitwise, -0.0 included), else 0."""
    kind = np.dtype(dtype).kind
    return complex(-0.0, -0.0) if kind == "c" else -0.0 if kind == "f" else 0


# ================================================================ sharding propagation
def _on_kept_dims(s: Sharding, src_shape, dst_shape) -> Sharding:
    """``s`` on the dims whose size the op keeps; replicated on the others."""
    return Sharding(tuple(a if n == m else () for a, n, m in zip(s.dims, src_shape, dst_shape)))


@opdef.propagation(SLICE, PAD, DYNAMIC_SLICE, level=ELEMENTWISE_LEVEL)
def _sized_rule():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else _on_kept_dims(ins[0], g.nodes[node.inputs[0]].shape, node.shape)

    def bwd(node, out, ins, g, mesh):
        return [_on_kept_dims(out, node.shape, g.nodes[node.inputs[0]].shape)] + [None] * (len(ins) - 1)
    return fwd, bwd


@opdef.propagation(REVERSE, level=ELEMENTWISE_LEVEL)
def _reverse_rule():
    return (lambda node, ins, g, mesh: ins[0]), (lambda node, out, ins, g, mesh: [out])


@opdef.propagation(CONCATENATE, level=ELEMENTWISE_LEVEL)
def _concatenate_rule():
    def fwd(node, ins, g, mesh):
        return combine([_without_dim(s, node.attrs["axis"]) for s in ins if s is not None])

    def bwd(node, out, ins, g, mesh):
        return [_without_dim(out, node.attrs["axis"])] * len(ins)
    return fwd, bwd


@opdef.propagation(DYNAMIC_UPDATE_SLICE, level=ELEMENTWISE_LEVEL)
def _dynamic_update_slice_rule():
    def fwd(node, ins, g, mesh):
        update = g.nodes[node.inputs[1]].shape
        return combine([ins[0], None if ins[1] is None else _on_kept_dims(ins[1], update, node.shape)])

    def bwd(node, out, ins, g, mesh):
        update = g.nodes[node.inputs[1]].shape
        return [out, _on_kept_dims(out, node.shape, update)] + [None] * (len(ins) - 2)
    return fwd, bwd


@opdef.propagation(IOTA, level=ELEMENTWISE_LEVEL)
def _iota_rule():
    return (lambda *a: None), (lambda *a: [])


def _without_dim(s: Sharding, dim) -> Sharding:
    return Sharding(tuple(() if d == dim else a for d, a in enumerate(s.dims)))


# ================================================================ partitioning
# ---------------------------------------------------------------- iota
@opdef.partition(IOTA)
def _iota_partition(ctx, node):
    """Each shard computes its own block: indices along the split dim start at shard_index * block."""
    target, dim = ctx.sharding(node.id), node.attrs["dim"]
    axes, local = target.dims[dim], target.local_shape(node.shape, ctx.mesh)
    attrs = {**node.attrs, "shape": local}
    if ctx.mesh.axis_size(axes) == 1:
        return ctx.emit_like(node, IOTA, [], attrs, target)
    return ctx.emit_like(node, IOTA, [ctx.shard_index(axes)], {**attrs, "block": local[dim]}, target)


# ---------------------------------------------------------------- reverse
@opdef.partition(REVERSE)
def _reverse_partition(ctx, node):
    """Local reverse; a split dim then takes, for result block j, the tail of reversed block k-1-j-q and
    the head of block k-2-j-q (q, r = divmod(padding, c)): one block's bytes per rank."""
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), target)
    y = ctx.emit_like(node, REVERSE, [x], node.attrs, target)
    for d in node.attrs["axes"]:
        k = ctx.mesh.axis_size(target.dims[d])
        if k > 1:
            c = block_size(node.shape[d], k)
            q, r = divmod(k * c - node.shape[d], c)
            pieces = [(r, c, -1, k - 1 - q)] + ([(0, r, -1, k - 2 - q)] if r else [])
            y = _assemble(ctx, y, d, pieces, target, node.shape)
    return y


# ---------------------------------------------------------------- concatenate
@opdef.partition(CONCATENATE)
def _concatenate_partition(ctx, node):
    """Operands take the result's split on every other dim; along ``axis`` they are joined whole, so a
    split axis is gathered first (an expensive fallback, noted)."""
    axis, target = node.attrs["axis"], ctx.sharding(node.id)
    need = _without_dim(target, axis)
    values = [ctx.value(i) for i in node.inputs]
    split = [(i, v.sharding) for i, v in zip(node.inputs, values)
             if ctx.mesh.axis_size(v.sharding.dims[axis]) > 1]
    sources = [_slice_source(ctx, i, axis) for i in node.inputs]
    split += [(i, v.sharding) for i, (v, _) in zip(node.inputs, sources)
              if ctx.mesh.axis_size(v.sharding.dims[axis]) > 1 and i not in dict(split)]
    if split:
        gather = sum(ctx.cost(v, need) for v, _ in sources)  # a sliced operand: its operand's gather
        plans = _exchange_plans(ctx, node, sources, target)
        exchanged = gather if plans is None else min(gather, sum(a["wire_bytes"] for _, a in plans))
        rotated = _rotation(ctx, node, sources, target, exchanged)
        if rotated is not None:
            return rotated
        if exchanged < gather:
            return _emit_exchanges(ctx, node, plans, target)
        ctx.notes.append(f"concatenate %{node.id} {list(node.shape)} along split dim {axis}: gathers operands "
                         + ", ".join(f"%{i} {s}" for i, s in split) + f" to {need} and joins locally")
    args = [ctx.reshard(v, need) for v in values]
    return ctx.emit_like(node, CONCATENATE, args, node.attrs, need)


def _slice_source(ctx, vid, axis):
    """(value, (start, limit, stride)) read by operand ``vid`` of a concatenation: the operand of a slice that
    cuts only ``axis`` (its rows then move straight from where they lie, and the slice itself goes unused),
    else the operand itself, whole."""
    node = ctx.graph[vid]
    if node.op == SLICE.name:
        src, a = ctx.graph[node.inputs[0]], node.attrs
        if all((a["start"][d], a["limit"][d], a["strides"][d]) == (0, n, 1)
               for d, n in enumerate(src.shape) if d != axis):
            return ctx.value(src.id), (a["start"][axis], a["limit"][axis], a["strides"][axis])
    return ctx.value(vid), (0, node.shape[axis], 1)


def _rotation(ctx, node, sources, target, wire):
    """np.roll (x[n-s:] then x[:n-s], along a dim the result splits evenly) as a rotation of x's blocks: result
    block j is the tail of block j+q and the head of block j+q+1 (mod k), at most two collective_permutes, when
    that moves no more bytes than ``wire`` (the cheaper of the exchanges and the gather); None otherwise."""
    axis = node.attrs["axis"]
    (x, (a0, b0, s0)), (x1, (a1, b1, s1)) = sources if len(sources) == 2 else ((None, (0, 0, 0)),) * 2
    axes, n = target.dims[axis], node.shape[axis]
    k = ctx.mesh.axis_size(axes)
    if x is None or x.slot != x1.slot or (s0, s1, b0, a1, a0) != (1, 1, n, 0, b1) or target.partial or k == 1 \
            or x.shape[axis] != n:
        return None
    if n % k:  # uneven blocks: no block-periodic plan, one exchange with a wrapped window instead
        return _wrapped_exchange(ctx, node, x, a0, target, wire)
    pieces = _shift_pieces(a0, n, k)
    rows = math.prod(target.local_shape(node.shape, ctx.mesh)) // (n // k) * np.dtype(node.dtype).itemsize
    moved = ctx.cost(x, Sharding(target.dims)) + sum(hi - lo for lo, hi, _, q in pieces if q % k) * rows
    if moved > wire:
        return None
    y = ctx.reshard(x, Sharding(target.dims))
    return _assemble(ctx, y, axis, pieces, Sharding(target.dims), node.shape, cyclic=True)


def _wrapped_exchange(ctx, node, x, offset, target, wire):
    """A rotation as one all_to_allv whose window wraps around the dim (result entry p reads x[(p + offset) mod
    n]), when it moves no more than ``wire`` and no pair needs two pieces; None otherwise."""
    if x.sharding.partial:
        return None
    axis = node.attrs["axis"]
    maps = [(offset, 1, node.shape[axis], 0, node.shape[axis], 1, 1) if d == axis else None
            for d in range(len(node.shape))]
    try:
        attrs = window_exchange(x.sharding, target.dims, x.shape, ctx.mesh, maps, np.dtype(node.dtype).itemsize)
    except ValueError:  # a source block holding both ends of some target block's run
        return None
    if attrs["wire_bytes"] > wire:
        return None
    return ctx.emit(ALL_TO_ALLV, [x], attrs, Sharding(target.dims), node.shape, node.dtype)


def _exchange_plans(ctx, node, sources, target):
    """Each operand's rows sent straight to the result blocks that hold them (a sliced operand's rows read from
    the slice's operand): (value, all_to_allv attrs) per operand, None for partial sums."""
    axis, offset = node.attrs["axis"], 0
    itemsize, plans = np.dtype(node.dtype).itemsize, []
    for v, (start, limit, stride) in sources:
        if v.sharding.partial or target.partial:
            return None
        window = (start - stride * offset, stride, node.shape[axis], start, limit)
        maps = [window if d == axis else None for d in range(len(node.shape))]
        plans.append((v, window_exchange(v.sharding, target.dims, v.shape, ctx.mesh, maps, itemsize)))
        offset += _count(start, limit, stride)
    return plans


def _emit_exchanges(ctx, node, plans, target):
    """One all_to_allv per operand, the later ones written into the earlier result."""
    out = None
    for v, attrs in plans:
        out = ctx.emit(ALL_TO_ALLV, [v] + ([out] if out is not None else []), attrs, Sharding(target.dims),
                       node.shape, node.dtype)
    return out


# ---------------------------------------------------------------- slice
@opdef.partition(SLICE)
def _slice_partition(ctx, node):
    """Stages, each on the dims it names: local slice of unsplit dims; gather + local slice (noted);
    owned slice (partial sum); shift (collective_permutes). Slices are separable per dim."""
    x, target = ctx.value(node.inputs[0]), ctx.sharding(node.id)
    start, limit, strides = node.attrs["start"], node.attrs["limit"], node.attrs["strides"]
    if 0 in node.shape:
        return _empty(ctx, node)
    kept = [d for d in range(len(x.shape)) if node.shape[d] == x.shape[d]]
    need = _operand_need(x.sharding, target, kept)

    def shift_pieces(d):
        return _shift_pieces(start[d], x.shape[d], ctx.mesh.axis_size(need.dims[d])) if strides[d] == 1 else None
    modes, wire = _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok=True)
    if {"owned", "gather"} & set(modes.values()):
        maps = [None if d in kept else (start[d], strides[d], node.shape[d]) for d in range(len(x.shape))]
        moved = _exchanged(ctx, node, x, target, maps, wire + ctx.cost(x, need))
        if moved is not None:
            return moved
    by_mode = lambda mode: [d for d, m in sorted(modes.items()) if m == mode]
    y = ctx.reshard(x, need)
    y = _local_slice(ctx, y, [d for d in range(len(x.shape)) if d not in kept and d not in modes], node.attrs)
    if by_mode("gather"):
        y = _local_slice(ctx, _gather_dims(ctx, node, y, by_mode("gather")), by_mode("gather"), node.attrs)
    if by_mode("owned"):
        y = _owned(ctx, y, OWNED_SLICE, [], by_mode("owned"), node.shape,
                   {"start": start, "strides": strides})
    for d in by_mode("shift"):
        y = _assemble(ctx, y, d, shift_pieces(d), y.sharding, y.shape[:d] + node.shape[d:d + 1] + y.shape[d + 1:])
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


def _local_slice(ctx, v, dims, attrs):
    """v sliced as ``attrs`` says on ``dims`` (unsplit), whole on the others."""
    if not dims:
        return v
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    pick = lambda name, d, whole: attrs[name][d] if d in dims else whole
    local_attrs = {"start": tuple(pick("start", d, 0) for d in range(len(local))),
                   "limit": tuple(pick("limit", d, n) for d, n in enumerate(local)),
                   "strides": tuple(pick("strides", d, 1) for d in range(len(local)))}
    shape = tuple(_count(a, b, s) if d in dims else n for d, (a, b, s, n) in
                  enumerate(zip(local_attrs["start"], local_attrs["limit"], local_attrs["strides"], v.shape)))
    return ctx.emit(SLICE, [v], local_attrs, v.sharding, shape, v.dtype)


def _owned(ctx, v, op, operands, dims, sizes, attrs):
    """The owned kernel ``op`` on split ``dims`` of v (others kept whole): a partial sum over their axes."""
    blocks, shards = [-1] * len(v.shape), []
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    for d in dims:
        blocks[d] = local[d]
        shards.append(ctx.shard_index(v.sharding.dims[d]))
    shape = tuple(sizes[d] if d in dims else n for d, n in enumerate(v.shape))
    partial = v.sharding.partial + tuple(a for d in dims for a in v.sharding.dims[d])
    sharding = Sharding(tuple(() if d in dims else a for d, a in enumerate(v.sharding.dims)), partial, "sum")
    all_attrs = {"blocks": tuple(blocks), "shape": v.shape, "sizes": tuple(sizes), **attrs}
    return ctx.emit(op, [v] + operands + shards, all_attrs, sharding, shape, v.dtype)


# ---------------------------------------------------------------- pad
@opdef.partition(PAD)
def _pad_partition(ctx, node):
    """Unsplit dims pad locally; a split dim shifts blocks (no interior padding, result blocks of the
    same size) and fills what lies outside the operand, else it is gathered (noted)."""
    x, target, a = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs
    low, high, interior, value = a["low"], a["high"], a["interior"], a["value"]
    kept = [d for d in range(len(x.shape)) if (low[d], high[d], interior[d]) == (0, 0, 0)]
    need = _operand_need(x.sharding, target, kept)

    def shift_pieces(d):
        return _shift_pieces(-low[d], x.shape[d], ctx.mesh.axis_size(need.dims[d])) if not interior[d] else None
    modes, wire = _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok=False)
    shift = [d for d, m in sorted(modes.items()) if m == "shift"]
    gather = [d for d, m in sorted(modes.items()) if m == "gather"]
    if gather:  # interior padding: target entry low + q * (interior + 1) reads operand entry q
        maps = [None if d in kept else (-low[d], 1, node.shape[d], 0, x.shape[d], interior[d] + 1)
                for d in range(len(x.shape))]
        moved = _exchanged(ctx, node, x, target, maps, wire + ctx.cost(x, need), fill=value)
        if moved is not None:
            return moved
    y = ctx.reshard(x, need)
    if gather:  # before padding: the operand is the smaller
        y = _gather_dims(ctx, node, y, gather)
    local = [(0, 0, 0) if d in shift else (low[d], high[d], interior[d]) for d in range(len(x.shape))]
    if any(c != (0, 0, 0) for c in local):
        attrs = {"low": tuple(c[0] for c in local), "high": tuple(c[1] for c in local),
                 "interior": tuple(c[2] for c in local), "value": value}
        shape = tuple(x.shape[d] if d in shift else node.shape[d] for d in range(len(x.shape)))
        y = ctx.emit(PAD, [y], attrs, y.sharding, shape, node.dtype)
    for d in shift:
        y = _assemble(ctx, y, d, shift_pieces(d), y.sharding, y.shape[:d] + node.shape[d:d + 1] + y.shape[d + 1:])
        c = y.sharding.local_shape(y.shape, ctx.mesh)[d]
        attrs = {"dim": d, "block": c, "lo": low[d], "hi": low[d] + x.shape[d], "value": value}
        y = ctx.emit(FILL_OUTSIDE, [y, ctx.shard_index(y.sharding.dims[d])], attrs, y.sharding, y.shape, y.dtype)
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


# ---------------------------------------------------------------- dynamic slice / update
@opdef.partition(DYNAMIC_SLICE)
def _dynamic_slice_partition(ctx, node):
    """Split dims that change size: owned window (partial sum: all-reduce / reduce-scatter of the
    result) or gather, whichever moves fewer bytes; starts are clamped to the global dims either way.
    Stages: window the unsplit dims; gather + window (noted); owned window."""
    x, target, sizes = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["sizes"]
    starts = [ctx.value(i) for i in node.inputs[1:]]
    if 0 in node.shape:
        return _empty(ctx, node)
    kept = [d for d in range(len(x.shape)) if sizes[d] == x.shape[d]]
    need = _operand_need(x.sharding, target, kept)
    modes, _ = _choose_modes(ctx, node, x, need, target, kept, lambda d: None, owned_ok=True)
    by_mode = lambda mode: [d for d, m in sorted(modes.items()) if m == mode]
    y = ctx.reshard(x, need)
    y = _window(ctx, y, starts, [d for d in range(len(x.shape)) if d not in kept and d not in modes], sizes)
    if by_mode("gather"):
        y = _window(ctx, _gather_dims(ctx, node, y, by_mode("gather")), starts, by_mode("gather"), sizes)
    if by_mode("owned"):
        y = _owned(ctx, y, OWNED_DYNAMIC_SLICE, starts, by_mode("owned"), sizes, {})
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


def _window(ctx, v, starts, dims, sizes):
    """v's clamped window on unsplit ``dims`` (local = global there), whole on the others."""
    if not dims:
        return v
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    shape = tuple(sizes[d] if d in dims else n for d, n in enumerate(v.shape))
    local_sizes = tuple(sizes[d] if d in dims else n for d, n in enumerate(local))
    return ctx.emit(DYNAMIC_SLICE, [v] + starts, {"sizes": local_sizes}, v.sharding, shape, v.dtype)


@opdef.partition(DYNAMIC_UPDATE_SLICE)
def _dynamic_update_slice_partition(ctx, node):
    """x keeps its split; the update is replicated on the dims it does not cover whole, and each shard
    writes the part of it that falls in its block: no communication beyond the update's resharding."""
    target, update = ctx.sharding(node.id), ctx.value(node.inputs[1])
    x = ctx.reshard(ctx.value(node.inputs[0]), target)
    placed = _update_by_exchange(ctx, node, x, update, target)
    if placed is not None:
        return placed
    starts = [ctx.value(i) for i in node.inputs[2:]]
    kept = [d for d in range(len(x.shape)) if update.shape[d] == x.shape[d]]
    need = Sharding(tuple(target.dims[d] if d in kept else () for d in range(len(x.shape))))
    gathered = [d for d in range(len(x.shape)) if d not in kept and ctx.mesh.axis_size(update.sharding.dims[d]) > 1]
    if gathered:
        ctx.notes.append(f"dynamic_update_slice %{node.id}: the update %{node.inputs[1]} {list(update.shape)} is "
                         f"replicated on dims {gathered} ({update.sharding} -> {need}) to be written into x {target}")
    update = ctx.reshard(update, need)
    split = [d for d in range(len(x.shape)) if d not in kept and ctx.mesh.axis_size(target.dims[d]) > 1]
    if not split:
        return ctx.emit_like(node, DYNAMIC_UPDATE_SLICE, [x, update] + starts, {}, target)
    local = target.local_shape(x.shape, ctx.mesh)
    blocks = tuple(-1 if d in kept else local[d] if d in split else 0 for d in range(len(x.shape)))
    shards = [ctx.shard_index(target.dims[d]) for d in split]
    attrs = {"blocks": blocks, "shape": x.shape, "sizes": update.shape}
    return ctx.emit_like(node, OWNED_DYNAMIC_UPDATE_SLICE, [x, update] + starts + shards, attrs, target)


def _update_by_exchange(ctx, node, x, update, target):
    """With static starts, one all_to_allv sends each update row straight to the shard that owns its place in x,
    written into x's block (at most the update's bytes; rows already home stay), when that moves no more than
    replicating the update would; None otherwise (traced starts, partial sums)."""
    consts = [ctx.graph[i] for i in node.inputs[2:]]
    if any(c.op != "constant" for c in consts) or target.partial or update.sharding.partial \
            or not update.sharding.axes:  # a replicated update is written locally, no collective at all
        return None
    starts = _clamp([np.asarray(c.attrs["value"]).item() for c in consts], x.shape, update.shape)
    maps = [(-s, 1, n, 0, m) for s, n, m in zip(starts, x.shape, update.shape)]
    attrs = window_exchange(update.sharding, target.dims, update.shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize)
    replicate = ctx.cost(update, Sharding(((),) * len(x.shape)))
    if attrs["wire_bytes"] > replicate:
        return None
    return ctx.emit(ALL_TO_ALLV, [update, x], attrs, target, node.shape, node.dtype)


# ---------------------------------------------------------------- planning helpers
def _operand_need(src: Sharding, target: Sharding, kept) -> Sharding:
    """The target's split on the dims the op keeps (elementwise-like); on the others the operand's own
    split, where no kept dim of the target uses its axes."""
    used = {a for d in kept for a in target.dims[d]}
    return Sharding(tuple(target.dims[d] if d in kept else () if used & set(axes) else axes
                          for d, axes in enumerate(src.dims)))


def _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok) -> tuple[dict[int, str], float]:
    """'shift', 'owned' or 'gather' per split dim that changes size, the fewest wire bytes winning
    (ties in that order), and the bytes of the choices; bool data never takes 'owned' (its partial sum is
    not an MPI reduction)."""
    mesh, modes, wire = ctx.mesh, {}, 0.0
    local = need.local_shape(x.shape, mesh)
    for d, axes in enumerate(need.dims):
        k = mesh.axis_size(axes)
        if d in kept or k == 1:
            continue
        n, m, tgt = x.shape[d], node.shape[d], target.dims[d]
        rows = math.prod(local[e] if mesh.axis_size(need.dims[e]) > 1 else node.shape[e]
                         for e in range(len(local)) if e != d)
        options = []
        pieces = shift_pieces(d) if tgt == axes and block_size(m, k) == block_size(n, k) else None
        if pieces is not None:
            moved = sum(hi - lo for lo, hi, sign, shift in pieces if (sign, shift) != (1, 0))
            options.append(Strategy(moved * rows * np.dtype(x.dtype).itemsize, plan="shift"))
        one_dim = lambda src, dst, size: plan_cost(src, dst, (size,), x.dtype, mesh) * rows
        to_target = Sharding((tgt,)) if tgt and mesh.axis_size(tgt) <= m else Sharding(((),))
        if owned_ok and np.dtype(x.dtype) != np.bool_:
            options.append(Strategy(one_dim(Sharding(((),), axes), to_target, m), plan="owned"))
        options.append(Strategy(one_dim(Sharding((axes,)), Sharding(((),)), n), plan="gather"))
        best = choose(options)
        modes[d], wire = best.plan, wire + best.wire
    return modes, wire


def _exchanged(ctx, node, x, target, maps, wire, fill=0, into=None):
    """The op as ONE all_to_allv from the operand's blocks straight to the target's (``maps``: per dim the
    (offset, stride, size) window, see resharding.exchange_table) when that moves fewer bytes than ``wire``
    (the gather / owned-sum plan); None otherwise, or for partial sums."""
    if x.sharding.partial or target.partial:
        return None
    attrs = window_exchange(x.sharding, target.dims, x.shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize, fill)
    if attrs["wire_bytes"] >= wire:
        return None
    return ctx.emit(ALL_TO_ALLV, [x] + ([into] if into is not None else []), attrs, Sharding(target.dims),
                    node.shape, node.dtype)


def _gather_dims(ctx, node, v, dims):
    """v with split ``dims`` gathered whole (an expensive fallback, noted)."""
    whole = Sharding(tuple(() if d in dims else a for d, a in enumerate(v.sharding.dims)), v.sharding.partial,
                     v.sharding.reduce_op)
    ctx.notes.append(f"{node.op} %{node.id} {list(ctx.graph[node.inputs[0]].shape)}->{list(node.shape)}: operand "
                     f"%{node.inputs[0]} is gathered on split dims {dims} ({v.sharding} -> {whole}) and "
                     f"{node.op} runs locally")
    return ctx.reshard(v, whole)


def _result_sharding(need, target, kept, modes) -> Sharding:
    """Kept dims as the target, shifted dims as the operand, owned dims partial sums, the rest unsplit."""
    dims = tuple(target.dims[d] if d in kept else axes if modes.get(d) == "shift" else ()
                 for d, axes in enumerate(need.dims))
    partial = tuple(a for d, m in sorted(modes.items()) if m == "owned" for a in need.dims[d])
    return Sharding(dims, partial, "sum")


def _shift_pieces(offset, n, k):
    """Result block j when result entry p reads operand entry p + offset, both in blocks of c: the tail
    [r, c) of block j+q, then the head [0, r) of block j+q+1. A piece is (lo, hi, sign, shift): it comes
    from block sign*j + shift."""
    c = block_size(n, k)
    q, r = divmod(offset, c)
    return [(r, c, 1, q)] + ([(0, r, 1, q + 1)] if r else [])


def _assemble(ctx, v, d, pieces, sharding, shape, cyclic=False):
    """Result block of dim d from pieces of other shards' blocks: slice, collective_permute, concatenate
    (``cyclic``: block numbers modulo k, a rotation)."""
    local, parts = list(v.sharding.local_shape(v.shape, ctx.mesh)), []
    axes, k = v.sharding.dims[d], ctx.mesh.axis_size(v.sharding.dims[d])
    for lo, hi, sign, shift in pieces:
        part_local = local[:d] + [hi - lo] + local[d + 1:]
        part = v
        if (lo, hi) != (0, local[d]):
            attrs = {"start": tuple(lo if e == d else 0 for e in range(len(local))),
                     "limit": tuple(hi if e == d else s for e, s in enumerate(local)), "strides": (1,) * len(local)}
            part = ctx.emit(SLICE, [v], attrs, v.sharding, v.shape, v.dtype, part_local)
        if (sign, shift % k if cyclic else shift) != (1, 0):
            pairs = block_pairs(ctx.mesh, axes, sign, shift, cyclic)
            part = ctx.emit("collective_permute", [part], {"pairs": pairs}, v.sharding, v.shape, v.dtype, part_local)
        parts.append(part)
    if len(parts) == 1:
        return dataclasses.replace(parts[0], sharding=sharding, shape=tuple(shape))
    return ctx.emit(CONCATENATE, parts, {"axis": d}, sharding, shape, v.dtype)


def _empty(ctx, node):
    """A result with no entries is a constant."""
    value = np.zeros(node.shape, node.dtype)
    return ctx.emit_like(node, "constant", [], {"value": value}, Sharding.replicated(len(node.shape)))


# ================================================================ gradients: each linear op's transpose
@opdef.vjp(SLICE)
def _slice_vjp(node, g, ops, y):
    """Scatter the cotangent back with zeros between strided entries (low = start, interior = stride - 1)."""
    x, a = ops[0], node.attrs
    config = []
    for n, start, stride, m in zip(x.shape, a["start"], a["strides"], node.shape):
        span = (m - 1) * stride + 1 if m else 0
        config.append((start, n - start - span, stride - 1))
    return [lambda: lax_pad(g, 0, config)]


@opdef.vjp(PAD)
def _pad_vjp(node, g, ops, y):
    """Undo low/high (crop what was added, zeros where it cropped), then keep every (interior+1)-th entry."""
    a = node.attrs

    def transpose():
        dilated = lax_pad(g, 0, [(-lo, -hi, 0) for lo, hi in zip(a["low"], a["high"])])
        return lax_slice(dilated, (0,) * g.ndim, dilated.shape, tuple(i + 1 for i in a["interior"]))
    return [transpose]


@opdef.vjp(CONCATENATE)
def _concatenate_vjp(node, g, ops, y):
    axis, offsets = node.attrs["axis"], np.cumsum([0] + [x.shape[node.attrs["axis"]] for x in ops])
    return [lambda a=a, b=b: slice_in_dim(g, int(a), int(b), axis=axis) for a, b in zip(offsets[:-1], offsets[1:])]


@opdef.vjp(REVERSE)
def _reverse_vjp(node, g, ops, y):
    return [lambda: reverse(g, node.attrs["axes"])]


@opdef.vjp(IOTA)
def _iota_vjp(node, g, ops, y):
    return []


@opdef.vjp(DYNAMIC_SLICE)
def _dynamic_slice_vjp(node, g, ops, y):
    x, starts = ops[0], ops[1:]
    return [lambda: dynamic_update_slice(core.zeros(x.shape, x.dtype), g, starts)] + [None] * len(starts)


@opdef.vjp(DYNAMIC_UPDATE_SLICE)
def _dynamic_update_slice_vjp(node, g, ops, y):
    """x's cotangent is g with the written window zeroed; the update's is that window of g."""
    update, starts = ops[1], ops[2:]
    return [lambda: dynamic_update_slice(g, core.zeros(update.shape, update.dtype), starts),
            lambda: dynamic_slice(g, starts, update.shape)] + [None] * len(starts)

