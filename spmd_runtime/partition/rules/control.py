"""The propagation and partition rules of the ``ops/control.py`` family, registered in ``table.py``; the rules
themselves are the loop machinery of ``partition/loops.py`` (carry shardings agreed around the loop, each body
partitioned once as its own SPMD program)."""
from __future__ import annotations

from ...ops.control import COND, LOOP_OUT, SCAN, WHILE
from ...opdef import ELEMENTWISE_LEVEL
from .. import loops
from .table import PARTITION, propagation

propagation(SCAN, WHILE, COND, level=ELEMENTWISE_LEVEL)(loops.control_propagation)
propagation(LOOP_OUT, level=ELEMENTWISE_LEVEL)(loops.loop_out_propagation)
PARTITION.register(SCAN, value=loops.partition_scan)
PARTITION.register(WHILE, value=loops.partition_while)
PARTITION.register(COND, value=loops.partition_cond)
PARTITION.register(LOOP_OUT, value=loops.partition_loop_out)

