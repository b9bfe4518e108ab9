"""Reverse-mode automatic differentiation of traced functions, the JAX way.

``grad(fn)`` / ``value_and_grad(fn)`` return functions that, called inside a
trace on traced Tensors, emit the forward computation and then the backward
one into the SAME graph: ``trace(value_and_grad(loss), *specs)`` is one graph
whose outputs are ``(loss, grads)``, which partitions like any other.

The backward pass walks the nodes recorded while ``fn`` ran in reverse order,
accumulating cotangents with each op's VJP rule (the table
``autodiff/rules/table.py: VJP``, keyed by the op's record, one family file per ``ops/`` family). Rules emit ordinary traced ops; a ``mesh_split`` in the
forward pass puts a ``mesh_split`` with the same sharding on the cotangent, so
gradient shardings follow their primal values through propagation.

A rule is ``fn(node, cotangent, operands, result) -> list`` with one entry per
operand: a cotangent Tensor, None (no gradient), or a zero-argument callable
producing one, evaluated only if that operand needs a gradient (so no dead
backward code is emitted, e.g. the input gradient of ``x @ w`` when only ``w``
is differentiated).

Values the differentiated function closes over (including the differentiated
arguments themselves, if also captured by closure) are the same graph values as
the arguments; like every traced value created before ``fn`` runs, a closed-over
value that is not an argument is a constant of the differentiation.
"""
from __future__ import annotations

import inspect

import numpy as np

from .. import pytree
from ..dtypes import is_floating
from ..graph import Node
from ..opdef import OPS
from .rules.table import VJP
from ..ops.core import CONVERT, asarray, ones, zeros
from ..bodies import BodyGraph, capture
from ..trace import Tensor, current_graph, emit, set_source


# ---------------------------------------------------------------- public API
def value_and_grad(fn, argnums=0, has_aux=False):
    """``f(*args) -> (value, grads)`` (``((value, aux), grads)`` with ``has_aux``), for use inside a trace.

    ``fn`` returns a floating scalar (shape ()) tensor; ``grads`` has one entry
    per ``argnums`` (a single gradient when ``argnums`` is an int), each with
    its argument's shape and dtype.
    """
    nums = _argnums(argnums)

    def value_and_grad_fn(*args):
        args, wrt, trees = _prepare_tree_args(args, nums)
        start = len(current_graph().nodes)
        out, aux = _split_aux(fn(*args), has_aux)
        _check_output(out)
        flat, grads = backward(out, wrt, start), []
        for tree in trees:  # each differentiated argument's gradient has its pytree structure
            grads.append(tree.unflatten(flat[:tree.num_leaves]))
            flat = flat[tree.num_leaves:]
        grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        return ((out, aux) if has_aux else out), grads
    value_and_grad_fn.__name__ = f"value_and_grad_{getattr(fn, '__name__', 'fn')}"
    _copy_signature(value_and_grad_fn, fn)
    return value_and_grad_fn


def grad(fn, argnums=0, has_aux=False):
    """``f(*args) -> grads`` (``(grads, aux)`` with ``has_aux``); see ``value_and_grad``."""
    vg = value_and_grad(fn, argnums, has_aux)

    def grad_fn(*args):
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads
    grad_fn.__name__ = f"grad_{getattr(fn, '__name__', 'fn')}"
    _copy_signature(grad_fn, fn)
    return grad_fn


def backward(out: Tensor, wrt: list[Tensor], start: int) -> list[Tensor]:
    """Emit the gradients of scalar ``out`` with respect to ``wrt``, walking nodes ``start..out`` in reverse."""
    return backward_from({out.id: ones((), out.dtype)}, wrt, start)


def backward_from(seeds: dict, wrt: list[Tensor], start: int) -> list[Tensor]:
    """Emit the cotangents of ``wrt`` given cotangents ``seeds`` (node id -> Tensor) of later values, walking
    nodes ``start..max(seeds)`` in reverse (a VJP; ``backward`` seeds a scalar output with 1)."""
    g = current_graph()
    stop = max(seeds, default=start - 1)
    active = _active_nodes(g, {t.id for t in wrt}, start, stop)
    cts = dict(seeds)
    for node in reversed(g.nodes[start:stop + 1]):
        if node.id not in cts or node.id not in active:
            continue
        rule = VJP.get(node.op) if node.op in OPS else None
        if rule is None:
            raise NotImplementedError(f"reverse-mode differentiation needs a VJP rule for every op on the path "
                                      f"to the output; got none for op {node.op!r} (%{node.id} {node.spec})")
        operands = [Tensor(g, i) for i in node.inputs]
        for x in operands:
            if x.id in active:
                _refuse_complex(x, node)
        previous = set_source(node.source)  # the cotangent's ops are at the user's line of the node
        try:
            results = rule(node, cts.pop(node.id), operands, Tensor(g, node.id))
            for x, ct in zip(operands, results):
                if ct is not None and x.id in active:
                    _accumulate(cts, x, ct() if callable(ct) else ct, node)
        finally:
            set_source(previous)
    return [cts.get(t.id) if t.id in cts else zeros(t.shape, t.dtype) for t in wrt]


