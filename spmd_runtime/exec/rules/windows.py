"""The binders of the windowed ops (``ops/windows.py``), registered in ``table.py``, each choosing its kernel once,
from its local shapes, when the program is bound, not per step: a conv's (im2col per image or over all rows, or
col2im for a transposed conv); max-pooling's gradient scatter (``window_scatter``): a compiled C loop where one
runs it (``exec/backends/window_loops.py``: windows over at most the last two dims, float32 / float64, a C
compiler), else NumPy's bincount kernel."""
from __future__ import annotations

import numpy as np

from ...ops.windows import CONV, WINDOW_SCATTER, conv_method, window_scatter_kernel
from ..backends import window_loops
from .table import bind


@bind(CONV)
def _bind_conv(interp, ins):
    lhs, rhs = (interp.program.instrs[a].shape for a in ins.args)
    a, xp = ins.attrs, interp.xp
    method = conv_method(lhs, rhs, a["strides"], a["padding"], a["lhs_dilation"], a["rhs_dilation"])
    return lambda x, w: method(xp, x, w, **a)


@bind(WINDOW_SCATTER)
def _bind_window_scatter(interp, ins):
    """A partitioned shard's low grows with its shard index operands (``index_dims``): its geometry then is
    found per call (the same form: only the low of a window dim moves)."""
    a, g = ins.attrs, interp.program.instrs[ins.args[0]]
    shape, index_dims, low_step = tuple(a["shape"]), tuple(a.get("index_dims", ())), a.get("low_step")
    geometry = lambda low: window_loops.geometry(shape, g.shape, a["window"], a["strides"], low)
    geo = geometry(a["low"])
    loop = window_loops.scatter_loop(g.dtype) if interp.xp is np and geo else None
    if loop is None or (index_dims and any(d < len(shape) - 2 for d in index_dims)):
        return lambda v, taps, *index: window_scatter_kernel(interp.xp, v, taps, *index, **a)
    if not index_dims:
        return lambda v, taps: loop(v, taps, shape, geo)

    def shifted(v, taps, *index):
        low = list(a["low"])
        for d, i in zip(index_dims, index):
            low[d] += low_step[d] * int(i)
        geo = geometry(low)
        return loop(v, taps, shape, geo) if geo else window_scatter_kernel(interp.xp, v, taps, *index, **a)
    return shifted
