"""Pending (partial) sums kept pending through linear elementwise ops.

A partial-sum value (``P(..., partial="x")``: every rank along "x" holds a summand) can go through ops that
are linear in it without completing the sum: a sum or difference of pending sums over the same axes, a
pending sum negated, cast, times final values or divided by one. ``sum_carriers`` says which operands carry
the sum (the elementwise partition rule keeps those partial and brings the rest to final values);
``keep_sums_pending`` marks the values of such chains, from partial inputs to results wanted partial, as
partial before partitioning, since propagation completes layouts of final values only.
"""
from __future__ import annotations

from ..graph import Graph
from ..ops.core import ADD, CONVERT, DIV, MUL, NEG, SUB
from ..sharding import Sharding

# Ops linear in the operands that carry a pending sum: "all" operands are partial sums (a sum of sums), "one"
# is (a sum times final values), or the "first" is (a sum over a final value).
SUM_LINEAR = {ADD.name: "all", SUB.name: "all", NEG.name: "all", CONVERT.name: "all", MUL.name: "one",
              DIV.name: "first"}


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
