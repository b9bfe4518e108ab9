"""The VJP rule of the ``ops/indexing.py`` family (argmax, argmin; the records and traced functions are
there), registered in ``table.py``. logsumexp and softmax are traced from core ops: their VJPs are those ops'."""
from __future__ import annotations

from ...ops.indexing import ARGMAX, ARGMIN
from .table import vjp


@vjp(ARGMAX, ARGMIN)
def _arg_reduce_vjp(node, g, ops, y):
    """An index result carries no gradient (it is piecewise constant in x)."""
    return [None]
