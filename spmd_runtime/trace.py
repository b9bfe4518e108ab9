"""Tracing: run a Python function on symbolic tensors and record a Graph."""
from __future__ import annotations

import inspect
import os
import sys
import threading

import numpy as np

from . import pytree
from .graph import MESH_SPLIT, PARAMETER, Graph, TensorSpec
from .mesh import Mesh, get_mesh
from .sharding import parse_spec_free

trace_state = threading.local()  # per thread: ``graph``, the trace being recorded (bodies.tracing switches it)


def current_graph() -> Graph:
    g = getattr(trace_state, "graph", None)
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
        raise TypeError(f"a traced Tensor has no truth value: Python control flow cannot depend on traced data; "
                        f"use snp.where (or sr.cond / sr.while_loop){self._static_hint()}; got {self!r}")

    def __index__(self):  # range(t), a shape entry, a Python index: the value is needed now
        self._no_value("a Python int (range, a shape, an index)")

    def _static_hint(self) -> str:
        """For a jit whose Python number arguments are traced: which ones, and the static_argnums to pass."""
        args = getattr(self.graph, "scalar_args", None)
        if not args:
            return ""
        named = ", ".join(f"{name!r} (position {position}, a Python {kind})" for position, name, kind in
                          args.values())
        positions = tuple(sorted(position for position, _, _ in args.values()))
        static = positions[0] if len(positions) == 1 else positions
        return (f". Python number arguments of jit are traced as 0-d arrays: {named}; a value Python code needs "
                f"(if, range, a shape) must be static: sr.jit(fn, static_argnums={static})")

    # Operators (+, @, [], .sum, ...) are bound by spmd_runtime.ops, which defines the op functions.
    def _no_value(self, what: str):
        raise TypeError(f"{what} needs values, and a traced Tensor has none: values are not known while tracing; "
                        f"compute with spmd_runtime.numpy (import spmd_runtime.numpy as snp: use snp.exp, snp.sum, "
                        f"...) and read values from sr.run's outputs{self._static_hint()}; got {self!r}")

    def __array__(self, *args, **kwargs):  # np.exp(t), np.asarray(t): NumPy would need the values
        self._no_value("a NumPy function (np.exp, np.asarray, ...)")

    def __array_function__(self, func, types, args, kwargs):  # np.sum(t) would call t.sum(out=None): say why
        snp = sys.modules["spmd_runtime.numpy"]  # loaded by the package; importing it here would be a cycle
        name = func.__name__
        if name in ("shape", "ndim", "size") and len(args) == 1 and not kwargs:  # known while tracing
            return getattr(self, name)
        instead = f"snp.{name}" if hasattr(snp, name) else "spmd_runtime.numpy"
        raise TypeError(f"np.{name} needs values, and a traced Tensor has none: values are not known while tracing; "
                        f"use {instead} (import spmd_runtime.numpy as snp) and read values from sr.run's outputs; "
                        f"got {self!r}")

    __float__ = lambda self: self._no_value("float()")
    __int__ = lambda self: self._no_value("int()")
    __complex__ = lambda self: self._no_value("complex()")


def emit(op, inputs, attrs, shape, dtype) -> Tensor:
    """Record one node of ``op`` (an ``opdef.OpDef`` record, or its name) in the active trace, with the user's
    line that made it (``Node.source``)."""
    g = current_graph()
    ids = [t.id if t.graph is g else g.capture(t) for t in inputs]  # a loop body lifts enclosing values
    source = getattr(trace_state, "source", None)
    return Tensor(g, g.add(getattr(op, "name", op), ids, attrs, shape, dtype, source or user_line()).id)


def set_source(source):
    """Nodes emitted from now on record ``source`` (None: the user's line, found by ``user_line``); returns the
    previous setting. The VJP of a node emits its cotangent ops at the node's own line (JAX's transposed
    source_info), with no walk up the stack."""
    previous, trace_state.source = getattr(trace_state, "source", None), source
    return previous


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODELS = os.path.join(_PACKAGE, "models") + os.sep  # the bundled example models count as the user's code
_INSIDE: dict = {}  # file name -> whether it is the package's (a str caches its hash; a code object does not)


def user_line() -> tuple | None:
    """(file, line) of the innermost frame outside the spmd_runtime package (JAX's source_info): the user's
    line being traced; the bundled models (spmd_runtime/models) count as the user's. A walk up the stack from
    emit's caller (each file name checked once)."""
    f = sys._getframe(2)
    inside = _INSIDE.get
    while f is not None:
        name = f.f_code.co_filename
        known = inside(name)
        if known is None:
            known = _INSIDE[name] = name.startswith(_PACKAGE) and not name.startswith(_MODELS)
        if not known:
            return name, f.f_lineno
        f = f.f_back
    return None


def user_line_of(error: BaseException) -> tuple | None:
    """(file, line) of the innermost traceback entry of ``error`` in the user's code (as ``user_line``)."""
    found, tb = None, error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(_PACKAGE) or name.startswith(_MODELS):
            found = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return found


