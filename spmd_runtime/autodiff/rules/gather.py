"""The VJP rules of the ``ops/gather.py`` family, registered in ``table.py``: take and scatter_add are each
other's transpose."""
from __future__ import annotations

from ...ops import core
from ...ops.gather import SCATTER_ADD, TAKE, scatter_add, take
from .table import vjp


@vjp(TAKE)
def _take_vjp(node, g, ops, y):
    table, indices = ops
    return [lambda: scatter_add(core.zeros(table.shape, table.dtype), indices, g, node.attrs["axis"]), None]


@vjp(SCATTER_ADD)
def _scatter_add_vjp(node, g, ops, y):
    return [g, None, lambda: take(g, ops[1], node.attrs["axis"])]
