"""The VJP rule of the ``ops/fft.py`` family, registered in ``table.py``: none yet. The autodiff is real and the
transforms are complex maps, so differentiating through one raises, naming it (never a silent zero)."""
from __future__ import annotations

from ...ops.fft import FFT
from .table import vjp


@vjp(FFT)
def _fft_vjp(node, g, ops, y):
    def refuse():
        raise NotImplementedError(f"fft.{node.attrs['fn']} has no VJP in spmd_runtime (the autodiff is real); got a "
                                  f"gradient through it at {node.where or 'its node'}")
    return [refuse]
