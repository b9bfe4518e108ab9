"""The VJP rule of the ``ops/einsum.py`` family (the ``einsum`` record and its traced functions are there),
written with the traced ``einsum`` and registered in ``table.py``."""
from __future__ import annotations

from ...ops.einsum import EINSUM, einsum
from .table import vjp


# ================================================================ VJP
@vjp(EINSUM)
def _einsum_vjp(node, g, ops, y):
    """d(a.b)/da: the cotangent contracted with b over b's letters not in a (b's free letters are summed)."""
    (ta, tb), to = node.attrs["spec"].split("->")[0].split(","), node.attrs["spec"].split("->")[1]
    a, b = ops
    return [lambda: einsum(f"{to},{tb}->{ta}", g, b), lambda: einsum(f"{ta},{to}->{tb}", a, g)]