def trace(fn, *arg_specs) -> Graph:
    """Trace ``fn`` on symbolic arguments; returns the Graph.

    Each argument is a pytree (dicts, lists, tuples, namedtuples, dataclasses,
    see ``spmd_runtime.pytree``) whose leaves are ``TensorSpec(shape, dtype)``s
    or example arrays; ``fn`` receives the same trees of traced Tensors and
    returns a pytree of tensors. Graph parameters are the leaves in order, named
    after ``fn``'s parameters and the leaf paths (``params.w1``); ``graph.in_tree``
    / ``graph.out_tree`` keep the structures.
    """
    flat, in_tree = pytree.flatten(tuple(arg_specs), is_leaf=_is_spec_leaf)
    names = _leaf_param_names(fn, arg_specs)
    specs = [_leaf_spec(x, name) for x, name in zip(flat, names)]
    g = Graph()
    prev, trace_state.graph = getattr(trace_state, "graph", None), g
    try:
        leaves = []
        for i, (name, spec) in enumerate(zip(names, specs)):
            leaves.append(emit(PARAMETER, [], {"index": i, "name": name}, spec.shape, spec.dtype))
            g.params.append(leaves[-1].id)
            g.param_names.append(name)
        result = fn(*in_tree.unflatten(leaves))
    finally:
        trace_state.graph = prev
    outs, g.out_tree = pytree.flatten(result)
    g.in_tree = in_tree
    for path, o in pytree.flatten_with_path(result)[0]:
        if not isinstance(o, Tensor) or o.graph is not g:
            raise TypeError(f"a traced function returns tensors computed from its arguments; got output "
                            f"{pytree.keystr(path, 'result')} of type {type(o).__name__}")
    g.outputs.extend(o.id for o in outs)
    return g


def _is_spec_leaf(x) -> bool:
    return isinstance(x, TensorSpec) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _leaf_spec(x, name: str) -> TensorSpec:
    try:
        return TensorSpec.of(x)
    except TypeError:
        raise TypeError(f"a traced argument's leaves are TensorSpecs or arrays; got {type(x).__name__} for "
                        f"{name!r} (pass Python values through sr.jit's static_argnums)") from None


def _leaf_param_names(fn, args) -> list[str]:
    """``x`` for a plain array argument, ``params.w1`` for leaf ``['w1']`` of argument ``params``."""
    names = _param_names(fn, len(args))
    out = []
    for name, arg in zip(names, args):
        paths = [p for p, _ in pytree.flatten_with_path(arg, is_leaf=_is_spec_leaf)[0]]
        out += [name] if paths == [()] else [pytree.keystr(p, name) for p in paths]
    return out


def _param_names(fn, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"arg{i}" for i in range(len(names), n)]


def mesh_split(x: Tensor, *mesh_and_spec, name: str | None = None, grad_spec=None) -> Tensor:
    """Annotate ``x`` with how it is split over a mesh (GSPMD's ``mesh_split``).

    ``mesh_split(x, spec)`` uses the context mesh (``with mesh:`` / ``sr.set_mesh``);
    ``mesh_split(x, mesh, spec)`` names one. ``spec`` is a ``P`` or one entry per dim
    of x: None or -1 (replicated), a mesh axis name, a tuple of names (split over
    several axes, major first), an int mesh dim, or ``UNCONSTRAINED`` (left to
    propagation). ``name`` labels the value in listings, reports, notes and
    errors. ``grad_spec``: the annotation of the cotangent in the backward pass
    (default: ``spec``), e.g. FSDP's weight gathered for use whose gradient is
    wanted sharded, so its pending sum becomes a reduce-scatter, not an
    all-reduce. Returns the annotated tensor; propagation completes the rest.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"mesh_split annotates a traced tensor; got {type(x).__name__}")
    if len(mesh_and_spec) == 2 and isinstance(mesh_and_spec[0], Mesh):
        mesh, spec = mesh_and_spec
    elif len(mesh_and_spec) == 1:
        mesh, spec = get_mesh(required_by="mesh_split(x, spec)"), mesh_and_spec[0]
    else:
        raise TypeError(f"mesh_split is called as mesh_split(x, spec) under a context mesh or mesh_split(x, mesh, "
                        f"spec); got {len(mesh_and_spec)} arguments after x")
    what = f"tensor %{x.id}" + (f" {name!r}" if name else "") + f" {x.node.spec}"
    sharding, free = parse_spec_free(spec, mesh, x.ndim, what=what)
    sharding.check(mesh, x.shape, what=what)
    attrs = {"sharding": sharding, "mesh": mesh}
    if free:
        attrs["unconstrained"] = free
    if name is not None:
        attrs["name"] = str(name)
    if grad_spec is not None:
        attrs["grad_sharding"] = parse_spec_free(grad_spec, mesh, x.ndim, what=f"grad_spec of {what}")[0]
    return emit(MESH_SPLIT, [x], attrs, x.shape, x.dtype)
