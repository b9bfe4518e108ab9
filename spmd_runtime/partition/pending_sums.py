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

Loops (XLA's while-loop all-reduce code motion): a scan carry that starts at zero and whose body adds a pending
sum to it (``acc + g``: gradient accumulation over micro-batches) accumulates the summands pending, and the
sum is completed once, after the loop. The body's outputs that may stay pending (``partition(pending=...)``)
let the annotations on the way (``mesh_split`` of each micro-batch's gradient, used only by the accumulation)
pass the pending sum on, and so do the stacked results of a loop inside the body that feed them (each layer's
gradient from the scanned layers' backward pass): ``waiting_chains``.
"""
from __future__ import annotations

from ..graph import Graph
from ..ops.control import LOOP_OUT, SCAN
from ..ops.core import ADD, BROADCAST_IN_DIM, CONSTANT, MESH_SPLIT, CONVERT, DIV, MUL, NEG, RESHAPE, SUB, TRANSPOSE
from .reshape_map import map_reshape_sharding
from ..sharding import Sharding

# Ops linear in the operands that carry a pending sum: "all" operands are partial sums (a sum of sums), "one"
# is (a sum times final values), or the "first" is (a sum over a final value).
SUM_LINEAR = {ADD.name: "all", SUB.name: "all", NEG.name: "all", CONVERT.name: "all", MUL.name: "one",
              DIV.name: "first"}


# Ops whose result may take over an operand's pending sum: the linear ones but a cast, which would move the
# reduction to another dtype (more bytes, or summands rounded before they are added), and a transpose (a tied
# embedding's gradient from the output layer is transposed before it joins the lookup's) and a reshape that keeps
# every split local (a weight's gradient viewed back to the held shape before it is resharded to its grad_spec)
TAKES_OVER = {op for op in SUM_LINEAR if op != CONVERT.name} | {TRANSPOSE.name, RESHAPE.name}


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


def pending_layout(op: str, attrs: dict, operands: list, shapes=None, mesh=None) -> Sharding | None:
    """The layout of a ``TAKES_OVER`` op's result kept as a pending sum, given its operands' layouts: where its
    carrier operands hold pending sums over the same axes and every operand is laid out on the same dims (so none
    moves), those dims and axes; a reshape's (``shapes``: its operand's and result's) where its splits carry
    across locally. None otherwise (the rule then completes the sums it is given)."""
    if op not in TAKES_OVER:
        return None
    if op == RESHAPE.name:
        x = operands[0]
        return map_reshape_sharding(x, *shapes, mesh, exact=True) if holds_pending_sum(x) and shapes else None
    if op == TRANSPOSE.name:
        x = operands[0]
        return Sharding(tuple(x.dims[p] for p in attrs["perm"]), x.partial) if holds_pending_sum(x) else None
    pending = [s.partial if holds_pending_sum(s) else None for s in operands]
    carriers = sum_carriers(op, pending)
    if not carriers or len({s.dims for s in operands}) != 1:  # else some operand would move first
        return None
    return Sharding(operands[carriers[0]].dims, pending[carriers[0]])


def deferrable(graph: Graph, live: set) -> set[int]:
    """The values whose pending sums may wait for their user: those used once (a graph output counts as a use),
    by a ``TAKES_OVER`` op or as the initial value of a scan carry its body accumulates into (``accumulates_into``:
    gradients summed over one loop, then another). Used once, a pending sum joins at most one other, so
    completions never multiply: each pending result stands for one or more completions it replaces."""
    uses: dict[int, int] = dict.fromkeys(graph.outputs, 1)
    taker: dict[int, bool] = {}
    for node in graph.nodes:
        if node.id in live:
            for k, i in enumerate(node.inputs):
                uses[i] = uses.get(i, 0) + 1
                taker[i] = node.op in TAKES_OVER or accumulates_into(node, k) or resharded_to(node)
    return {v for v, n in uses.items() if n == 1 and taker.get(v)}


def resharded_to(node) -> bool:
    """Whether ``node`` is a ``reshard_only`` annotation (a ``grad_spec``'s): its operand's pending sum completes
    into the annotated layout (a reduce-scatter where it is split) instead of an all-reduce then a slice."""
    return node.op == MESH_SPLIT.name and bool(node.attrs.get("reshard_only"))


def accumulates_into(node, position: int) -> bool:
    """Whether input ``position`` of ``node`` is a scan carry its body adds a value to each iteration (output k =
    input k + g, ``accumulated``): a pending sum given there can stay pending through the loop."""
    if node.op != SCAN.name or position >= node.attrs["num_carry"]:
        return False
    body = node.attrs["body"]
    return bool(accumulated(body, [position], use_counts(body)))


def use_counts(graph: Graph) -> dict[int, int]:
    """value -> how often it is read (a graph output counts as a read)."""
    uses: dict[int, int] = dict.fromkeys(graph.outputs, 0)
    for v in graph.outputs:
        uses[v] += 1
    for node in graph.nodes:
        for i in node.inputs:
            uses[i] = uses.get(i, 0) + 1
    return uses


def accumulated(graph: Graph, positions, uses: dict) -> dict[int, int]:
    """Of the output ``positions``, those of accumulators: output k is ``parameter k + g``, read only there, and the
    parameter has no other use. Position -> g."""
    out = {}
    for k in positions:
        if k >= len(graph.params):
            continue
        node, p = graph[graph.outputs[k]], graph.params[k]
        if node.op == ADD.name and p in node.inputs and uses.get(node.id) == 1 and uses.get(p) == 1 \
                and node.inputs[0] != node.inputs[1]:
            out[k] = node.inputs[1] if node.inputs[0] == p else node.inputs[0]
    return out


def waiting_chains(graph: Graph, starts, uses: dict) -> tuple[set, dict]:
    """From each of ``starts`` (values whose pending sum may wait), down the chain of annotations read only there:
    those ``mesh_split`` nodes (they pass a pending sum on) and the loop results that end a chain (scan node ->
    the indices of its results that may come out pending)."""
    passes, loops = set(), {}
    for v in starts:
        while uses.get(v) == 1 and graph[v].op == MESH_SPLIT.name:
            passes.add(v)
            v = graph[v].inputs[0]
        if uses.get(v) == 1 and graph[v].op == LOOP_OUT.name:
            loops.setdefault(graph[v].inputs[0], set()).add(graph[v].attrs["index"])
    return passes, loops


def is_zeros(graph: Graph, vid: int) -> bool:
    """Whether value ``vid`` is a constant zero (``zeros``: a broadcast zero scalar, or a zero constant)."""
    node = graph[vid]
    if node.op == BROADCAST_IN_DIM.name:
        node = graph[node.inputs[0]]
    return node.op == CONSTANT.name and not node.attrs["value"].any()
