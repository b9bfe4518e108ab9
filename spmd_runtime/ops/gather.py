"""Gather and scatter along one axis (embedding lookup and its gradient, GShard / Megatron style), NumPy's
integer-array and boolean-mask indexing on traced tensors, and JAX's functional updates ``x.at[idx]``.

Global semantics, as NumPy / JAX:

    take(table, indices, axis, mode)          == jnp.take(table, indices, axis, mode=mode)
    scatter_add(operand, indices, updates, a) == out = operand.copy(); np.add.at(out, idx along a, updates)
    scatter(operand, indices, updates, a, k)  == np.put / np.minimum.at / np.maximum.at / np.multiply.at
    x[key]                                    == NumPy indexing (basic and advanced), static shapes
    x.at[key].set(v) / add / subtract / multiply / divide / min / max / get   (JAX)

``take``'s ``mode`` (JAX's): None or 'fill' (the default): negative indices wrap once (NumPy), indices still
out of [0, n) give ``fill_value`` (NaN for floats, the most negative value of a signed int, the largest of an
unsigned one, True for bool); 'clip': clamped to [0, n - 1] (negative ones to 0, as NumPy's 'clip'); 'wrap':
taken modulo n. The ``TAKE`` and ``SCATTER_ADD`` records themselves clamp (a traced program cannot raise on
data, and clamping alike keeps scatter_add the exact transpose of take); ``fill`` is a select after them.

Indexing (``getitem``): ints, slices, None, Ellipsis, integer arrays / lists / traced integer tensors on one
or more dims (NumPy's rule: adjacent advanced indices keep their place in the result, separated ones go to
the front), and CONSTANT boolean masks (NumPy arrays: their ``nonzero`` is known while tracing). A traced
boolean mask has no static result shape: refused with a pointer to ``snp.where`` (JAX's rule). Constant
indices out of bounds raise IndexError while tracing (NumPy); traced ones wrap once if negative and are then
clamped (JAX's retrieval rule).

``x.at[key]``: basic keys of unit-step slices, ints and 0-d traced ints are a dynamic_update_slice (a traced
start is clamped into the dim, as XLA's DynamicUpdateSlice: the KV-cache update ``cache.at[:, pos].set(new)``);
other keys scatter, with negative indices wrapped once and traced indices still out of range DROPPED (JAX).
``set`` with a repeated index: the update LAST in the index array's C order wins (NumPy's ``x[idx] = v``),
on every mesh. ``add`` accumulates repeats (``np.add.at``), ``min`` / ``max`` / ``multiply`` likewise
(``np.minimum.at``, ...); ``divide`` divides by the product of the repeats (JAX's).

Their rules live in the layers that own them: propagation and partitioning (one masked local op, the
planner does the rest) in ``partition/rules/gather.py``, the VJPs in ``autodiff/rules/gather.py``.
"""
from __future__ import annotations

import operator

import numpy as np

from .. import devices, opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core, slicing

__all__ = ["take", "scatter_add", "scatter", "getitem", "IndexUpdateHelper"]

TAKE = define("take")
TAKE_BLOCK = define("take_block", "program")  # take from one block of a split gathered axis
SCATTER_ADD = define("scatter_add")
SCATTER_ADD_BLOCK = define("scatter_add_block", "program")  # scatter_add into one block of the scattered axis
SCATTER = define("scatter")  # set / min / max / mul at indices along one axis; indices out of [0, n) dropped
SCATTER_BLOCK = define("scatter_block", "program")  # scatter into one block of the scattered axis
FIRST_SHARD_ONLY = define("first_shard_only", "program")  # a value counted once in a partial sum
SCATTER_KINDS = ("set", "min", "max", "multiply")
TAKE_MODES = (None, "fill", "clip", "wrap")


