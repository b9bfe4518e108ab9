"""The binders of the ``ops/slicing.py`` family, registered in ``table.py``: a ``dynamic_update_slice`` whose
operand buffer dies there (``Instr.donate``, partition/partitioner.py) writes the update into it instead of a
copy, so a loop's buffer updated slot by slot (the 1F1B saved-input ring) is never held twice."""
from __future__ import annotations

from functools import partial

from ...ops.slicing import DYNAMIC_UPDATE_SLICE, dynamic_update_slice_into, dynamic_update_slice_kernel
from .table import BIND


@BIND.register(DYNAMIC_UPDATE_SLICE)
def bind_dynamic_update_slice(interp, ins):
    if ins.donate == 0:
        return partial(dynamic_update_slice_into, interp.xp)
    if ins.donate == 1:  # an update of the operand's whole shape: the result is the update itself
        return lambda x, update, *starts: update
    return partial(dynamic_update_slice_kernel, interp.xp)
