"""Sharding propagation (GSPMD section 3.5): complete every value's sharding.

Forward (operands -> result) and backward (result -> operands) passes repeat to
a fixed point, level by level: elementwise-like ops first, then broadcast and
reduce, then contractions. A value's sharding only ever becomes strictly more
specific (``merge``), which guarantees termination, and user annotations are
never overridden. Values still unknown at the end are replicated.

An annotation may leave dims free (``UNCONSTRAINED`` in a spec: a mesh_split's
``unconstrained`` attribute, or ``free`` for inputs and outputs): its other dims
are pinned, and the free ones are refined by propagation like any unannotated
value, with the axes the pinned dims leave unused.

Each op's rule (level, forward, backward) sits in the partition layer's table (``rules/table.py:
PROPAGATION``, keyed by the op's record, one module per op family in ``rules/``); this module is the
engine and the helpers rules share.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from ..graph import Graph
from ..mesh import Mesh
from ..opdef import BROADCAST_LEVEL, DOT_LEVEL, ELEMENTWISE_LEVEL, OPS
from ..sharding import Sharding
from .rules.table import PROPAGATION


@dataclass
class Propagation:
    shardings: dict[int, Sharding]
    origin: dict[int, str]  # "user", "propagated" or "default" (nothing known: replicated)


def propagate(graph: Graph, mesh: Mesh, fixed: dict[int, Sharding], seeds=None, free=None) -> Propagation:
    """Complete shardings for every node; ``fixed`` holds the user's annotations, ``seeds`` starting
    shardings that propagation may refine (a loop body's parameters, from outside the loop), ``free``
    value -> dims of its annotation left UNCONSTRAINED (mesh_split nodes say theirs themselves)."""
    rules = {n.op: PROPAGATION.get(n.op) for n in graph.nodes if n.op in OPS}
    missing = sorted({n.op for n in graph.nodes if rules.get(n.op) is None})
    if missing:
        raise NotImplementedError(f"sharding propagation needs a rule for every op; got no rule for {missing}")
    seeds = seeds or {}
    free = {**{n.id: n.attrs["unconstrained"] for n in graph.nodes if n.attrs.get("unconstrained")}, **(free or {})}
    pinned = {vid: s for vid, s in fixed.items() if not free.get(vid)}
    loose = {vid: (s, frozenset(free[vid])) for vid, s in fixed.items() if free.get(vid)}
    sh: dict[int, Sharding | None] = {n.id: fixed.get(n.id, seeds.get(n.id)) for n in graph.nodes}
    sweeps = _Sweeps(graph, mesh, sh, (pinned, loose), rules)
    for level in (ELEMENTWISE_LEVEL, BROADCAST_LEVEL, DOT_LEVEL):
        while sweeps.sweep(level):
            pass
    origin = {n.id: "user" if n.id in fixed else "propagated" if sh[n.id] else "default" for n in graph.nodes}
    done = {n.id: sh[n.id] or Sharding.replicated(len(n.shape)) for n in graph.nodes}
    return Propagation(done, origin)


class _Sweeps:
    """Forward then backward passes over the nodes. A rule is a function of the shardings it reads, so a
    node whose operands and result kept their shardings since its last visit would propose the same again:
    a change to a value marks it and its users for another visit each way, and unmarked nodes are skipped.
    Same updates in the same order as visiting every node; what is saved is re-running rules on settled
    parts of the graph, and (a heap of the marked nodes instead of a scan of all) walking past them.

    A pass visits its marked nodes in order (ascending forward, descending backward); a node marked during a
    pass is visited in it when the pass has not reached it yet, else in the next sweep."""

    def __init__(self, graph, mesh, sh, fixed, rules):
        self.graph, self.mesh, self.sh, self.fixed = graph, mesh, sh, fixed
        nodes = graph.nodes
        chosen = [rules[n.op] for n in nodes]
        self.levels = [r.level for r in chosen]
        self.forwards, self.backwards = [r.forward for r in chosen], [r.backward for r in chosen]
        self.users: list[list[int]] = [[] for _ in nodes]
        for n in nodes:
            for i in set(n.inputs):
                self.users[i].append(n.id)
        active = [n.id for n in nodes if n.inputs]  # nodes without operands have no rule to run
        self.runs = [False] * len(nodes)
        for i in active:
            self.runs[i] = True
        self.forward_due, self.backward_due = set(active), set(active)
        self.level = 0
        self.heap: list[int] = []  # the pass in progress: due nodes it has yet to reach (negated backward)
        self.cursor, self.forward = 0, True

    def sweep(self, level) -> bool:
        graph, mesh, sh, nodes, heap = self.graph, self.mesh, self.sh, self.graph.nodes, self.heap
        forward_due, backward_due, levels, update, pop = self.forward_due, self.backward_due, self.levels, \
            self._update, heapq.heappop
        self.level, changed = level, False
        self.forward = True
        heap[:] = sorted(i for i in forward_due if levels[i] <= level)
        while heap:
            v = self.cursor = pop(heap)
            forward_due.discard(v)
            node = nodes[v]
            cand = self.forwards[v](node, [sh[i] for i in node.inputs], graph, mesh)
            if cand is not None:
                changed |= update(v, cand)
        self.forward = False
        heap[:] = sorted(-i for i in backward_due if levels[i] <= level)
        while heap:
            v = self.cursor = -pop(heap)
            out = sh[v]
            if out is None:
                continue  # stays due: visited once it has a sharding
            backward_due.discard(v)
            node = nodes[v]
            cands = self.backwards[v](node, out, [sh[i] for i in node.inputs], graph, mesh)
            for i, cand in zip(node.inputs, cands):
                if cand is not None:
                    changed |= update(i, cand)
        return changed

    def _update(self, vid, cand) -> bool:
        """Refine value ``vid`` by ``cand``; on a change, mark it and its users for another visit."""
        sh, (pinned, loose) = self.sh, self.fixed
        cur = sh[vid]
        if cand is None or vid in pinned:
            return False
        if type(cur) is Sharding and (cand is cur or cand == cur) and not cur.partial and cur.reduce_op == "sum" \
                and vid not in loose:
            return False  # merging a sharding with itself keeps it (legalizing only drops axes it has)
        node = self.graph.nodes[vid]
        if hasattr(cand, "refine"):  # the results of a control node (partition/loops.py) refine part by part
            new = cand.refine(cur, node, self.mesh)
        else:
            cand = legalize(cand, node.shape, self.mesh)
            new = cand if cur is None else merge(cur, cand)
        if vid in loose:
            new = refine_free(*loose[vid], new)
        if new == cur or (cur is None and not new.axes):
            return False
        sh[vid] = new
        self._mark(vid)
        return True

    def _mark(self, vid) -> None:
        """Value ``vid`` changed: it and its users are due another visit each way, in this pass if not reached."""
        runs, levels, level, cursor, heap = self.runs, self.levels, self.level, self.cursor, self.heap
        forward_due, backward_due, forward = self.forward_due, self.backward_due, self.forward
        for n in (vid, *self.users[vid]):  # their rules read this value
            if not runs[n]:
                continue
            if n not in forward_due:
                forward_due.add(n)
                if forward and n > cursor and levels[n] <= level:
                    heapq.heappush(heap, n)
            if n not in backward_due:
                backward_due.add(n)
                if not forward and n < cursor and levels[n] <= level:
                    heapq.heappush(heap, -n)


def refine_free(annotation: Sharding, free: frozenset, new: Sharding) -> Sharding:
    """``new`` on the annotation's free dims, the annotation on its pinned dims (and its pending reduction);
    a free dim drops the axes a pinned dim uses."""
    used = {a for d, axes in enumerate(annotation.dims) if d not in free for a in axes} | set(annotation.partial)
    dims = [tuple(a for a in new.dims[d] if a not in used) if d in free else axes
            for d, axes in enumerate(annotation.dims)]
    return Sharding(tuple(dims), annotation.partial, annotation.reduce_op)


@lru_cache(maxsize=65536)  # few distinct (sharding, shape) pairs recur over and over in a model's graph
def legalize(s: Sharding, shape, mesh: Mesh) -> Sharding:
    """Keep, per dim, the longest prefix of axes with no more shards than elements (uneven splits are
    fine, empty shards are waste); drop partials."""
    dims = []
    for n, axes in zip(shape, s.dims):
        k, keep = 1, []
        for a in axes:
            k *= mesh.axis_size(a)
            if k > n:
                break
            keep.append(a)
        dims.append(tuple(keep))
    return Sharding(tuple(dims))


@lru_cache(maxsize=65536)
def merge(cur: Sharding, cand: Sharding) -> Sharding:
    """``cur`` refined by ``cand``: a dim takes cand's axes when cur's are a prefix of them,
    minus axes already used elsewhere; on conflict ``cur`` wins."""
    used, out = set(cur.axes), []
    for old, new in zip(cur.dims, cand.dims):
        keep = list(old)
        if new[:len(old)] == old:
            for a in new[len(old):]:
                if a in used:
                    break
                keep.append(a)
                used.add(a)
        out.append(tuple(keep))
    return Sharding(tuple(out))


def combine(shardings: list[Sharding | None]) -> Sharding | None:
    """Dim-wise union of same-shape shardings: the most split one first, others fill gaps."""
    known = [s for s in shardings if s is not None]
    if len(known) < 2:
        return known[0] if known else None
    first = known[0]
    if not first.partial and first.reduce_op == "sum" and all(s == first for s in known):
        return first  # what merging equal shardings gives
    known.sort(key=lambda s: -len(s.axes))
    out = known[0]
    for s in known[1:]:
        out = merge(out, s)
    return out


def dedupe_axes(dims) -> Sharding:
    """Dims as a Sharding where a dim reusing a mesh axis of an earlier dim is left unsplit."""
    used, out = set(), []
    for d in dims:
        keep = tuple(a for a in d if a not in used)
        keep = d if keep == d else ()
        used.update(keep)
        out.append(keep)
    return Sharding(tuple(out))
