"""Gather and scatter-add along one axis: embedding lookup and its gradient (GShard / Megatron style).

Global semantics, as NumPy:

    take(table, indices, axis)                == np.take(table, indices, axis, mode="clip")
    scatter_add(operand, indices, updates, a) == out = operand.copy(); np.add.at(out, idx along a, updates)

Out-of-range indices, negative ones included, are CLAMPED to [0, n - 1] as by
``np.take(mode="clip")``, in both ops: a traced program cannot raise on data, and
clamping the same way keeps scatter_add the exact transpose (gradient) of take.

Partitioning (one masked local op, the planner does the rest):
- table split on the gathered axis (vocab-split embedding): each rank looks up only the
  rows of its block (``take_block``: global index minus ``shard_index * block``, rows of
  other blocks give 0), so the result is a PARTIAL SUM over the table's axes on that
  dim; the planner all-reduces it, or reduce-scatters it when the result is wanted split.
  Padding rows of an uneven block are never read: a clamped index is below the true size.
- indices split on their own dims / table split on other dims: purely local, the result
  is split alike on the corresponding dims.
- scatter_add with the operand split on the scattered axis: each rank adds only the
  updates whose index falls in its block (``scatter_add_block``), no communication.
- scatter_add with updates (and indices) split on index dims: each rank scatters its
  updates, the result is a partial sum over those axes that the planner reduces. The
  operand is counted once: on shard 0 of those axes only (``first_shard_only``), or, when
  it already lies as the result is wanted (a row-split weight gradient), added after the
  reduction (reduce-scatter, then a local add: no gather of the operand).
The per-dim choice is the one moving the fewest bytes (like einsum): e.g. a small table
is all-gathered rather than all-reducing a larger lookup result.
"""
from __future__ import annotations

import string

import numpy as np

from .. import devices, opdef
from ..opdef import DOT_LEVEL, define
from ..partition.propagation import combine, dedupe_axes
from ..sharding import Sharding
from ..trace import Tensor, emit
from ..partition.strategy import choose, letter_strategies
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
    axis = _gathered_axis(table, axis, "take")
    _check_indices(indices, "take")
    shape = table.shape[:axis] + indices.shape + table.shape[axis + 1:]
    return emit(TAKE, [table, indices], {"axis": axis}, shape, table.dtype)


def scatter_add(operand, indices, updates, axis=0) -> Tensor:
    """``operand`` plus ``updates`` added at ``indices`` along ``axis``, repeats accumulating (``np.add.at``);
    the transpose of ``take``. ``updates`` broadcasts to ``operand.shape[:axis] + indices.shape +
    operand.shape[axis+1:]`` and is cast to the operand's dtype. Out-of-range indices are clamped."""
    operand, indices = core.asarray(operand), core.asarray(indices)
    axis = _gathered_axis(operand, axis, "scatter_add")
    _check_indices(indices, "scatter_add")
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


# ---------------------------------------------------------------- terms: one letter per dim, like einsum
def take_terms(table_ndim: int, indices_ndim: int, axis: int) -> tuple[str, str, str]:
    """(table, indices, result) letters; the table's gathered letter is in no other term (it is summed)."""
    letters = iter(string.ascii_letters)
    table = "".join(next(letters) for _ in range(table_ndim))
    indices = "".join(next(letters) for _ in range(indices_ndim))
    return table, indices, table[:axis] + indices + table[axis + 1:]


def scatter_terms(operand_ndim: int, indices_ndim: int, axis: int) -> tuple[str, str, str]:
    """(operand = result, indices, updates) letters; index letters are summed (not in the result)."""
    return take_terms(operand_ndim, indices_ndim, axis)  # the updates are shaped like take's result


def _map_dims(from_term: str, sharding, to_term: str) -> list:
    """Dims of ``to_term`` taken from ``sharding`` over ``from_term`` where the letters match, else ()."""
    known = {} if sharding is None else dict(zip(from_term, sharding.dims))
    return [known.get(c, ()) for c in to_term]


# ---------------------------------------------------------------- propagation
@opdef.propagation(TAKE, level=DOT_LEVEL)
def _take_propagation():
    """Result dims follow the indices' dims and the table's other dims; back the same way (the table's
    gathered dim never takes a split from the result: it has no counterpart there)."""
    def fwd(node, ins, g, mesh):
        table_t, indices_t, out_t = _terms_of(node, g)
        known = [(t, s) for t, s in ((table_t, ins[0]), (indices_t, ins[1])) if s is not None]
        return combine([dedupe_axes(_map_dims(t, s, out_t)) for t, s in known]) if known else None

    def bwd(node, out, ins, g, mesh):
        table_t, indices_t, out_t = _terms_of(node, g)
        return [dedupe_axes(_map_dims(out_t, out, table_t)), dedupe_axes(_map_dims(out_t, out, indices_t))]
    return fwd, bwd


