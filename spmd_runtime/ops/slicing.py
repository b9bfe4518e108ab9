"""Slicing family: static slices and basic indexing, pads, concatenation, reversal, iota/arange,
dynamic slices and dynamic updates (XLA's Slice, Pad, Concatenate, Reverse, Iota, DynamicSlice,
DynamicUpdateSlice).

API (re-exported as ``spmd_runtime.numpy.<name>``): ``static_slice`` (XLA Slice: per-dim start, limit,
positive stride; defined here as ``lax_slice`` so the builtin ``slice`` stays usable) and
``slice_in_dim`` (one dim, JAX-style), ``pad`` (NumPy, constant mode) and ``lax_pad`` ((low, high,
interior) per dim), ``concatenate``, ``stack``, ``reverse`` / ``flip``, ``arange``, ``iota``,
``broadcasted_iota``, ``dynamic_slice``, ``dynamic_update_slice``. ``getitem`` is NumPy basic indexing
(ints, slices with any step, None, Ellipsis) plus 0-d traced integer indices (a size-1 dynamic slice,
negative values wrapping once as in JAX); ``Tensor.__getitem__`` is ``gather.getitem``, which adds
integer-array and boolean-mask indexing on top of it.

Dynamic starts follow XLA: each is clamped to [0, n - size] of the GLOBAL dim (never per shard), and
negative starts are not wrapped. ``dynamic_slice`` with only Python ints folds into a static slice.

This module holds the records, the traced functions and the kernels (the ``owned_*`` and ``fill_outside``
kernels are the rank-dependent local steps the partition rules emit). The rules live with the layers that
own them: sharding propagation and partitioning in ``partition/rules/slicing.py`` (its docstring explains
the plans), the VJPs in ``autodiff/rules/slicing.py``.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .. import dtypes, opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

__all__ = ["static_slice", "slice_in_dim", "pad", "lax_pad", "concatenate", "stack", "roll", "reverse", "flip",
           "arange", "iota", "broadcasted_iota", "dynamic_slice", "dynamic_update_slice"]

SLICE = define("slice")
PAD = define("pad")
CONCATENATE = define("concatenate")
REVERSE = define("reverse")
IOTA = define("iota")
DYNAMIC_SLICE = define("dynamic_slice")
# fresh (its kernel copies), in place where its operand dies: a loop's buffer updated slot by slot (a saved ring)
DYNAMIC_UPDATE_SLICE = define("dynamic_update_slice", fresh=True, in_place=True)
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
    shape = tuple(slice_count(a, b, s) for a, b, s in zip(start, limit, strides))
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


def arange(start, /, stop=None, step=1, *, dtype=None, device=None) -> Tensor:
    """NumPy arange with static bounds. Each shard computes its own block (the global array never exists)."""
    core.check_device(device, "arange")
    if stop is None:
        start, stop = 0, start
    if any(isinstance(v, Tensor) for v in (start, stop, step)) or step == 0:
        raise ValueError(f"arange takes static bounds and a non-zero step; got start={start}, stop={stop}, "
                         f"step={step}")
    # JAX's dtype: Python bounds are weak (int32 / float32 without x64), NumPy scalars their canonical type
    dtype = np.dtype(dtype) if dtype is not None else dtypes.result_type(start, stop, step)
    if all(isinstance(v, (int, np.integer)) for v in (start, stop, step)):
        count = len(range(int(start), int(stop), int(step)))
    else:
        count = max(math.ceil((stop - start) / step), 0)
    return _iota((count,), 0, dtype, start, step)


def dynamic_slice(x, start_indices, slice_sizes) -> Tensor:
    """XLA DynamicSlice: x[s:s+size] per dim, each start (traced 0-d integer or int) clamped to
    [0, n - size]. With only Python ints this is a static slice."""
    x = core.asarray(x)
    starts, sizes = _start_list(start_indices, x.ndim, DYNAMIC_SLICE.name), _ints(slice_sizes)
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
    starts = _start_list(start_indices, x.ndim, DYNAMIC_UPDATE_SLICE.name)
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


def slice_count(start, limit, stride) -> int:
    return max(-(-(limit - start) // stride), 0)


def _padded_size(n, low, high, interior) -> int:
    return low + high + n + max(n - 1, 0) * interior


def _scalar_attr(value, dtype, what):
    """A Python scalar of ``dtype`` (JSON-able attribute) for a static value."""
    if isinstance(value, Tensor) or np.ndim(value) != 0:
        raise TypeError(f"{what} must be a static scalar; got {value!r}")
    return np.asarray(value).astype(dtype).item()


def _expand_ellipsis(key, ndim):
    bad = [k for k in key if not (k is None or k is Ellipsis or isinstance(k, slice) or is_int(k)
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


def is_int(k) -> bool:
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
    window = tuple(slice(s, s + m) for s, m in zip(clamp_starts(starts, x.shape, sizes), sizes))
    return x[window].copy()


@opdef.kernel(DYNAMIC_UPDATE_SLICE)
def dynamic_update_slice_kernel(xp, x, update, *starts):
    return dynamic_update_slice_into(xp, x.copy(), update, *starts)


def dynamic_update_slice_into(xp, x, update, *starts):
    """``dynamic_update_slice`` written into ``x``'s own buffer (its donated, dying operand)."""
    x[tuple(slice(s, s + m) for s, m in zip(clamp_starts(starts, x.shape, update.shape), update.shape))] = update
    return x


def clamp_starts(starts, shape, sizes) -> list[int]:
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
    starts, shards = clamp_starts(operands[:x.ndim], shape, sizes), iter(operands[x.ndim:])
    spans = [_span(b, shards, n, a, 1, m) for b, n, a, m in zip(blocks, shape, starts, sizes)]
    return _owned_window(xp, x, spans)


@opdef.kernel(OWNED_DYNAMIC_UPDATE_SLICE)
def owned_dynamic_update_slice_kernel(xp, x, update, *operands, blocks, shape, sizes):
    """Write the part of the update that falls in this shard's block (starts clamped globally)."""
    starts, shards = clamp_starts(operands[:x.ndim], shape, sizes), iter(operands[x.ndim:])
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
