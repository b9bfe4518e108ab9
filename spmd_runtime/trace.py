"""Tracing: run a Python function on symbolic tensors and record a Graph."""
from __future__ import annotations

import inspect
import threading

import numpy as np

from .graph import Graph, TensorSpec
from .sharding import parse_spec

_state = threading.local()


def current_graph() -> Graph:
    g = getattr(_state, "graph", None)
    if g is None:
        raise RuntimeError("traced operations need an active trace: call them inside a function passed to "
                           "sr.trace(fn, *arg_specs); got no active trace")
    return g


class Tensor:
    """A symbolic value of the graph being traced. Supports NumPy-style operators."""
    __array_priority__ = 1000  # numpy scalars and arrays defer to our operators

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id

    @property
    def node(self):
        return self.graph.nodes[self.id]

    shape = property(lambda self: self.node.shape)
    dtype = property(lambda self: np.dtype(self.node.dtype))
    ndim = property(lambda self: len(self.node.shape))
    size = property(lambda self: int(np.prod(self.node.shape)))

    def __repr__(self):
        return f"Tensor(%{self.id}: {self.node.spec})"

    def __len__(self):
        return self.shape[0]

    def __bool__(self):
        raise TypeError("a traced Tensor has no truth value: Python control flow cannot depend on traced data; "
                        "use snp.where")

    # Operators (+, @, [], .sum, ...) are bound by spmd_runtime.ops, which defines the op functions.
    def _no_value(self, what: str):
        raise TypeError(f"{what} needs values, and a traced Tensor has none: values are not known while tracing; "
                        f"compute with spmd_runtime.numpy (import spmd_runtime.numpy as snp: use snp.exp, snp.sum, "
                        f"...) and read values from sr.run's outputs; got {self!r}")

    def __array__(self, *args, **kwargs):  # np.exp(t), np.asarray(t): NumPy would need the values
        self._no_value("a NumPy function (np.exp, np.asarray, ...)")

    __float__ = lambda self: self._no_value("float()")
    __int__ = lambda self: self._no_value("int()")
    __complex__ = lambda self: self._no_value("complex()")


def emit(op, inputs, attrs, shape, dtype) -> Tensor:
    """Record one node of ``op`` (an ``opdef.OpDef`` record, or its name) in the active trace."""
    g = current_graph()
    ids = [t.id if t.graph is g else g.capture(t) for t in inputs]  # a loop body lifts enclosing values
    return Tensor(g, g.add(getattr(op, "name", op), ids, attrs, shape, dtype).id)


def trace(fn, *arg_specs) -> Graph:
    """Trace ``fn`` on symbolic arguments; returns the Graph.

    Each arg spec is a ``TensorSpec(shape, dtype)`` or an example array. ``fn``
    returns one tensor or a tuple/list of tensors.
    """
    specs = [TensorSpec.of(s) for s in arg_specs]
    names = _param_names(fn, len(specs))
    g = Graph()
    prev, _state.graph = getattr(_state, "graph", None), g
    try:
        args = []
        for i, (name, spec) in enumerate(zip(names, specs)):
            args.append(emit("parameter", [], {"index": i, "name": name}, spec.shape, spec.dtype))
            g.params.append(args[-1].id)
            g.param_names.append(name)
        result = fn(*args)
    finally:
        _state.graph = prev
    outs = _flatten(result)
    for i, o in enumerate(outs):
        if not isinstance(o, Tensor) or o.graph is not g:
            raise TypeError(f"a traced function returns tensors computed from its arguments; got output {i} "
                            f"of type {type(o).__name__}")
        g.outputs.append(o.id)
    return g


def _flatten(result) -> list:
    """Outputs in order, nested tuples/lists flattened (e.g. value_and_grad's (loss, (g0, g1)))."""
    if isinstance(result, (tuple, list)):
        return [leaf for item in result for leaf in _flatten(item)]
    return [result]


def _param_names(fn, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"arg{i}" for i in range(len(names), n)]


def mesh_split(x: Tensor, mesh, spec) -> Tensor:
    """Annotate ``x`` with how it is split over ``mesh`` (GSPMD's ``mesh_split``).

    ``spec`` has one entry per dim of x: None or -1 (replicated), a mesh axis
    name, a tuple of names (split over several axes, major first), or an int
    mesh dim. Returns the annotated tensor; propagation completes the rest.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"mesh_split annotates a traced tensor; got {type(x).__name__}")
    sharding = parse_spec(spec, mesh, x.ndim, what=f"tensor %{x.id} {x.node.spec}")
    sharding.check(mesh, x.shape, what=f"tensor %{x.id} {x.node.spec}")
    return emit("mesh_split", [x], {"sharding": sharding, "mesh": mesh}, x.shape, x.dtype)  # ops.core.MESH_SPLIT
