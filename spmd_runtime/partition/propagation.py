"""Sharding propagation (GSPMD section 3.5): complete every value's sharding.

Forward (operands -> result) and backward (result -> operands) passes repeat to
a fixed point, level by level: elementwise-like ops first, then broadcast and
reduce, then contractions. A value's sharding only ever becomes strictly more
specific (``merge``), which guarantees termination, and user annotations are
never overridden. Values still unknown at the end are replicated.

Rules live in ``RULES``: op -> (level, forward, backward), one small function
pair per op family, registered with ``@rule``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..graph import ELEMENTWISE_OPS, Graph, Node
from ..mesh import Mesh
from ..sharding import Sharding
from .reshape_map import map_reshape_sharding

ELEMENTWISE_LEVEL, BROADCAST_LEVEL, DOT_LEVEL = 0, 1, 2


@dataclass(frozen=True)
class Rule:
    level: int
    forward: Callable  # (node, operand shardings (None = unknown), graph, mesh) -> Sharding | None
    backward: Callable  # (node, result sharding, operand shardings, graph, mesh) -> [Sharding | None]


RULES: dict[str, Rule] = {}


def rule(*ops, level):
    def register(pair):
        forward, backward = pair()
        for op in ops:
            RULES[op] = Rule(level, forward, backward)
        return pair
    return register


@dataclass
class Propagation:
    shardings: dict[int, Sharding]
    origin: dict[int, str]  # "user", "propagated" or "default" (nothing known: replicated)


def propagate(graph: Graph, mesh: Mesh, fixed: dict[int, Sharding]) -> Propagation:
    """Complete shardings for every node; ``fixed`` holds the user's annotations."""
    missing = sorted({n.op for n in graph.nodes if n.op not in RULES})
    if missing:
        raise NotImplementedError(f"sharding propagation needs a rule for every op; got no rule for {missing}")
    sh: dict[int, Sharding | None] = {n.id: fixed.get(n.id) for n in graph.nodes}
    for level in (ELEMENTWISE_LEVEL, BROADCAST_LEVEL, DOT_LEVEL):
        while _sweep(graph, mesh, sh, fixed, level):
            pass
    origin = {n.id: "user" if n.id in fixed else "propagated" if sh[n.id] else "default" for n in graph.nodes}
    done = {n.id: sh[n.id] or Sharding.replicated(len(n.shape)) for n in graph.nodes}
    return Propagation(done, origin)


def _sweep(graph, mesh, sh, fixed, level) -> bool:
    changed = False
    for node in graph.nodes:
        r = RULES[node.op]
        if r.level <= level and node.inputs:
            cand = r.forward(node, [sh[i] for i in node.inputs], graph, mesh)
            changed |= _update(node.id, cand, graph, mesh, sh, fixed)
    for node in reversed(graph.nodes):
        r = RULES[node.op]
        if r.level <= level and node.inputs and sh[node.id] is not None:
            cands = r.backward(node, sh[node.id], [sh[i] for i in node.inputs], graph, mesh)
            for i, cand in zip(node.inputs, cands):
                changed |= _update(i, cand, graph, mesh, sh, fixed)
    return changed


def _update(vid, cand, graph, mesh, sh, fixed) -> bool:
    if cand is None or vid in fixed:
        return False
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


# ---------------------------------------------------------------- rules
@rule(*ELEMENTWISE_OPS, level=ELEMENTWISE_LEVEL)
def _elementwise():
    fwd = lambda node, ins, g, mesh: combine(ins)
    bwd = lambda node, out, ins, g, mesh: [out] * len(ins)
    return fwd, bwd


@rule("mesh_split", level=ELEMENTWISE_LEVEL)
def _mesh_split():
    fwd = lambda node, ins, g, mesh: node.attrs["sharding"]
    bwd = lambda node, out, ins, g, mesh: [node.attrs["sharding"]]
    return fwd, bwd


@rule("parameter", "constant", level=ELEMENTWISE_LEVEL)
def _leaf():
    return (lambda *a: None), (lambda *a: [])


@rule("transpose", level=ELEMENTWISE_LEVEL)
def _transpose():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else Sharding(tuple(ins[0].dims[p] for p in node.attrs["perm"]))

    def bwd(node, out, ins, g, mesh):
        dims = [()] * len(out.dims)
        for i, p in enumerate(node.attrs["perm"]):
            dims[p] = out.dims[i]
        return [Sharding(tuple(dims))]
    return fwd, bwd


@rule("reshape", level=ELEMENTWISE_LEVEL)
def _reshape():
    def fwd(node, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return None if ins[0] is None else map_reshape_sharding(ins[0], src, node.shape, mesh, exact=False)

    def bwd(node, out, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return [map_reshape_sharding(out, node.shape, src, mesh, exact=False)]
    return fwd, bwd


@rule("broadcast_in_dim", level=BROADCAST_LEVEL)
def _broadcast():
    def fwd(node, ins, g, mesh):
        if ins[0] is None:
            return None
        src, dims = g.nodes[node.inputs[0]].shape, node.attrs["dims"]
        out = [()] * len(node.shape)
        for i, d in enumerate(dims):
            out[d] = ins[0].dims[i] if src[i] == node.shape[d] else ()
        return Sharding(tuple(out))

    def bwd(node, out, ins, g, mesh):
        src, dims = g.nodes[node.inputs[0]].shape, node.attrs["dims"]
        return [Sharding(tuple(out.dims[d] if src[i] == node.shape[d] else () for i, d in enumerate(dims)))]
    return fwd, bwd


@rule("reduce", level=BROADCAST_LEVEL)
def _reduce():
    def fwd(node, ins, g, mesh):
        axes = node.attrs["axes"]
        return None if ins[0] is None else Sharding(tuple(d for i, d in enumerate(ins[0].dims) if i not in axes))

    def bwd(node, out, ins, g, mesh):
        kept = iter(out.dims)
        return [Sharding(tuple(() if i in node.attrs["axes"] else next(kept)
                               for i in range(len(g.nodes[node.inputs[0]].shape))))]
    return fwd, bwd


def einsum_terms(node: Node) -> tuple[str, str, str]:
    ins, out = node.attrs["spec"].split("->")
    lhs, rhs = ins.split(",")
    return lhs, rhs, out


@rule("einsum", level=DOT_LEVEL)
def _einsum():
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


def dedupe_axes(dims) -> Sharding:
    """Dims as a Sharding where a dim reusing a mesh axis of an earlier dim is left unsplit."""
    used, out = set(), []
    for d in dims:
        keep = tuple(a for a in d if a not in used)
        keep = d if keep == d else ()
        used.update(keep)
        out.append(keep)
    return Sharding(tuple(out))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
