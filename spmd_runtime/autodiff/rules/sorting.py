"""The VJP rules of the ``ops/sorting.py`` family, registered in ``table.py``, written with traced ops that
partition: sort's values send the cotangent back through the inverse permutation (the argsort of the
argsort, then a ``take_along_axis``: O(n) memory); ``take_along_axis`` scatters its cotangent to the positions
it read by a one-hot sum over the taken entries (O(taken x axis) memory per row; repeated indices add up)."""
from __future__ import annotations

from ...ops import core
from ...ops.slicing import broadcasted_iota
from ...ops.sorting import INDEX_DTYPE, SORT, TAKE_ALONG_AXIS, take_along_axis
from ...trace import emit
from .table import vjp


@vjp(SORT)
def _sort_vjp(node, g, ops, y):
    if node.attrs["output"] == "indices":
        return [None]
    x, axis = ops[0], node.attrs["axis"]

    def unsort():
        order = emit(SORT, [x], {**node.attrs, "output": "indices"}, x.shape, INDEX_DTYPE)
        inverse = emit(SORT, [order], {"axis": axis, "descending": False, "output": "indices"}, x.shape, INDEX_DTYPE)
        return take_along_axis(g, inverse, axis)
    return [unsort]


@vjp(TAKE_ALONG_AXIS)
def _take_along_axis_vjp(node, g, ops, y):
    x, idx = ops
    axis = node.attrs["axis"]
    n = x.shape[axis]

    def scatter():
        wrapped = core.where(core.less(idx, 0), idx + n, idx)
        if node.attrs["clip"]:
            wrapped = core.minimum(core.maximum(wrapped, 0), n - 1)
        moved = core.moveaxis(wrapped, axis, -1)  # (..., m)
        grid = moved.shape + (n,)
        hit = core.equal(broadcasted_iota(moved.dtype, grid, moved.ndim), core.expand_dims(moved, -1))
        spread = core.where(hit, core.expand_dims(core.moveaxis(g, axis, -1), -1), 0.0)
        return core.moveaxis(core.sum(spread, axis=-2), -1, axis)  # out-of-range (filled) entries hit nothing
    return [scatter, None]
