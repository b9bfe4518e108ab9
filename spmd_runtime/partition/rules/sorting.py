"""The propagation and partition rules of the ``ops/sorting.py`` family (sort, take_along_axis), registered in
``table.py``.

Both ops read their whole axis on every rank: a rank's block of the sorted axis depends on every entry of it.
So the rule lays the operand out with that axis whole (the planner's all-gather, or nothing when it is whole
already) and every other dim as the result wants it, then runs the op locally; a result wanted split along
the axis is sliced by the driver afterwards. ``take_along_axis``: the indices keep their own layout (the result
has their shape, split the same way, along the axis too), the array is whole along the axis and split like
the indices elsewhere (their non-axis dims are equal: the traced function broadcasts them).
"""
from __future__ import annotations

from ...opdef import BROADCAST_LEVEL
from ...ops.sorting import SORT, TAKE_ALONG_AXIS
from ...sharding import Sharding
from .table import partition, propagation


def whole_along(s: Sharding, axis: int) -> Sharding:
    """``s`` without partial sums and with dim ``axis`` unsplit."""
    return Sharding(tuple(() if i == axis else d for i, d in enumerate(s.dims)))


# ================================================================ propagation
@propagation(SORT, level=BROADCAST_LEVEL)
def _sort_propagation():
    """Every dim but the sorted one keeps its split, in both directions."""
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else whole_along(ins[0], node.attrs["axis"])

    def bwd(node, out, ins, g, mesh):
        return [whole_along(out, node.attrs["axis"])]
    return fwd, bwd


@propagation(TAKE_ALONG_AXIS, level=BROADCAST_LEVEL)
def _take_along_axis_propagation():
    """The result is laid out as the indices; the array as them off the axis."""
    def fwd(node, ins, g, mesh):
        if ins[1] is not None:
            return Sharding(ins[1].dims)
        return None if ins[0] is None else whole_along(ins[0], node.attrs["axis"])

    def bwd(node, out, ins, g, mesh):
        return [whole_along(out, node.attrs["axis"]), Sharding(out.dims)]
    return fwd, bwd


# ================================================================ partition rules
@partition(SORT)
def _sort_partition(ctx, node):
    x, axis = ctx.value(node.inputs[0]), node.attrs["axis"]
    layout = whole_along(ctx.sharding(node.id), axis)
    return ctx.emit_like(node, SORT, [ctx.reshard(x, layout)], node.attrs, layout)


@partition(TAKE_ALONG_AXIS)
def _take_along_axis_partition(ctx, node):
    x, idx, axis = ctx.value(node.inputs[0]), ctx.value(node.inputs[1]), node.attrs["axis"]
    layout = Sharding(ctx.sharding(node.id).dims)
    x, idx = ctx.reshard(x, whole_along(layout, axis)), ctx.reshard(idx, layout)
    return ctx.emit_like(node, TAKE_ALONG_AXIS, [x, idx], node.attrs, layout)