# ---------------------------------------------------------------- traced API
def take(a, indices, axis=0, mode=None, fill_value=None) -> Tensor:
    """``jnp.take(a, indices, axis, mode=mode)``: entries of ``a`` along ``axis`` picked by integer ``indices`` of
    any shape; result shape ``a.shape[:axis] + indices.shape + a.shape[axis+1:]``. ``mode``: None / 'fill'
    (negative indices wrap once, those still out of range give ``fill_value``), 'clip' (clamped to [0, n - 1])
    or 'wrap' (modulo n); see the module docstring."""
    if mode not in TAKE_MODES:
        raise ValueError(f"take's mode is one of {TAKE_MODES} (a traced program cannot raise on data, so NumPy's "
                         f"'raise' is not one); got mode={mode!r}")
    table, indices = core.asarray(a), _index_tensor(indices, TAKE.name)
    axis = _gathered_axis(table, axis, TAKE.name)
    if mode in ("clip", "wrap"):
        return _take(table, indices, axis, mode)
    n = table.shape[axis]
    wrapped = _wrap_once(indices, n)
    rows = _take(table, wrapped, axis)
    known = _constant_value(wrapped)
    if known is not None and ((known >= 0) & (known < n)).all():  # known indices, all in range: no fill
        return rows
    valid = core.logical_and(wrapped >= 0, wrapped < n)
    fill = _default_fill(table.dtype) if fill_value is None else fill_value
    return core.where(_spread_tensor(valid, axis, rows.ndim), rows, core.asarray(np.asarray(fill, table.dtype)))


def _constant_value(t: Tensor):
    """The value of a constant tensor (known while tracing), else None."""
    return np.asarray(t.node.attrs["value"]) if t.node.op == core.CONSTANT.name else None


def _wrap_once(indices: Tensor, n: int) -> Tensor:
    """Negative indices plus n (NumPy's, once); a constant's folded while tracing."""
    known = _constant_value(indices)
    if known is not None:
        if known.dtype == np.int64 and not (known < 0).any():
            return indices
        known = known.astype(np.int64)
        return core.asarray(np.where(known < 0, known + n, known))
    indices = core.astype(indices, "int64")  # as int64: a narrow or unsigned int compared with n could wrap
    return indices if indices.dtype.kind == "u" else core.where(indices < 0, indices + n, indices)


def _take(table: Tensor, indices: Tensor, axis: int, mode: str = "clip") -> Tensor:
    """The TAKE record: indices clamped (or, mode 'wrap', taken modulo the dim)."""
    shape = table.shape[:axis] + indices.shape + table.shape[axis + 1:]
    attrs = {"axis": axis, "mode": "wrap"} if mode == "wrap" else {"axis": axis}
    return emit(TAKE, [table, indices], attrs, shape, table.dtype)


def _default_fill(dtype):
    """JAX's fill value for out-of-range indices: NaN, the most negative / largest int, True."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return np.nan
    if dtype.kind == "b":
        return True
    return np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max


def _spread_tensor(mask: Tensor, axis: int, ndim: int) -> Tensor:
    """A mask over the index dims broadcast against a result of rank ``ndim`` whose index dims start at ``axis``."""
    return core.reshape(mask, (1,) * axis + mask.shape + (1,) * (ndim - axis - mask.ndim))


def scatter(operand, indices, updates, axis=0, kind="set") -> Tensor:
    """``operand`` with ``updates`` combined in at ``indices`` along ``axis``: ``kind`` 'set' (a repeated index:
    the update last in C order wins), 'min', 'max' or 'mul' (repeats combine, as ``np.minimum.at``).
    Negative indices wrap once; indices still out of range are dropped (JAX). ``updates`` broadcasts to
    ``operand.shape[:axis] + indices.shape + operand.shape[axis+1:]``."""
    if kind not in SCATTER_KINDS:
        raise ValueError(f"scatter's kind is one of {SCATTER_KINDS} (scatter_add adds); got kind={kind!r}")
    operand, indices = core.asarray(operand), _index_tensor(indices, SCATTER.name)
    axis = _gathered_axis(operand, axis, SCATTER.name)
    indices = _wrap_once(indices, operand.shape[axis])
    return _scatter(operand, indices, _updates_for(operand, indices, updates, axis, SCATTER.name), axis, kind)


def _scatter(operand: Tensor, indices: Tensor, updates: Tensor, axis: int, kind: str) -> Tensor:
    """The SCATTER record: indices out of [0, n) are dropped (no wrapping here)."""
    return emit(SCATTER, [operand, indices, updates], {"axis": axis, "combine": kind}, operand.shape, operand.dtype)


def _updates_for(operand: Tensor, indices: Tensor, updates, axis: int, what: str) -> Tensor:
    want = operand.shape[:axis] + indices.shape + operand.shape[axis + 1:]
    updates = core.asarray(updates)
    try:
        return core.broadcast_to(core.astype(updates, operand.dtype), want)
    except ValueError:
        raise ValueError(f"{what} needs updates broadcastable to operand.shape[:axis] + indices.shape + "
                         f"operand.shape[axis+1:] = {want}; got shape {updates.shape}") from None


def _index_tensor(indices, what: str) -> Tensor:
    if isinstance(indices, (list, tuple)) and len(indices) == 0:
        indices = np.zeros((0,), np.int64)
    indices = core.asarray(indices)
    _check_indices(indices, what)
    return indices


def scatter_add(operand, indices, updates, axis=0) -> Tensor:
    """``operand`` plus ``updates`` added at ``indices`` along ``axis``, repeats accumulating (``np.add.at``);
    the transpose of ``take``. ``updates`` broadcasts to ``operand.shape[:axis] + indices.shape +
    operand.shape[axis+1:]`` and is cast to the operand's dtype. Out-of-range indices are clamped."""
    operand, indices = core.asarray(operand), _index_tensor(indices, SCATTER_ADD.name)
    axis = _gathered_axis(operand, axis, SCATTER_ADD.name)
    updates = _updates_for(operand, indices, updates, axis, SCATTER_ADD.name)
    return _scatter_add(operand, indices, updates, axis)


