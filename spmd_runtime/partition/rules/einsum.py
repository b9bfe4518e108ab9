"""The propagation and partition rules of the ``ops/einsum.py`` family (the ``einsum`` record, its traced
functions and kernel are there), registered in ``table.py``.

A letter split alike on both operands is a batch dim (result split) or a contracting dim (result
partial: all-reduce, or reduce-scatter when the result is wanted split); a free letter split on one
side needs the other operand replicated over that axis. The partition rule proposes every per-letter
split (``partition.strategy.letter_strategies``) and the one chooser picks.
"""
from __future__ import annotations

from ...graph import Node
from ...opdef import DOT_LEVEL
from ...ops.einsum import EINSUM
from ...sharding import Sharding
from ..propagation import combine, dedupe_axes
from ..strategy import choose, letter_strategies
from ..windowed import windowed_einsum
from .table import partition, propagation


# ================================================================ propagation
def einsum_terms(node: Node) -> tuple[str, str, str]:
    ins, out = node.attrs["spec"].split("->")
    lhs, rhs = ins.split(",")
    return lhs, rhs, out


@propagation(EINSUM, level=DOT_LEVEL)
def _einsum_propagation():
    def fwd(node, ins, g, mesh):
        lhs, rhs, out = einsum_terms(node)
        terms = [(t, s, g.nodes[i].shape) for t, s, i in zip((lhs, rhs), ins, node.inputs) if s is not None]
        if not terms:
            return None
        terms.sort(key=lambda t: -_numel(t[2]))  # the larger operand's sharding wins ties
        letter = [{c: s.dims[t.index(c)] for c in t} for t, s, _ in terms]
        return combine([Sharding(tuple(m.get(c, ()) for c in out)) for m in letter])

    def bwd(node, out_sh, ins, g, mesh):
        lhs, rhs, out = einsum_terms(node)
        from_out = {c: out_sh.dims[out.index(c)] for c in out}
        props = []
        for term, other_term, other in ((lhs, rhs, ins[1]), (rhs, lhs, ins[0])):
            side = {c: other.dims[other_term.index(c)] for c in other_term} if other is not None else {}
            dims = [from_out[c] if c in out else side.get(c, ()) for c in term]
            props.append(dedupe_axes(dims))
        return props
    return fwd, bwd


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ================================================================ partition rule
@partition(EINSUM)
def _einsum_partition(ctx, node):
    """The per-letter split with the least bytes moved plus local compute (module doc); where asked and it
    pays, its gather or reduce-scatter as a ring of permutes (partition/windowed.py)."""
    lhs_t, rhs_t, out_t = einsum_terms(node)
    a, b = ctx.value(node.inputs[0]), ctx.value(node.inputs[1])
    # The choice depends on these alone (the mesh and cost model are the partition's): a model's repeated
    # layers make the same choice, taken once.
    key = ("einsum strategy", node.attrs["spec"], a.sharding, a.shape, a.dtype, b.sharding, b.shape, b.dtype,
           ctx.sharding(node.id), node.shape, node.dtype)
    best = ctx.shared(key, lambda: choose(letter_strategies(ctx, [(lhs_t, a), (rhs_t, b)], out_t, node)))
    ring = windowed_einsum(ctx, node, best, (lhs_t, rhs_t, out_t), (a, b))
    if ring is not None:  # the gather before it or the reduce-scatter after it hidden step by step
        return ring
    contracting = [c for c in lhs_t if c in rhs_t and c not in out_t]
    args = [ctx.mask_padding(ctx.reshard(v, s), [t.index(c) for c in contracting], 0)
            for v, s, t in ((a, best.operands[0], lhs_t), (b, best.operands[1], rhs_t))]
    return ctx.emit_like(node, EINSUM.name, args, node.attrs, best.result)
