"""The propagation and partition rules of the ``ops/control.py`` family, registered in ``table.py``; the rules
themselves are the loop machinery of ``partition/loops.py`` (carry shardings agreed around the loop, each body
partitioned once as its own SPMD program)."""
from __future__ import annotations

from ...ops.control import CHECKPOINT_NAME, COND, LOOP_OUT, SCAN, WHILE
from ...opdef import ELEMENTWISE_LEVEL
from .. import loops
from .table import PARTITION, partition, propagation

propagation(SCAN, WHILE, COND, level=ELEMENTWISE_LEVEL)(loops.control_propagation)
propagation(LOOP_OUT, level=ELEMENTWISE_LEVEL)(loops.loop_out_propagation)
PARTITION.register(SCAN, value=loops.partition_scan)
PARTITION.register(WHILE, value=loops.partition_while)
PARTITION.register(COND, value=loops.partition_cond)
PARTITION.register(LOOP_OUT, value=loops.partition_loop_out)


@propagation(CHECKPOINT_NAME, level=ELEMENTWISE_LEVEL)
def _checkpoint_name_propagation():
    """A named value keeps its operand's layout, both ways (the name is for autodiff, which is done)."""
    return (lambda node, ins, g, mesh: ins[0]), (lambda node, out, ins, g, mesh: [out])


@partition(CHECKPOINT_NAME)
def _checkpoint_name_partition(ctx, node):
    """No instruction of its own: the operand's value, laid out as propagated."""
    return ctx.reshard(ctx.value(node.inputs[0]), ctx.sharding(node.id))
