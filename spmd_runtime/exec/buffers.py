"""Which buffers of a program may be reused from one run to the next, decided once per program.

A collective's receive buffer can be kept and refilled every run (no allocation,
no first-touch page faults) only if no program output can be that buffer or a
view of it: the caller keeps outputs after the run, and the next run would
overwrite them. Ownership follows the partitioner's alias rules: fresh ops make
new buffers, an op computed in place (``donate``) writes into its operand's
buffer, and any other op may return a view of its operands.
"""
from __future__ import annotations

from ..opdef import lookup


def output_buffers(program) -> frozenset[int]:
    """Slots of the instructions that made a buffer some program output may be, or view."""
    owners: dict[int, frozenset] = {}
    for ins in program.instrs:
        record = lookup(ins.op)
        if record.read_only:
            owners[ins.out] = frozenset()
        elif ins.donate >= 0:
            owners[ins.out] = owners[ins.args[ins.donate]]
        elif record.fresh:
            owners[ins.out] = frozenset({ins.out})
        else:
            owners[ins.out] = frozenset().union(*(owners[a] for a in ins.args))
    return frozenset().union(*(owners[o.slot] for o in program.outputs))