@opdef.propagation(SCATTER_ADD, level=DOT_LEVEL)
def _scatter_add_propagation():
    """The result follows the operand, and the updates' non-index dims; backward, the updates' index dims
    and the indices' dims copy each other (sideways), their other dims follow the result."""
    def fwd(node, ins, g, mesh):
        operand_t, _, updates_t = _terms_of(node, g)
        known = [ins[0]] if ins[0] is not None else []
        if ins[2] is not None:
            known.append(dedupe_axes(_map_dims(updates_t, ins[2], operand_t)))
        return combine(known) if known else None

    def bwd(node, out, ins, g, mesh):
        operand_t, indices_t, updates_t = _terms_of(node, g)
        from_result, from_indices = _map_dims(operand_t, out, updates_t), _map_dims(indices_t, ins[1], updates_t)
        updates = dedupe_axes([r or i for r, i in zip(from_result, from_indices)])
        return [out, dedupe_axes(_map_dims(updates_t, ins[2], indices_t)), updates]
    return fwd, bwd


def _terms_of(node, g) -> tuple[str, str, str]:
    first, indices = g.nodes[node.inputs[0]].shape, g.nodes[node.inputs[1]].shape
    terms = take_terms if node.op == "take" else scatter_terms
    return terms(len(first), len(indices), node.attrs["axis"])


# ---------------------------------------------------------------- partitioning
@opdef.partition(TAKE)
def _partition_take(ctx, node):
    """Masked lookup in the local block of a split gathered axis (result partial over its axes), else a
    plain local take; operands resharded to the cheapest per-dim split."""
    axis = node.attrs["axis"]
    table, indices = ctx.value(node.inputs[0]), ctx.value(node.inputs[1])
    table_t, indices_t, out_t = take_terms(len(table.shape), len(indices.shape), axis)
    best = choose(letter_strategies(ctx, [(table_t, table), (indices_t, indices)], out_t, node))
    (table_sh, indices_sh), result = best.operands, best.result
    table, indices = ctx.reshard(table, table_sh), ctx.reshard(indices, indices_sh)
    vocab_axes = table_sh.dims[axis]
    if not vocab_axes:
        return ctx.emit_like(node, TAKE, [table, indices], {"axis": axis}, result)
    shard = ctx.shard_index(vocab_axes)
    return ctx.emit_like(node, TAKE_BLOCK, [table, indices, shard], {"axis": axis, "size": table.shape[axis]},
                         result)


@opdef.partition(SCATTER_ADD)
def _partition_scatter_add(ctx, node):
    """Masked scatter into the local block of a split scattered axis; updates split on index dims give a
    partial sum that the planner reduces. The operand joins that sum on one shard of its axes
    (``first_shard_only``), or, when its own layout is cheaper to keep (e.g. already split like the wanted
    result: the reduce-scatter of a sharded weight update), is added after the reduction."""
    axis, target = node.attrs["axis"], ctx.sharding(node.id)
    operand, indices, updates = (ctx.value(i) for i in node.inputs)
    operand_t, indices_t, updates_t = scatter_terms(len(operand.shape), len(indices.shape), axis)

    def add_after(sharding, result):  # cheaper to add the operand, laid out as wanted, after the reduction
        return bool(result.partial) and ctx.cost(operand, target) < ctx.cost(operand, sharding)

    def price(k, value, sharding, result):
        return ctx.cost(value, target if k == 0 and add_after(sharding, result) else sharding)
    best = choose(letter_strategies(ctx, [(operand_t, operand), (indices_t, indices), (updates_t, updates)],
                                    operand_t, node, price))
    shardings, result = best.operands, best.result
    indices, updates = ctx.reshard(indices, shardings[1]), ctx.reshard(updates, shardings[2])
    updates = ctx.mask_padding(updates, range(axis, axis + len(indices.shape)), 0)  # padding must add nothing
    if add_after(shardings[0], result):
        scattered = _scatter_local(ctx, node, _zeros(ctx, node, result), indices, updates, result)
        return ctx.emit_like(node, "add", [ctx.reshard(scattered, target), ctx.reshard(operand, target)], {}, target)
    base = ctx.reshard(operand, shardings[0])
    if result.partial:
        keep = ctx.shard_index(result.partial)
        base = ctx.emit(FIRST_SHARD_ONLY, [base, keep], {}, result, base.shape, base.dtype)
    return _scatter_local(ctx, node, base, indices, updates, result)


def _scatter_local(ctx, node, base, indices, updates, result):
    """The local scatter into ``base``: masked to this rank's block when ``result`` splits the scattered axis."""
    axis = node.attrs["axis"]
    rows_axes = result.dims[axis]
    if not rows_axes:
        return ctx.emit_like(node, SCATTER_ADD, [base, indices, updates], {"axis": axis}, result)
    shard = ctx.shard_index(rows_axes)
    return ctx.emit_like(node, SCATTER_ADD_BLOCK, [base, indices, updates, shard],
                         {"axis": axis, "size": node.shape[axis]}, result)


def _zeros(ctx, node, sharding):
    zero = ctx.emit("constant", [], {"value": np.zeros((), node.dtype)}, Sharding(()), (), node.dtype)
    local = sharding.local_shape(node.shape, ctx.mesh)
    return ctx.emit("broadcast_in_dim", [zero], {"shape": local, "dims": ()}, sharding, node.shape, node.dtype)


# ---------------------------------------------------------------- gradients: each op is the other's transpose
@opdef.vjp(TAKE)
def _take_vjp(node, g, ops, y):
    table, indices = ops
    return [lambda: scatter_add(core.zeros(table.shape, table.dtype), indices, g, node.attrs["axis"]), None]


@opdef.vjp(SCATTER_ADD)
def _scatter_add_vjp(node, g, ops, y):
    return [g, None, lambda: take(g, ops[1], node.attrs["axis"])]
