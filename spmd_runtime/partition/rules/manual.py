"""The propagation and partition rules of the ``ops/manual.py`` family, registered in ``table.py``: inside a
region's body each collective propagates like the layout it keeps and is partitioned into one ``ops/spmd.py``
collective over its (manual) axes; the region itself is the machinery of ``partition/manual.py`` (its body
partitioned once as its own SPMD program over the automatic axes)."""
from __future__ import annotations

from ...ops import core
from ...ops.manual import (AXIS_INDEX, PALL_GATHER, PALL_TO_ALL, PBROADCAST, PPERMUTE, PSUM, PSUM_SCATTER,
                           SHARD_MAP)
from ...ops.spmd import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from ...opdef import BROADCAST_LEVEL, ELEMENTWISE_LEVEL
from ...sharding import Sharding
from .. import manual
from .table import PARTITION, partition, propagation

propagation(SHARD_MAP, level=ELEMENTWISE_LEVEL)(manual.region_propagation)
PARTITION.register(SHARD_MAP, value=manual.partition_region)


# ---------------------------------------------------------------- propagation inside a body (automatic axes)
def _clear(s: Sharding | None, *dims, keep_partial=True) -> Sharding | None:
    if s is None:
        return None
    out = s.with_dims(tuple(() if d in dims else a for d, a in enumerate(s.dims)))
    return out if keep_partial else out.without_partial()


def _dims_of(node) -> tuple[int, ...]:
    a = node.attrs
    return (a["dim"],) if "dim" in a else (a["split_dim"], a["concat_dim"]) if "split_dim" in a else ()


@propagation(PSUM, PPERMUTE, PBROADCAST, level=ELEMENTWISE_LEVEL)
def _same_layout_propagation():
    fwd = lambda node, ins, g, mesh: None if ins[0] is None else ins[0].without_partial()
    bwd = lambda node, out, ins, g, mesh: [out.without_partial()]
    return fwd, bwd


@propagation(PALL_GATHER, PSUM_SCATTER, PALL_TO_ALL, level=BROADCAST_LEVEL)
def _whole_dims_propagation():
    fwd = lambda node, ins, g, mesh: _clear(ins[0], *_dims_of(node), keep_partial=False)
    bwd = lambda node, out, ins, g, mesh: [_clear(out, *_dims_of(node), keep_partial=False)]
    return fwd, bwd


@propagation(AXIS_INDEX, level=ELEMENTWISE_LEVEL)
def _axis_index_propagation():
    return (lambda node, ins, g, mesh: Sharding(())), (lambda node, out, ins, g, mesh: [])


# ---------------------------------------------------------------- partition rules: one collective each
def _operand(ctx, node, *dims, keep_partial=True):
    """The operand with ``dims`` whole over the automatic axes (the collective moves them between shards)."""
    x = ctx.value(node.inputs[0])
    return ctx.reshard(x, _clear(x.sharding, *dims, keep_partial=keep_partial))


@partition(PSUM)
def _psum_partition(ctx, node):
    a = node.attrs
    x = _operand(ctx, node, keep_partial=a["op"] == "sum")  # a max of partial sums is not their sum's max
    return ctx.emit_like(node, ALL_REDUCE, [x], {"axes": a["axes"], "op": a["op"]}, x.sharding)


@partition(PALL_GATHER, PSUM_SCATTER)
def _gather_scatter_partition(ctx, node):
    a = node.attrs
    x = _operand(ctx, node, a["dim"])
    op = ALL_GATHER if node.op == PALL_GATHER.name else REDUCE_SCATTER
    attrs = {"axes": a["axes"], "dim": a["dim"]} if op is ALL_GATHER else {"axes": a["axes"], "dim": a["dim"],
                                                                            "op": "sum"}
    return ctx.emit_like(node, op, [x], attrs, x.sharding)


@partition(PALL_TO_ALL)
def _all_to_all_partition(ctx, node):
    a = node.attrs
    x = _operand(ctx, node, a["split_dim"], a["concat_dim"])
    return ctx.emit_like(node, ALL_TO_ALL, [x], {"axes": a["axes"], "split_dim": a["split_dim"],
                                                 "concat_dim": a["concat_dim"]}, x.sharding)


@partition(PPERMUTE)
def _ppermute_partition(ctx, node):
    """Shard numbers along the axes become world-rank pairs, in every group of the other axes."""
    a, x = node.attrs, ctx.value(node.inputs[0])
    pairs = sorted((group[s], group[d]) for group in ctx.mesh.groups(a["axes"]) for s, d in a["perm"])
    return ctx.emit_like(node, COLLECTIVE_PERMUTE, [x], {"pairs": tuple(pairs)}, x.sharding)


@partition(PBROADCAST)
def _pbroadcast_partition(ctx, node):
    return ctx.value(node.inputs[0])  # a type, no data moved


@partition(AXIS_INDEX)
def _axis_index_partition(ctx, node):
    index = ctx.shard_index(node.attrs["axes"])
    return ctx.emit_like(node, core.CONVERT, [index], {"dtype": "int32"}, Sharding(()))