def _scatter_add(operand: Tensor, indices: Tensor, updates: Tensor, axis: int, mode: str = "clip") -> Tensor:
    """The SCATTER_ADD record: indices clamped (or, mode 'wrap', taken modulo the dim), as take's."""
    attrs = {"axis": axis, "mode": "wrap"} if mode == "wrap" else {"axis": axis}
    return emit(SCATTER_ADD, [operand, indices, updates], attrs, operand.shape, operand.dtype)


def _gathered_axis(x: Tensor, axis, what: str) -> int:
    if not -x.ndim <= int(axis) < x.ndim:
        raise ValueError(f"{what} needs an axis in [-{x.ndim}, {x.ndim}); got axis {axis} for shape {x.shape}")
    axis = int(axis) % x.ndim
    if x.shape[axis] == 0:
        raise ValueError(f"{what} needs a non-empty axis to index (indices are clamped into it); got size 0 "
                         f"on axis {axis} of shape {x.shape}")
    return axis


def _check_indices(indices: Tensor, what: str) -> None:
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{what} needs integer indices; got dtype {indices.dtype.name}")


# ---------------------------------------------------------------- indexing: x[key] and x.at[key]
def getitem(x, key) -> Tensor:
    """``x[key]``, NumPy's indexing with static shapes (see the module docstring): basic keys are slices
    (``slicing.getitem``); integer arrays on one dim are a ``take`` of the basically-indexed value, on several
    dims one ``take`` of its flattened entries."""
    entries = _parse_key(x, key)
    if not any(kind == "array" for kind, _ in entries):
        return slicing.getitem(x, tuple(v for _, v in entries))
    y = slicing.getitem(x, tuple(slice(None) if kind in _ADVANCED else v for kind, v in entries))
    advanced = [d for d, (kind, _) in enumerate(entries) if kind in _ADVANCED]
    if len(advanced) == 1:
        d = advanced[0]
        return _take(y, _clamp(_wrap_once(_as_index(entries[d][1]), y.shape[d]), y.shape[d]), d)
    entries = [(kind, v) if kind in _ADVANCED else ("span", slice(None)) for kind, v in entries]  # over y's dims
    linear, _, shape = _positions(y.shape, entries, clip=True)
    return _take(core.reshape(y, (y.size,)), linear, 0) if y.size else core.zeros(shape, y.dtype)


class IndexUpdateHelper:
    """``x.at``: ``x.at[key].set(v)`` and the other functional updates of JAX (``x`` itself is never changed)."""
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    def __getitem__(self, key) -> "IndexUpdateRef":
        return IndexUpdateRef(self.x, key)

    def __repr__(self):
        return f"IndexUpdateHelper({self.x!r})"


