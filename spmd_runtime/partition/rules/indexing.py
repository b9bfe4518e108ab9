"""The propagation and partition rules of the ``ops/indexing.py`` family (argmax, argmin; the records, traced
functions and kernels, ``arg_in_block`` and ``arg_candidate`` among them, are there), registered in
``table.py``.

Along a split axis (GSPMD-style, as XLA partitions a variadic (value, index) reduce):
1. mask this rank's padding with the identity (-inf for argmax, +inf for argmin: padding
   sits at the END of a block, so a real element always wins the local first-occurrence tie),
2. local value = max of the block (``reduce``), local index = first position in the block
   plus ``shard_index * block`` (``arg_in_block``),
3. best value = all-reduce MAX of the local values,
4. among the shards holding the best value, the smallest global index: each rank offers its
   index if its value equals the best, else the largest int64 (``arg_candidate``), and an
   all-reduce MIN picks the answer, the first occurrence across shard boundaries.
Both collectives come from the planner: the local value is a ``reduce`` result with a
partial 'max' (or 'min') sharding over the axis, resharded to a non-partial layout, and
the candidate index is returned with a partial 'min' sharding that the driver reshards to
the assigned result sharding. No direct ``ctx.emit`` of a collective is needed, so the cost
model, the comm summary and uneven padding are handled in one place (the planner).
"""
from __future__ import annotations

from ...opdef import BROADCAST_LEVEL
from ...ops.core import REDUCE, reduce_identity
from ...ops.indexing import ARG_CANDIDATE, ARG_IN_BLOCK, ARGMAX, ARGMIN
from ...sharding import Sharding
from .core import reduce_propagation
from .table import partition, propagation

_KIND = {ARGMAX.name: "max", ARGMIN.name: "min"}


# ---------------------------------------------------------------- propagation and partitioning
@propagation(ARGMAX, ARGMIN, level=BROADCAST_LEVEL)
def _arg_reduce_propagation():
    """Exactly a reduce over the same axis: kept dims keep their split, the searched one is dropped."""
    return reduce_propagation()


@partition(ARGMAX, ARGMIN)
def _partition_arg_reduce(ctx, node):
    """Local arg-reduction, or, along a split axis, value all-reduce then index all-reduce (module doc)."""
    kind, axes, target = _KIND[node.op], node.attrs["axes"], ctx.sharding(node.id)
    x = ctx.value(node.inputs[0])
    x = ctx.reshard(x, _operand_sharding(x.sharding, target, axes[0]))
    split = x.sharding.dims[axes[0]]
    if not split:
        return ctx.emit_like(node, node.op, [x], node.attrs, target)
    x = ctx.mask_padding(x, axes, reduce_identity(kind, x.dtype))
    per_shard = Sharding(target.dims, split, kind)
    value = ctx.emit(REDUCE, [x], {"kind": kind, "axes": axes}, per_shard, node.shape, x.dtype)
    best = ctx.reshard(value, Sharding(target.dims))  # planner: all-reduce max (min) over the split axes
    # the per-block index is only read locally, next line; labelled partial 'min' like the candidate
    candidates = Sharding(target.dims, split, "min")
    index = ctx.emit(ARG_IN_BLOCK, [x, ctx.shard_index(split)], {"kind": kind, "axes": axes}, candidates,
                     node.shape, "int64")
    # returned partial 'min': the driver's reshard to ``target`` is the all-reduce min over the split axes
    return ctx.emit(ARG_CANDIDATE, [value, best, index], {}, candidates, node.shape, "int64")


def _operand_sharding(x: Sharding, target: Sharding, axis: int) -> Sharding:
    """The operand's layout for a local search: kept dims as the result wants them, the searched dim keeps
    its split minus axes the result uses elsewhere (as the reduce rule)."""
    kept, dims = iter(target.dims), []
    for i, d in enumerate(x.dims):
        dims.append(tuple(a for a in d if a not in target.axes) if i == axis else next(kept))
    return Sharding(tuple(dims))
