"""The VJP rule of the ``ops/top_k.py`` family, registered in ``table.py``: the values' cotangent goes to the
chosen positions (a one-hot scatter written with existing ops, so it partitions like any other graph)."""
from __future__ import annotations

from ...ops import core
from ...ops.slicing import broadcasted_iota
from ...ops.top_k import INDEX_DTYPE, TOP_K
from ...trace import emit
from .table import vjp


@vjp(TOP_K)
def _top_k_vjp(node, g, ops, y):
    """The values' cotangent goes to the positions they came from: sum over j of one_hot(indices[j]) * g[j];
    the indices carry no gradient."""
    if node.attrs["output"] == "indices":
        return [None]
    x = ops[0]

    def scatter():
        indices = emit(TOP_K, [x], {**node.attrs, "output": "indices"}, node.shape, INDEX_DTYPE)
        positions = broadcasted_iota(INDEX_DTYPE, node.shape + (x.shape[-1],), x.ndim)  # (..., k, n)
        hit = core.equal(positions, core.expand_dims(indices, -1))
        return core.sum(core.where(hit, core.expand_dims(g, -1), 0.0), axis=-2)
    return [scatter]
