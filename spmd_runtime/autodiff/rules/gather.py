"""The VJP rules of the ``ops/gather.py`` family, registered in ``table.py``: take and scatter_add are each
other's transpose; scatter's (set / min / max / mul) route the cotangent to the entries that made the result."""
from __future__ import annotations

import numpy as np

from ...ops import core
from ...ops.gather import SCATTER, SCATTER_ADD, TAKE, _scatter_add, _spread_tensor, _take, scatter
from .table import vjp


@vjp(TAKE)
def _take_vjp(node, g, ops, y):
    table, indices = ops
    mode = node.attrs.get("mode", "clip")
    return [lambda: _scatter_add(core.zeros(table.shape, table.dtype), indices, g, node.attrs["axis"], mode), None]


@vjp(SCATTER_ADD)
def _scatter_add_vjp(node, g, ops, y):
    return [g, None, lambda: _take(g, ops[1], node.attrs["axis"], node.attrs.get("mode", "clip"))]


@vjp(SCATTER)
def _scatter_vjp(node, g, ops, y):
    """set: the operand's entries no update landed on, and each winning update; min / max: the entries equal
    to the result (a tie: every tied entry); mul: g times the other factors, assuming unique indices (JAX's
    contract for the gradient of a multiplying scatter)."""
    x, indices, updates = ops
    axis, kind = node.attrs["axis"], node.attrs["combine"]
    n = x.shape[axis]
    valid = _spread_tensor(core.logical_and(indices >= 0, indices < n), axis, updates.ndim)
    picked = lambda v: core.where(valid, _take(v, indices, axis), core.zeros((), v.dtype))  # v at each update
    if kind == "set":
        ids = _update_ids(indices, updates.shape, axis)
        winner = scatter(core.full(x.shape, -1, ids.dtype), indices, ids, axis, "set")
        won = core.equal(_take(winner, indices, axis), ids)
        return [lambda: core.where(winner < 0, g, 0.0),
                None, lambda: core.where(core.logical_and(valid, won), _take(g, indices, axis), 0.0)]
    if kind in ("min", "max"):
        return [lambda: core.where(core.equal(x, y), g, 0.0), None,
                lambda: core.where(core.equal(picked(y), updates), picked(g), 0.0)]
    factors = scatter(core.ones(x.shape, x.dtype), indices, updates, axis, "multiply")
    return [lambda: g * factors, None, lambda: picked(g * x)]


def _update_ids(indices, shape, axis):
    """Each update's position in the index array (C order), broadcast over the update's other dims."""
    ids = core.asarray(np.arange(indices.size, dtype=np.int64).reshape(indices.shape))
    return core.broadcast_in_dim(ids, shape, tuple(range(axis, axis + indices.ndim)))
