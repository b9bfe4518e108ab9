"""The propagation and partition rules of the ``ops/gather.py`` family (take, scatter_add), registered in
``table.py``.

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

from ...opdef import DOT_LEVEL
from ...ops import core
from ...ops.gather import FIRST_SHARD_ONLY, SCATTER, SCATTER_ADD, SCATTER_ADD_BLOCK, SCATTER_BLOCK, TAKE, TAKE_BLOCK
from ...sharding import Sharding
from ..pending_sums import is_zeros
from ..propagation import combine, dedupe_axes
from ..strategy import choose, letter_strategies
from .table import partition, propagation


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
@propagation(TAKE, level=DOT_LEVEL)
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


@propagation(SCATTER_ADD, SCATTER, level=DOT_LEVEL)
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
    terms = take_terms if node.op == TAKE.name else scatter_terms
    return terms(len(first), len(indices), node.attrs["axis"])


# ---------------------------------------------------------------- partitioning
@partition(TAKE)
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
        return ctx.emit_like(node, TAKE, [table, indices], node.attrs, result)
    shard = ctx.shard_index(vocab_axes)
    return ctx.emit_like(node, TAKE_BLOCK, [table, indices, shard], {**node.attrs, "size": table.shape[axis]},
                         result)


@partition(SCATTER_ADD)
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
        if is_zeros(ctx.graph, node.inputs[0]):  # a VJP's scatter into zeros: the pending sum is the result (it
            return scattered                     # may wait for its user: partition/pending_sums.py)
        summands = [ctx.reshard(scattered, target), ctx.reshard(operand, target)]
        return ctx.emit_like(node, core.ADD, summands, {}, target)
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
        return ctx.emit_like(node, node.op, [base, indices, updates], node.attrs, result)
    shard = ctx.shard_index(rows_axes)
    block_op = SCATTER_BLOCK if node.op == SCATTER.name else SCATTER_ADD_BLOCK
    return ctx.emit_like(node, block_op, [base, indices, updates, shard], {**node.attrs, "size": node.shape[axis]},
                         result)


@partition(SCATTER)
def _partition_scatter(ctx, node):
    """set / min / max / mul cannot combine partial results by a sum: the operand stays laid out as the result
    is wanted, the updates follow it on the operand's dims and are whole on the index dims, the indices whole;
    a split scattered axis keeps, per rank, the updates aimed at its block (``scatter_block``)."""
    axis, result = node.attrs["axis"], Sharding(ctx.sharding(node.id).dims)
    operand, indices, updates = (ctx.value(i) for i in node.inputs)
    operand_t, _, updates_t = scatter_terms(len(operand.shape), len(indices.shape), axis)
    base = ctx.reshard(operand, result)
    indices = ctx.reshard(indices, Sharding.replicated(len(indices.shape)))
    updates = ctx.reshard(updates, Sharding(tuple(_map_dims(operand_t, result, updates_t))))
    return _scatter_local(ctx, node, base, indices, updates, result)


def _zeros(ctx, node, sharding):
    zero = ctx.emit(core.CONSTANT, [], {"value": np.zeros((), node.dtype)}, Sharding(()), (), node.dtype)
    local = sharding.local_shape(node.shape, ctx.mesh)
    return ctx.emit(core.BROADCAST_IN_DIM, [zero], {"shape": local, "dims": ()}, sharding, node.shape, node.dtype)

