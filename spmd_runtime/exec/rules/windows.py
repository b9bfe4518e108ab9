"""The binders of the windowed ops (``ops/windows.py``), registered in ``table.py``: each conv instruction's
kernel (im2col per image or over all rows, or col2im for a transposed conv) is chosen once, from its local
shapes, when the program is bound, not per step."""
from __future__ import annotations

from ...ops.windows import CONV, conv_method
from .table import bind


@bind(CONV)
def _bind_conv(interp, ins):
    lhs, rhs = (interp.program.instrs[a].shape for a in ins.args)
    a, xp = ins.attrs, interp.xp
    method = conv_method(lhs, rhs, a["strides"], a["padding"], a["lhs_dilation"], a["rhs_dilation"])
    return lambda x, w: method(xp, x, w, **a)
