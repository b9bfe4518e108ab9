"""The propagation and partition rules of the ``ops/fft.py`` family (the ``fourier_transform`` op), registered in ``table.py``.

A transform reads its whole axes: the rule lays the operand out with them whole (the planner's all-gather, or
nothing when they are whole already) and every other dim as the result wants it, then transforms locally (the
other dims keep their length); a result wanted split along a transformed axis is sliced by the driver.
"""
from __future__ import annotations

from ...opdef import BROADCAST_LEVEL
from ...ops.fft import FFT
from ...sharding import Sharding
from .table import partition, propagation


def whole_on(s: Sharding, axes) -> Sharding:
    """``s`` without partial sums and with ``axes`` unsplit."""
    return Sharding(tuple(() if i in axes else d for i, d in enumerate(s.dims)))


@propagation(FFT, level=BROADCAST_LEVEL)
def _fft_propagation():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else whole_on(ins[0], node.attrs["dims"])

    def bwd(node, out, ins, g, mesh):
        return [whole_on(out, node.attrs["dims"])]
    return fwd, bwd


@partition(FFT)
def _fft_partition(ctx, node):
    layout = whole_on(ctx.sharding(node.id), node.attrs["dims"])
    return ctx.emit_like(node, FFT, [ctx.reshard(ctx.value(node.inputs[0]), layout)], node.attrs, layout)