class IndexUpdateRef:
    """``x.at[key]``: each method returns a new tensor, ``x`` with the entries ``x[key]`` updated by ``values``
    (broadcast to ``x[key].shape`` and cast to ``x.dtype``)."""
    __slots__ = ("x", "key")

    def __init__(self, x, key):
        self.x, self.key = x, key

    def get(self) -> Tensor:
        return getitem(self.x, self.key)

    def set(self, values) -> Tensor:
        return _update(self.x, self.key, values, "set")

    def add(self, values) -> Tensor:
        return _update(self.x, self.key, values, "accumulate")

    def subtract(self, values) -> Tensor:
        return _update(self.x, self.key, core.negative(core.asarray(values)), "accumulate")

    def multiply(self, values) -> Tensor:
        return _update(self.x, self.key, values, "multiply")

    mul = multiply

    def divide(self, values) -> Tensor:
        """``x`` divided, at ``key``, by the product of the values aimed at each entry (JAX's)."""
        x = core.asarray(self.x)
        return core.divide(x, _update(core.ones(x.shape, x.dtype), self.key, values, "multiply"))

    def min(self, values) -> Tensor:
        return _update(self.x, self.key, values, "min")

    def max(self, values) -> Tensor:
        return _update(self.x, self.key, values, "max")


_ADVANCED = ("array", "int", "scalar")  # with an array among them, ints and 0-d tensors broadcast as arrays do
_COMBINE = {"accumulate": core.add, "multiply": core.multiply, "min": core.minimum, "max": core.maximum}


def _update(x, key, values, kind) -> Tensor:
    """``x`` with ``x[key]`` combined with ``values`` by ``kind`` ('set', 'add', 'mul', 'min', 'max')."""
    x = core.asarray(x)
    if isinstance(key, Tensor) and key.dtype == np.bool_:
        return _update_where(x, key, values, kind)
    entries = _parse_key(x, key)
    shape = _layout(x.shape, entries)[0]
    values = core.asarray(values)
    try:
        values = core.broadcast_to(core.astype(values, x.dtype), shape)
    except ValueError:
        raise ValueError(f"x.at[...] needs values broadcastable to x[key].shape = {shape}; got shape "
                         f"{values.shape}") from None
    if 0 in shape:
        return x
    if all(kind == "int" or kind == "scalar" or kind == "none" or (kind == "span" and _step(v, n) == 1)
           for (kind, v), n in _with_sizes(entries, x.shape)):
        return _update_window(x, entries, values, kind)
    arrays = [d for d, (k, _) in enumerate(entries) if k == "array"]
    if len(arrays) == 1 and all(k == "array" or (k == "span" and v == slice(None)) for k, v in entries):
        return _scatter_combined(x, _as_index(entries[arrays[0]][1]), values, arrays[0], kind)
    linear, valid, _ = _positions(x.shape, entries, clip=False)
    flat = _scatter_combined(core.reshape(x, (x.size,)), linear, values, 0, kind, valid)
    return core.reshape(flat, x.shape)


def _update_where(x, mask, values, kind) -> Tensor:
    """``x.at[mask]`` with a traced boolean mask: the where-style update JAX allows, a scalar ``values`` put
    where the mask (over x's leading dims) is True."""
    values = core.asarray(values)
    if values.ndim or mask.shape != x.shape[:mask.ndim]:
        raise IndexError(f"x.at[mask] with a traced boolean mask takes a scalar value and a mask shaped like x's "
                         f"leading dims (a where: snp.where(mask, value, x)); got a mask of shape {mask.shape} for "
                         f"x {x.shape} and values of shape {values.shape}")
    values = core.astype(values, x.dtype)
    new = values if kind == "set" else _COMBINE[kind](x, values)
    return core.where(core.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim)), new, x)


