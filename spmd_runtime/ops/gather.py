"""Gather and scatter-add along one axis: embedding lookup and its gradient (GShard / Megatron style).

Global semantics, as NumPy:

    take(table, indices, axis)                == np.take(table, indices, axis, mode="clip")
    scatter_add(operand, indices, updates, a) == out = operand.copy(); np.add.at(out, idx along a, updates)

Out-of-range indices, negative ones included, are CLAMPED to [0, n - 1] as by
``np.take(mode="clip")``, in both ops: a traced program cannot raise on data, and
clamping the same way keeps scatter_add the exact transpose (gradient) of take.

Their rules live in the layers that own them: propagation and partitioning (one masked local op, the
planner does the rest) in ``partition/rules/gather.py``, the VJPs (each op is the other's transpose) in
``autodiff/rules/gather.py``.
"""
from __future__ import annotations

import numpy as np

from .. import devices, opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

__all__ = ["take", "scatter_add"]

TAKE = define("take")
TAKE_BLOCK = define("take_block", "program")  # take from one block of a split gathered axis
SCATTER_ADD = define("scatter_add")
SCATTER_ADD_BLOCK = define("scatter_add_block", "program")  # scatter_add into one block of the scattered axis
FIRST_SHARD_ONLY = define("first_shard_only", "program")  # a value counted once in a partial sum


# ---------------------------------------------------------------- traced API
def take(table, indices, axis=0, mode="clip") -> Tensor:
    """``np.take(table, indices, axis, mode="clip")``: rows of ``table`` along ``axis`` picked by integer
    ``indices`` of any shape; result shape ``table.shape[:axis] + indices.shape + table.shape[axis+1:]``.
    Out-of-range indices are clamped to [0, n - 1]; ``mode`` exists for NumPy-compatible calls."""
    if mode != "clip":
        raise ValueError(f"take clamps out-of-range indices (a traced program cannot raise on data): mode must "
                         f"be 'clip'; got mode={mode!r}")
    table, indices = core.asarray(table), core.asarray(indices)
    axis = _gathered_axis(table, axis, TAKE.name)
    _check_indices(indices, TAKE.name)
    shape = table.shape[:axis] + indices.shape + table.shape[axis + 1:]
    return emit(TAKE, [table, indices], {"axis": axis}, shape, table.dtype)


def scatter_add(operand, indices, updates, axis=0) -> Tensor:
    """``operand`` plus ``updates`` added at ``indices`` along ``axis``, repeats accumulating (``np.add.at``);
    the transpose of ``take``. ``updates`` broadcasts to ``operand.shape[:axis] + indices.shape +
    operand.shape[axis+1:]`` and is cast to the operand's dtype. Out-of-range indices are clamped."""
    operand, indices = core.asarray(operand), core.asarray(indices)
    axis = _gathered_axis(operand, axis, SCATTER_ADD.name)
    _check_indices(indices, SCATTER_ADD.name)
    want = operand.shape[:axis] + indices.shape + operand.shape[axis + 1:]
    updates = core.asarray(updates)
    try:
        updates = core.broadcast_to(core.astype(updates, operand.dtype), want)
    except ValueError:
        raise ValueError(f"scatter_add needs updates broadcastable to operand.shape[:axis] + indices.shape + "
                         f"operand.shape[axis+1:] = {want}; got shape {updates.shape}") from None
    return emit(SCATTER_ADD, [operand, indices, updates], {"axis": axis}, operand.shape, operand.dtype)


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


# ---------------------------------------------------------------- kernels
def _clamped(xp, indices, size: int):
    """Indices as int64 in [0, size): int64 so that unsigned or narrow ones can take a shard offset."""
    return xp.clip(indices.astype("int64", copy=False), 0, size - 1)


def _spread(mask, axis: int, ndim: int):
    """``mask`` over the index dims, reshaped to broadcast against a result of rank ``ndim`` at ``axis``."""
    return mask.reshape((1,) * axis + mask.shape + (1,) * (ndim - axis - mask.ndim))


@opdef.kernel(TAKE)
def take_kernel(xp, table, indices, axis):
    return xp.take(table, _clamped(xp, indices, table.shape[axis]), axis=axis)


@opdef.kernel(TAKE_BLOCK)
def take_block(xp, table, indices, shard, axis, size):
    """``take`` from block ``shard`` of a gathered axis of true size ``size``: rows in other blocks give 0,
    so summing over the blocks gives the global take."""
    block = table.shape[axis]
    local = _clamped(xp, indices, size) - shard * block
    hit = (local >= 0) & (local < block)
    rows = xp.take(table, xp.where(hit, local, 0), axis=axis)
    return xp.where(_spread(hit, axis, rows.ndim), rows, xp.zeros((), rows.dtype))


@opdef.kernel(SCATTER_ADD)
def scatter_add_kernel(xp, operand, indices, updates, axis):
    return _add_rows(xp, operand, _clamped(xp, indices, operand.shape[axis]), updates, axis)


@opdef.kernel(SCATTER_ADD_BLOCK)
def scatter_add_block(xp, operand, indices, updates, shard, axis, size):
    """``scatter_add`` into block ``shard`` of a scattered axis of true size ``size``: updates aimed at other
    blocks are dropped (their blocks add them)."""
    block = operand.shape[axis]
    local = _clamped(xp, indices, size) - shard * block
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
    out = operand.copy()
    target = xp.moveaxis(out, axis, 0)  # a view: adding into it writes ``out``
    index_dims = tuple(range(axis, axis + rows.ndim))
    values = xp.moveaxis(updates, index_dims, tuple(range(rows.ndim))).reshape((rows.size,) + target.shape[1:])
    if xp is np:
        flat = rows.reshape(-1)
        if keep is not None:
            picked = keep.reshape(-1)
            flat, values = flat[picked], values[picked]
        _add_sorted(target, flat, values)
    else:  # ufunc.at, or CuPy's scatter_add where it has none
        devices.scatter_add(xp, target, rows.reshape(-1), values)
    return out