# ---------------------------------------------------------------- driver helpers
def _argnums(argnums) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(i, int) and i >= 0 for i in nums) or len(set(nums)) != len(nums):
        raise ValueError(f"argnums must be a non-negative int or a non-empty tuple of distinct ones; "
                         f"got {argnums!r}")
    return nums


def _prepare_tree_args(args, nums):
    """(args with the differentiated pytrees' leaves prepared, those leaves in order, their structures)."""
    if max(nums) >= len(args):
        raise ValueError(f"argnums {nums} refers past the {len(args)} positional arguments")
    args, trees, leaves = list(args), [], []
    for i in nums:
        flat, tree = pytree.flatten(args[i])
        trees.append(tree)
        leaves += flat
    leaves = _prepare_args(leaves, range(len(leaves))) if leaves else leaves
    at = 0
    for i, tree in zip(nums, trees):
        args[i] = tree.unflatten(leaves[at:at + tree.num_leaves])
        at += tree.num_leaves
    return args, leaves, trees


def _prepare_args(args, nums) -> list:
    """Differentiated args as traced floating tensors; an arg passed twice gets a fresh copy per position."""
    if max(nums) >= len(args):
        raise ValueError(f"argnums {nums} refers past the {len(args)} positional arguments")
    args, seen = list(args), set()
    for i in nums:
        x = args[i] if isinstance(args[i], Tensor) else asarray(args[i])
        if x.graph is not current_graph() and isinstance(current_graph(), BodyGraph):
            x = capture(x)  # a value of the function enclosing this loop body
        if x.graph is not current_graph():
            raise ValueError(f"grad differentiates tensors of the current trace; got argument {i} from another one")
        if not is_floating(x.dtype):
            raise TypeError(f"grad requires floating-point inputs; got argument {i} of dtype {x.dtype.name}")
        if x.id in seen:  # f(x, x): each position is its own variable, as in JAX
            x = emit(CONVERT, [x], {"dtype": x.dtype.name}, x.shape, x.dtype)
        seen.add(x.id)
        args[i] = x
    return args


def _split_aux(result, has_aux):
    if not has_aux:
        return result, None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"has_aux=True requires the function to return a pair (output, aux); "
                        f"got {type(result).__name__}")
    return result[0], result[1]


def _check_output(out):
    if not isinstance(out, Tensor) or out.graph is not current_graph():
        raise TypeError(f"grad requires the function to return a traced scalar Tensor; got {type(out).__name__}")
    if out.shape != ():
        raise TypeError(f"grad requires a scalar (shape ()) output; got output of shape {out.shape}")
    if not is_floating(out.dtype):
        raise TypeError(f"grad requires a floating-point output; got dtype {out.dtype.name}")


def _active_nodes(g, wrt: set[int], start: int, stop: int) -> set[int]:
    """Floating (and complex) nodes in ``start..stop`` that depend on ``wrt``, plus ``wrt``: the ones that carry
    gradients."""
    active = set(wrt)
    for node in g.nodes[start:stop + 1]:
        if any(i in active for i in node.inputs) and (is_floating(node.dtype) or _is_complex(node.dtype)):
            active.add(node.id)  # complex ones too: backward_from refuses them if a gradient reaches them
    return active


def _is_complex(dt) -> bool:
    return np.dtype(dt).kind == "c"


def _refuse_complex(x: Tensor, node: Node) -> None:
    """A gradient reaching a complex value: the rules carry real cotangents only, so it would be lost (zeros)."""
    if _is_complex(x.dtype):
        raise NotImplementedError(f"reverse-mode differentiation through complex values is not supported; got the "
                                  f"gradient of op {node.op!r} (%{node.id}) flowing into the complex %{x.id} "
                                  f"{x.dtype.name}{list(x.shape)} (make the path from the differentiated inputs to "
                                  f"the output real)")


def _accumulate(cts: dict, x: Tensor, ct: Tensor, node: Node):
    if ct.shape != x.shape or ct.dtype != x.dtype:
        raise ValueError(f"the VJP rule of op {node.op!r} must return cotangents shaped like its operands; "
                         f"got {ct.dtype.name}{list(ct.shape)} for operand %{x.id} "
                         f"{x.dtype.name}{list(x.shape)} at %{node.id}")
    cts[x.id] = cts[x.id] + ct if x.id in cts else ct


def _copy_signature(wrapper, fn):
    """Keep ``fn``'s parameter names, so traced graphs name their inputs after them."""
    try:
        wrapper.__signature__ = inspect.signature(fn)
    except (TypeError, ValueError):
        pass