def _scatter_combined(x, indices, values, axis, kind, valid=None) -> Tensor:
    """scatter_add (updates out of range, or not ``valid``, zeroed) or scatter (they are dropped)."""
    n = x.shape[axis]
    indices = _wrap_once(indices, n)
    if valid is not None or _constant_value(indices) is None:  # constant indices were checked in range
        inside = core.logical_and(indices >= 0, indices < n)
        valid = inside if valid is None else core.logical_and(valid, inside)
    if kind == "accumulate":
        if valid is not None:
            values = core.where(_spread_tensor(valid, axis, values.ndim), values, core.zeros((), values.dtype))
        return _scatter_add(x, indices, values, axis)
    if valid is not None:
        indices = core.where(valid, indices, n)  # n: out of range, dropped
    return _scatter(x, indices, values, axis, kind)


def _update_window(x, entries, values, kind) -> Tensor:
    """Unit-step slices, ints and 0-d traced ints: one dynamic_update_slice (a traced start is clamped)."""
    starts, sizes = [], []
    for (k, v), n in _with_sizes(entries, x.shape):
        if k == "none":
            continue
        if k == "span":
            a, b, _ = v.indices(n)
            starts.append(a), sizes.append(max(b - a, 0))
        else:
            starts.append(_int_start(v, n) if k == "int" else core.where(v < 0, v + n, v))
            sizes.append(1)
    values = core.reshape(values, sizes)
    if kind != "set":
        values = _COMBINE[kind](slicing.dynamic_slice(x, starts, sizes), values)
    return slicing.dynamic_update_slice(x, values, starts)


def _int_start(v, n) -> int:
    if not -n <= v < n:
        raise IndexError(f"index {v} is out of bounds for a dim of size {n}")
    return v % n


def _with_sizes(entries, shape):
    """(entry, size of the dim it indexes) pairs; None entries index no dim (size 1, unused)."""
    dims = iter(shape)
    return [((k, v), 1 if k == "none" else next(dims)) for k, v in entries]


def _step(s: slice, n: int) -> int:
    return s.indices(n)[2]


def _parse_key(x, key) -> list[tuple[str, object]]:
    """The key as (kind, value) entries, one per indexed dim (or None): 'span' (a slice), 'none', 'int',
    'scalar' (a 0-d traced int), 'array' (a NumPy int array or a traced int tensor); Ellipsis expanded,
    constant boolean masks turned into their nonzero int arrays (one per dim they cover)."""
    entries = []
    for k in key if isinstance(key, tuple) else (key,):
        if isinstance(k, list):
            k = np.asarray(k) if len(k) else np.zeros((0,), np.int64)
        if isinstance(k, Tensor):
            if k.dtype == np.bool_:
                raise IndexError(f"a traced boolean mask has no static result shape: x[mask] needs the mask's "
                                 f"values; use snp.where(mask, x, fill) (JAX's rule; a NumPy mask is known while "
                                 f"tracing and may index); got {k!r}")
            if k.dtype.kind not in "iu":
                raise IndexError(f"tensor indices are integers or booleans; got {k!r}")
            entries.append(("scalar" if k.ndim == 0 else "array", k))
        elif isinstance(k, np.ndarray) and k.dtype == np.bool_ and k.ndim:
            entries += [("array", i) for i in np.nonzero(k)] + [("mask", k.shape)]
        elif isinstance(k, np.ndarray) and k.ndim:
            if k.dtype.kind not in "iu":
                raise IndexError(f"array indices are integers or booleans; got dtype {k.dtype.name}")
            entries.append(("array", k.astype(np.int64)))
        elif k is None or k is Ellipsis or isinstance(k, slice):
            entries.append(("none" if k is None else "ellipsis" if k is Ellipsis else "span", k))
        elif slicing.is_int(k):
            entries.append(("int", operator.index(k)))
        else:
            raise IndexError(f"Tensor indices are ints, slices, None, Ellipsis, integer arrays or lists, traced "
                             f"integer tensors and NumPy boolean masks; got {k!r}")
    return _expand(entries, x.shape)


