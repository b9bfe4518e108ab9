"""Pending (partial) sums kept pending through linear elementwise ops.

A partial-sum value (``P(..., partial="x")``: every rank along "x" holds a summand) can go through ops that
are linear in it without completing the sum: a sum or difference of pending sums over the same axes, a
pending sum negated, cast, times final values or divided by one. ``sum_carriers`` says which operands carry
the sum (the elementwise partition rule keeps those partial and brings the rest to final values);
``keep_sums_pending`` marks the values of such chains, from partial inputs to results wanted partial, as
partial before partitioning, since propagation completes layouts of final values only.

Inside a program the same holds for sums a partition rule leaves pending (a contraction over a split dim):
XLA's all-reduce reassociation. A value used once, by an op that can carry its sum (``deferrable``), is not
completed where it is made; the op that takes it (``pending_layout``) adds it to the other pending sums over
the same axes, and the one completion runs where the result is first needed final. So the backward pass's
cotangent of a value read by several contractions (Megatron's Q, K and V projections of one LayerNorm output)
is ONE all-reduce of the summed partial products, not one per product.
"""
from __future__ import annotations

from ..graph import Graph
from ..ops.core import ADD, CONVERT, DIV, MUL, NEG, SUB
from ..sharding import Sharding

# Ops linear in the operands that carry a pending sum: "all" operands are partial sums (a sum of sums), "one"
# is (a sum times final values), or the "first" is (a sum over a final value).
SUM_LINEAR = {ADD.name: "all", SUB.name: "all", NEG.name: "all", CONVERT.name: "all", MUL.name: "one",
              DIV.name: "first"}


# Ops whose result may take over an operand's pending sum; not a cast, which would move the reduction to another
# dtype (more bytes, or summands rounded before they are added)
TAKES_OVER = {op for op in SUM_LINEAR if op != CONVERT.name}


def sum_carriers(op: str, pending: list) -> list[int] | None:
    """The operands that carry the pending sum of a SUM_LINEAR op's result, given each operand's pending sum
    axes (or None/() where it holds final values); None when the result cannot be a pending sum."""
    kind = SUM_LINEAR.get(op)
    if kind is None or not any(pending):
        return None
    if kind == "all":
        return list(range(len(pending))) if all(p == pending[0] for p in pending) else None
    k = 0 if kind == "first" else next(k for k, p in enumerate(pending) if p)
    return [k] if pending[k] else None


def keep_sums_pending(graph: Graph, shardings: dict, fixed: dict) -> None:
    """Linear elementwise chains (``SUM_LINEAR``) from partial-sum inputs to a result wanted partial
    keep the sums pending: the values on the way become partial too, so no collective completes a sum that
    the result keeps pending anyway. (Propagation itself only completes layouts of final values.)"""
    pending = {p: shardings[p].partial for p in graph.params  # value -> the pending sum axes it can carry
               if shardings[p].partial and shardings[p].reduce_op == "sum"}
    if not pending:
        return
    for node in graph.nodes:
        carriers = sum_carriers(node.op, [pending.get(i) for i in node.inputs])
        if carriers:
            pending[node.id] = pending[node.inputs[carriers[0]]]
    for node in reversed(graph.nodes):
        s = shardings[node.id]
        if node.id in pending and s.partial == pending[node.id] and s.reduce_op == "sum":
            for k in sum_carriers(node.op, [pending.get(i) for i in node.inputs]) or ():
                vid = node.inputs[k]
                if vid not in fixed:
                    shardings[vid] = Sharding(shardings[vid].dims, s.partial)


def holds_pending_sum(sharding) -> bool:
    return isinstance(sharding, Sharding) and bool(sharding.partial) and sharding.reduce_op == "sum"


def pending_layout(op: str, operands: list) -> Sharding | None:
    """The layout of a ``TAKES_OVER`` op's result kept as a pending sum, given its operands' layouts: where its
    carrier operands hold pending sums over the same axes and every operand is laid out on the same dims (so none
    moves), those dims and axes. None otherwise (the rule then completes the sums it is given)."""
    if op not in TAKES_OVER:
        return None
    pending = [s.partial if holds_pending_sum(s) else None for s in operands]
    carriers = sum_carriers(op, pending)
    if not carriers or len({s.dims for s in operands}) != 1:  # else some operand would move first
        return None
    return Sharding(operands[carriers[0]].dims, pending[carriers[0]])


def deferrable(graph: Graph, live: set) -> set[int]:
    """The values whose pending sums may wait for their user: those used once (a graph output counts as a use),
    by a ``TAKES_OVER`` op. Used once, a pending sum joins at most one other, so completions never multiply:
    each pending result stands for one or more completions it replaces."""
    uses: dict[int, int] = dict.fromkeys(graph.outputs, 1)
    taker: dict[int, bool] = {}
    for node in graph.nodes:
        if node.id in live:
            for i in node.inputs:
                uses[i] = uses.get(i, 0) + 1
                taker[i] = node.op in TAKES_OVER
    return {v for v, n in uses.items() if n == 1 and taker.get(v)}
