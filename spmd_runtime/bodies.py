"""Body graphs: what a control op (scan, while, cond; ``ops/control.py``) holds.

A body is traced ONCE into a ``BodyGraph``: a Graph whose values closed over from the enclosing
trace become extra parameters (XLA's implicit loop-invariant operands; ``trace.emit`` lifts them).
``inline`` re-emits a body into the current trace, ``extract`` cuts a new body out of a graph (the
forward and backward halves of a differentiated scan). Carries, xs and operands are pytrees of
tensors (tuples, lists, dicts, None) flattened by the small ``pytree_flatten`` here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from .graph import Graph, TensorSpec
from .ops.core import PARAMETER, asarray
from .trace import Tensor, current_graph, emit, trace_state

TUPLE_SHAPE, TUPLE_DTYPE = (), "float32"  # the placeholder spec of a control node (floating: gradients flow)

# ---------------------------------------------------------------- body graphs
@dataclass(eq=False)
class BodyGraph(Graph):
    """A traced body. ``captured`` lists the enclosing graph's node ids that became parameters (in order,
    after the explicit ones); ``parent`` is None for a body that may not capture."""
    parent: Graph | None = None
    captured: list = field(default_factory=list)
    param_of: dict = field(default_factory=dict, repr=False)  # captured parent id -> own parameter id

    def add_param(self, spec: TensorSpec, name: str) -> Tensor:
        node = self.add(PARAMETER.name, [], {"index": len(self.params), "name": name}, spec.shape, spec.dtype)
        self.params.append(node.id)
        self.param_names.append(name)
        return Tensor(self, node.id)

    def capture(self, t: Tensor) -> int:
        """The id of this body's parameter standing for the enclosing trace's value ``t``."""
        if self.parent is None:
            raise ValueError(f"this body takes its inputs explicitly; got tensor %{t.id} {t.node.spec} of "
                             f"another trace")
        if t.graph is not self.parent:  # from further out: capture into the parent first
            t = Tensor(self.parent, self.parent.capture(t))
        if t.id not in self.param_of:
            self.param_of[t.id] = self.add_param(t.node.spec, f"captured{len(self.captured)}").id
            self.captured.append(t.id)
        return self.param_of[t.id]


def capture(t: Tensor) -> Tensor:
    """``t`` as a value of the current trace (a body parameter when ``t`` comes from an enclosing one)."""
    g = current_graph()
    return t if t.graph is g else Tensor(g, g.capture(t))


@contextlib.contextmanager
def tracing(g: Graph):
    prev, trace_state.graph = getattr(trace_state, "graph", None), g
    try:
        yield g
    finally:
        trace_state.graph = prev


def trace_body(fn, specs, names, what: str):
    """Trace ``fn(*params)`` into a BodyGraph of the current trace; returns (graph, output pytree def)."""
    g = BodyGraph(parent=current_graph())
    with tracing(g):
        params = [g.add_param(s, n) for s, n in zip(specs, names)]
        leaves, treedef = pytree_flatten(fn(*params))
        for k, leaf in enumerate(leaves):
            if not isinstance(leaf, (Tensor, int, float, bool, np.ndarray, np.generic)):
                raise TypeError(f"{what} returns tensors (in tuples, lists or dicts); got {type(leaf).__name__} "
                                f"at output leaf {k}")
        g.outputs = [capture(asarray(leaf)).id for leaf in leaves]
    return g, treedef


def inline(graph: Graph, args: list) -> list[Tensor]:
    """Re-emit ``graph``'s nodes into the current trace with its parameters bound to ``args``; its outputs."""
    env = dict(zip(graph.params, args))
    for node in graph.nodes:
        if node.id not in env:
            env[node.id] = emit(node.op, [env[i] for i in node.inputs], dict(node.attrs), node.shape, node.dtype)
    return [env[o] for o in graph.outputs]


def extract(graph: Graph, inputs: list[int], outputs: list[int], keep_inputs=False) -> tuple[BodyGraph, list[int]]:
    """A new body computing ``outputs`` of ``graph`` from ``inputs`` (its parameters, cut there); returns it
    and the positions of the inputs it actually uses (the others are left out unless ``keep_inputs``)."""
    need, stack, cut = set(), list(outputs), set(inputs)
    while stack:
        v = stack.pop()
        if v not in need:
            need.add(v)
            if v not in cut:
                stack += graph.nodes[v].inputs
    used = [k for k, v in enumerate(inputs) if v in need or keep_inputs]
    g = BodyGraph()
    env = {}
    for k in used:
        env[inputs[k]] = g.add_param(graph.nodes[inputs[k]].spec, f"in{k}").id
    for v in sorted(need - set(env)):
        node = graph.nodes[v]
        if node.op == PARAMETER.name:
            raise ValueError(f"extract needs every parameter the outputs read among its inputs; got %{v} missing")
        env[v] = g.add(node.op, [env[i] for i in node.inputs], dict(node.attrs), node.shape, node.dtype).id
    g.outputs = [env[o] for o in outputs]
    return g, used


# ---------------------------------------------------------------- pytrees (tuples, lists, dicts, None)
def pytree_flatten(tree):
    """(leaves, treedef): leaves in order (dicts by sorted key); treedef rebuilds the structure."""
    if tree is None:
        return [], None
    if isinstance(tree, (tuple, list)):
        parts = [pytree_flatten(t) for t in tree]
        return [x for p in parts for x in p[0]], (type(tree), tuple(p[1] for p in parts))
    if isinstance(tree, dict):
        keys = sorted(tree)
        parts = [pytree_flatten(tree[k]) for k in keys]
        return [x for p in parts for x in p[0]], (dict, tuple(zip(keys, (p[1] for p in parts))))
    return [tree], "leaf"


def pytree_unflatten(treedef, leaves):
    it = iter(leaves)
    out = _build(treedef, it)
    return out


def _build(treedef, it):
    if treedef is None:
        return None
    if treedef == "leaf":
        return next(it)
    kind, children = treedef
    if kind is dict:
        return {k: _build(c, it) for k, c in children}
    items = [_build(c, it) for c in children]
    return kind(items) if kind in (tuple, list) else kind(*items)


def leaves_as_tensors(tree):
    leaves, treedef = pytree_flatten(tree)
    return [asarray(x) for x in leaves], treedef