def _expand(entries, shape):
    """Ellipsis replaced by full slices; each mask's shape checked against the dims its arrays index."""
    if sum(k == "ellipsis" for k, _ in entries) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(k not in ("none", "ellipsis", "mask") for k, _ in entries)
    if used > len(shape):
        raise IndexError(f"too many indices: the tensor has {len(shape)} dims; got {used} indices")
    fill = [("span", slice(None))] * (len(shape) - used)
    at = next((i for i, (k, _) in enumerate(entries) if k == "ellipsis"), len(entries))
    entries = entries[:at] + fill + entries[at + 1:]
    out, dim = [], 0
    for k, v in entries:
        if k == "mask":  # follows the arrays it made
            covered = shape[dim - len(v):dim]
            if tuple(covered) != tuple(v):
                raise IndexError(f"a boolean mask must match the dims it indexes; got mask shape {v} for dims "
                                 f"{tuple(covered)}")
            continue
        if k == "array" and isinstance(v, np.ndarray):
            n = shape[dim]
            if v.size and not (-n <= v.min() and v.max() < n):
                bad = v[(v < -n) | (v >= n)].flat[0]
                raise IndexError(f"index {bad} is out of bounds for axis {dim} with size {n}")
        out.append((k, v))
        dim += k != "none"
    return out


def _as_index(v) -> Tensor:
    return v if isinstance(v, Tensor) else core.asarray(np.asarray(v, np.int64))


def _clamp(indices: Tensor, n: int) -> Tensor:
    """Indices clamped into [0, n) (JAX's retrieval rule), folded while tracing for constants."""
    known = _constant_value(indices)
    if known is not None:
        return indices if known.size == 0 or (known.min() >= 0 and known.max() < n) else \
            core.asarray(np.clip(known, 0, n - 1))
    return core.minimum(core.maximum(indices, 0), n - 1)


def _positions(shape, entries, clip: bool):
    """(linear index into the flattened array of ``shape``, its validity mask or None, result shape) of a key's
    entries (no Ellipsis), NumPy's layout: the broadcast advanced indices in place when they are adjacent,
    else first, then the dims of the slices and Nones in order. ``clip``: each dim's index is clamped
    (retrieval), else an out-of-range one is flagged in the mask (updates drop it)."""
    result, broadcast, at, place, sizes = _layout(shape, entries)
    spread = lambda shape_: (1,) * at + shape_ + (1,) * (len(result) - at - len(broadcast))
    strides = dict(zip(sizes, _strides(shape)))
    known, traced, valid = np.zeros((), np.int64), None, None
    for i, (k, v) in enumerate(entries):
        if k == "none":
            continue
        n, stride = sizes[i], strides[i]
        if k == "span":
            known = known + stride * np.arange(*v.indices(n)).reshape(
                [-1 if d == place[i] else 1 for d in range(len(result))])
        elif k == "int":
            known = known + stride * _int_start(v, n)
        elif not isinstance(v, Tensor):
            known = known + stride * np.broadcast_to(np.where(v < 0, v + n, v), broadcast).reshape(spread(broadcast))
        else:
            w = _wrap_once(core.astype(v, "int64"), n)
            if clip:
                w = _clamp(w, n)
            else:
                ok = core.logical_and(w >= 0, w < n)
                valid = ok if valid is None else core.logical_and(valid, ok)
            term = core.reshape(core.broadcast_to(w, broadcast), spread(broadcast)) * stride
            traced = term if traced is None else traced + term
    linear = core.asarray(np.broadcast_to(known, result).copy()) if traced is None else \
        core.broadcast_to(core.add(traced, known), result)
    if valid is not None:
        valid = core.broadcast_to(core.reshape(core.broadcast_to(valid, broadcast), spread(broadcast)), result)
    return linear, valid, result


def _layout(shape, entries):
    """(result shape, broadcast shape of the advanced indices, the result dim where they start, {entry: its
    result dim} for slices and Nones, {entry: the size of the dim it indexes}) of NumPy's indexing."""
    advanced = [i for i, (k, _) in enumerate(entries) if k in _ADVANCED]
    broadcast = tuple(np.broadcast_shapes(*[tuple(v.shape if isinstance(v, Tensor) else np.shape(v))
                                            for k, v in entries if k in _ADVANCED]))
    adjacent = bool(advanced) and advanced == list(range(advanced[0], advanced[-1] + 1))
    sizes = dict(zip([i for i, (k, _) in enumerate(entries) if k != "none"], shape))
    basic = [(i, 1 if k == "none" else len(range(*v.indices(sizes[i]))))
             for i, (k, v) in enumerate(entries) if k not in _ADVANCED]
    at = sum(1 for i, _ in basic if i < advanced[0]) if adjacent else 0
    result = tuple(c for _, c in basic[:at]) + broadcast + tuple(c for _, c in basic[at:])
    place = {i: j if j < at else j + len(broadcast) for j, (i, _) in enumerate(basic)}
    return result, broadcast, at, place, sizes


