"""Sharding propagation (GSPMD section 3.5): complete every value's sharding.

Forward (operands -> result) and backward (result -> operands) passes repeat to
a fixed point, level by level: elementwise-like ops first, then broadcast and
reduce, then contractions. A value's sharding only ever becomes strictly more
specific (``merge``), which guarantees termination, and user annotations are
never overridden. Values still unknown at the end are replicated.

Each op's rule (level, forward, backward) is part of its record (``opdef.OpDef.propagation``),
defined with the op in ``spmd_runtime/ops/``; this module is the engine and the helpers rules share.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from ..mesh import Mesh
from ..opdef import BROADCAST_LEVEL, DOT_LEVEL, ELEMENTWISE_LEVEL, OPS
from ..sharding import Sharding


@dataclass
class Propagation:
    shardings: dict[int, Sharding]
    origin: dict[int, str]  # "user", "propagated" or "default" (nothing known: replicated)


def propagate(graph: Graph, mesh: Mesh, fixed: dict[int, Sharding], seeds=None) -> Propagation:
    """Complete shardings for every node; ``fixed`` holds the user's annotations, ``seeds`` starting
    shardings that propagation may refine (a loop body's parameters, from outside the loop)."""
    rules = {n.op: OPS[n.op].propagation for n in graph.nodes if n.op in OPS}
    missing = sorted({n.op for n in graph.nodes if rules.get(n.op) is None})
    if missing:
        raise NotImplementedError(f"sharding propagation needs a rule for every op; got no rule for {missing}")
    seeds = seeds or {}
    sh: dict[int, Sharding | None] = {n.id: fixed.get(n.id, seeds.get(n.id)) for n in graph.nodes}
    for level in (ELEMENTWISE_LEVEL, BROADCAST_LEVEL, DOT_LEVEL):
        while _sweep(graph, mesh, sh, fixed, level, rules):
            pass
    origin = {n.id: "user" if n.id in fixed else "propagated" if sh[n.id] else "default" for n in graph.nodes}
    done = {n.id: sh[n.id] or Sharding.replicated(len(n.shape)) for n in graph.nodes}
    return Propagation(done, origin)


def _sweep(graph, mesh, sh, fixed, level, rules) -> bool:
    changed = False
    for node in graph.nodes:
        r = rules[node.op]
        if r.level <= level and node.inputs:
            cand = r.forward(node, [sh[i] for i in node.inputs], graph, mesh)
            changed |= _update(node.id, cand, graph, mesh, sh, fixed)
    for node in reversed(graph.nodes):
        r = rules[node.op]
        if r.level <= level and node.inputs and sh[node.id] is not None:
            cands = r.backward(node, sh[node.id], [sh[i] for i in node.inputs], graph, mesh)
            for i, cand in zip(node.inputs, cands):
                changed |= _update(i, cand, graph, mesh, sh, fixed)
    return changed


def _update(vid, cand, graph, mesh, sh, fixed) -> bool:
    if cand is None or vid in fixed:
        return False
    if hasattr(cand, "refine"):  # the results of a control node (partition/loops.py) refine part by part
        new = cand.refine(sh[vid], graph.nodes[vid], mesh)
    else:
        cand = legalize(cand, graph.nodes[vid].shape, mesh)
        new = cand if sh[vid] is None else merge(sh[vid], cand)
    if new == sh[vid] or (sh[vid] is None and not new.axes):
        return False
    sh[vid] = new
    return True


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
    known = sorted((s for s in shardings if s is not None), key=lambda s: -len(s.axes))
    if not known:
        return None
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
