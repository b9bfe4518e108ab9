"""The propagation and partition rules of the ``ops/random.py`` family, registered in ``table.py``.

``random_bits`` takes any sharding with no communication: each rank hashes the global indices of its own
block (one shard-number operand per split dim gives the block's offset, as ``iota``'s rule does), so its
bits are those of the global array whatever the mesh. Its layout comes from its users (it proposes none and
asks nothing of the key, which is replicated: two words). ``threefry2x32`` is pointwise in the count pairs
(their last dim, the pair, is never split); ``random_unit`` and ``random_int`` are core's elementwise ops.
"""
from __future__ import annotations

from ...opdef import ELEMENTWISE_LEVEL
from ...ops.random import RANDOM_BITS, RANDOM_INT, RANDOM_UNIT, THREEFRY
from ...sharding import Sharding
from . import core
from .table import partition, propagation

propagation(RANDOM_UNIT, RANDOM_INT, level=ELEMENTWISE_LEVEL)(core._elementwise_propagation)
partition(RANDOM_UNIT, RANDOM_INT)(core._elementwise_partition)


def _pairs_whole(s: Sharding) -> Sharding:
    return Sharding(s.dims[:-1] + ((),))


@propagation(RANDOM_BITS, level=ELEMENTWISE_LEVEL)
def _random_bits_propagation():
    return (lambda *a: None), (lambda node, out, ins, g, mesh: [None])


@propagation(THREEFRY, level=ELEMENTWISE_LEVEL)
def _threefry_propagation():
    fwd = lambda node, ins, g, mesh: None if ins[1] is None else _pairs_whole(ins[1])
    bwd = lambda node, out, ins, g, mesh: [None, _pairs_whole(out)]
    return fwd, bwd


def _replicated_key(ctx, node):
    return ctx.reshard(ctx.value(node.inputs[0]), Sharding.replicated(1))


@partition(RANDOM_BITS)
def _random_bits_partition(ctx, node):
    """The wanted layout as is: the block's bits from its global offsets (a shard number per split dim)."""
    target = ctx.sharding(node.id).without_partial()
    local = target.local_shape(node.shape, ctx.mesh)
    split = [d for d, axes in enumerate(target.dims) if ctx.mesh.axis_size(axes) > 1]
    attrs = {**node.attrs, "shape": local, "split": tuple(split), "blocks": tuple(local[d] for d in split)}
    shards = [ctx.shard_index(target.dims[d]) for d in split]
    return ctx.emit_like(node, RANDOM_BITS, [_replicated_key(ctx, node)] + shards, attrs, target)


@partition(THREEFRY)
def _threefry_partition(ctx, node):
    target = _pairs_whole(ctx.sharding(node.id).without_partial())
    counts = ctx.reshard(ctx.value(node.inputs[1]), target)
    return ctx.emit_like(node, THREEFRY, [_replicated_key(ctx, node), counts], {}, target)