def _strides(shape):
    return [int(np.prod(shape[d + 1:])) for d in range(len(shape))]


# ---------------------------------------------------------------- kernels
def _clamped(xp, indices, size: int, mode: str = "clip"):
    """Indices as int64 in [0, size), clamped (or modulo ``size``, mode 'wrap'): int64 so that unsigned or
    narrow ones can take a shard offset."""
    indices = indices.astype("int64", copy=False)
    return indices % size if mode == "wrap" else xp.clip(indices, 0, size - 1)


def _spread(mask, axis: int, ndim: int):
    """``mask`` over the index dims, reshaped to broadcast against a result of rank ``ndim`` at ``axis``."""
    return mask.reshape((1,) * axis + mask.shape + (1,) * (ndim - axis - mask.ndim))


@opdef.kernel(TAKE)
def take_kernel(xp, table, indices, axis, mode="clip"):
    return xp.take(table, _clamped(xp, indices, table.shape[axis], mode), axis=axis)


@opdef.kernel(TAKE_BLOCK)
def take_block(xp, table, indices, shard, axis, size, mode="clip"):
    """``take`` from block ``shard`` of a gathered axis of true size ``size``: rows in other blocks give 0,
    so summing over the blocks gives the global take."""
    block = table.shape[axis]
    local = _clamped(xp, indices, size, mode) - shard * block
    hit = (local >= 0) & (local < block)
    rows = xp.take(table, xp.where(hit, local, 0), axis=axis)
    return xp.where(_spread(hit, axis, rows.ndim), rows, xp.zeros((), rows.dtype))


@opdef.kernel(SCATTER)
def scatter_kernel(xp, operand, indices, updates, axis, combine):
    return _combine_rows(xp, operand, indices.astype("int64", copy=False), updates, axis, combine)


@opdef.kernel(SCATTER_BLOCK)
def scatter_block(xp, operand, indices, updates, shard, axis, combine, size):
    """``scatter`` into block ``shard`` of the scattered axis of true size ``size``: updates aimed at other
    blocks (or out of [0, size)) are dropped."""
    rows = indices.astype("int64", copy=False)
    local = rows - shard * operand.shape[axis]
    return _combine_rows(xp, operand, xp.where((rows >= 0) & (rows < size), local, -1), updates, axis, combine)


def _combine_rows(xp, operand, rows, updates, axis, kind):
    """A copy of ``operand`` with ``updates`` combined in at ``rows`` of ``axis`` (rows out of range dropped):
    'set' keeps, per row, the update last in C order; 'min' / 'max' / 'mul' combine repeats (ufunc.at)."""
    out, target, flat, values = _rows_and_values(xp, operand, rows, updates, axis)
    keep = (flat >= 0) & (flat < target.shape[0])
    flat, values = flat[keep], values[keep]
    if flat.size == 0:
        return out
    if kind == "set":  # last wins: of each run of equal rows in a stable sort, its last entry
        order = xp.argsort(flat, kind="stable")
        ordered = flat[order]
        last = order[xp.concatenate((ordered[1:] != ordered[:-1], xp.ones(1, bool)))]
        target[flat[last]] = values[last]
        return out
    ufunc = {"min": xp.minimum, "max": xp.maximum, "multiply": xp.multiply}[kind]
    if hasattr(ufunc, "at"):
        ufunc.at(target, flat, values)
    else:  # CuPy: no ufunc.at for these
        _combine_in_passes(xp, ufunc, target, flat, values)
    return out


