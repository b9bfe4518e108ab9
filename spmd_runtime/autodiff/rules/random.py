"""The VJP rules of the ``ops/random.py`` family: random bits and what is made of them carry no gradient
(their operands are keys, counts and bits: integers)."""
from __future__ import annotations

from ...ops.random import RANDOM_OPS
from .table import vjp


@vjp(*RANDOM_OPS)
def _no_gradient(node, g, ops, y):
    return [None] * len(ops)