def _combine_in_passes(xp, ufunc, target, flat, values):
    """``ufunc.at(target, flat, values)`` in one fancy-indexed pass per repeat: pass k combines the k-th
    occurrence of every row (no row twice in a pass), in index order as ``ufunc.at`` does."""
    order = xp.argsort(flat, kind="stable")
    ordered = flat[order]
    first = xp.concatenate((xp.ones(1, bool), ordered[1:] != ordered[:-1]))
    starts = xp.flatnonzero(first)
    occurrence = xp.arange(flat.size) - starts[xp.cumsum(first) - 1]
    for k in range(int(occurrence.max()) + 1):
        rows, picked = flat[order[occurrence == k]], values[order[occurrence == k]]
        target[rows] = ufunc(target[rows], picked)


def _rows_and_values(xp, operand, rows, updates, axis):
    """(a copy of operand, a view of it with ``axis`` first, rows flattened, the updates as one row each)."""
    out = operand.copy()
    target = xp.moveaxis(out, axis, 0)  # a view: writing into it writes ``out``
    index_dims = tuple(range(axis, axis + rows.ndim))
    values = xp.moveaxis(updates, index_dims, tuple(range(rows.ndim))).reshape((rows.size,) + target.shape[1:])
    return out, target, rows.reshape(-1), values


@opdef.kernel(SCATTER_ADD)
def scatter_add_kernel(xp, operand, indices, updates, axis, mode="clip"):
    return _add_rows(xp, operand, _clamped(xp, indices, operand.shape[axis], mode), updates, axis)


@opdef.kernel(SCATTER_ADD_BLOCK)
def scatter_add_block(xp, operand, indices, updates, shard, axis, size, mode="clip"):
    """``scatter_add`` into block ``shard`` of a scattered axis of true size ``size``: updates aimed at other
    blocks are dropped (their blocks add them)."""
    block = operand.shape[axis]
    local = _clamped(xp, indices, size, mode) - shard * block
    hit = (local >= 0) & (local < block)
    if xp is np:  # only the hits: zeroed misses aimed at row 0 would repeat it past MAX_ROW_PASSES
        return _add_rows(xp, operand, local, updates, axis, keep=hit)
    updates = xp.where(_spread(hit, axis, updates.ndim), updates, xp.zeros((), updates.dtype))
    return _add_rows(xp, operand, xp.where(hit, local, 0), updates, axis)


MAX_ROW_PASSES = 32  # more repeats of one row than this: np.add.at's own loop (a pass costs ~50 us)


def _add_sorted(target, rows, values):
    """``np.add.at(target, rows, values)``, the same bits, in one fancy-indexed add per repeat: pass k adds the
    k-th occurrence of every row (no row twice in a pass), so each row sums its updates in index order as
    ``add.at`` does. An embedding gradient (512 tokens into 1024 rows of 256) repeats a row ~4 times:
    0.25 ms vs ``add.at``'s 1.4 ms per-index loop; a row repeated more than MAX_ROW_PASSES times goes to
    ``add.at``."""
    if rows.size == 0:
        return
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    first = np.concatenate(([True], ordered[1:] != ordered[:-1]))
    occurrence = np.arange(rows.size) - np.flatnonzero(first)[np.cumsum(first) - 1]
    passes = int(occurrence.max()) + 1
    if passes > MAX_ROW_PASSES:
        np.add.at(target, rows, values)
        return
    for k in range(passes):
        picked = order[occurrence == k]
        target[rows[picked]] += values[picked]


@opdef.kernel(FIRST_SHARD_ONLY)
def first_shard_only(xp, x, shard):
    """``x`` on shard 0 of some axes, zeros elsewhere: a value counted once in a partial sum over them."""
    return xp.where(shard == 0, x, xp.zeros((), x.dtype))


def _add_rows(xp, operand, rows, updates, axis, keep=None):
    """A copy of ``operand`` with ``updates`` added at ``rows`` of ``axis``; repeated rows accumulate. NumPy:
    ``keep`` (a mask shaped like ``rows``) picks the updates that are added."""
    out, target, flat, values = _rows_and_values(xp, operand, rows, updates, axis)
    if xp is np:
        if keep is not None:
            picked = keep.reshape(-1)
            flat, values = flat[picked], values[picked]
        _add_sorted(target, flat, values)
    else:  # ufunc.at, or CuPy's scatter_add where it has none
        devices.scatter_add(xp, target, flat, values)
    return out
