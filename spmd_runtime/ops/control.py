"""Control flow as ops with a body: ``scan``, ``fori_loop``, ``while_loop``, ``cond`` and ``remat`` (with its
policies, and ``checkpoint_name``, the identity that names a value for one).

Each call traces its body ONCE into a ``BodyGraph`` (``spmd_runtime/bodies.py``) and emits ONE node
holding it. A control node has several results: the node itself is a 0-d placeholder (a "tuple") and
one ``loop_out`` node per result reads result ``index`` of it, like HLO's get-tuple-element.

Node attributes:
- ``scan``: ``body`` (params: carries, one slice of each xs, captured values; outputs: new carries,
  one slice of each ys), ``length``, ``reverse``, ``num_carry``, ``num_xs``, ``policy`` (what the
  backward pass saves, see ``autodiff/loops.py``) and ``results`` (TensorSpecs: final carries, stacked ys).
  Operands: carries, xs, captured values.
- ``while``: ``cond`` and ``body`` graphs (params: carries, then their own captured values),
  ``num_carry``, ``captures`` (how many each graph has), ``results``. Operands: carries, cond's
  captured values, body's captured values.
- ``cond``: ``branches`` (false, true), ``num_operands``, ``captures`` (per branch), ``results``.
  Operands: the scalar bool predicate, the operands, each branch's captured values.

This file defines the records, the traced functions and the reference kernels. The layers above own the
other parts, in their rule tables: propagation and partitioning in ``partition/rules/control.py`` (the
machinery: ``partition/loops.py``, carry shardings agreed around the loop, each body partitioned once as
its own SPMD program), the VJPs in ``autodiff/rules/control.py`` (the machinery: ``autodiff/loops.py``, a
reverse scan over saved residuals), the binders in ``exec/rules/control.py`` (the machinery:
``exec/loops.py``, bodies bound once per rank, run as loops).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import opdef
from ..reference import evaluate
from ..bodies import TUPLE_DTYPE, TUPLE_SHAPE, leaves_as_tensors, pytree_flatten, pytree_unflatten, trace_body
from ..graph import TensorSpec
from ..opdef import define
from ..trace import Tensor, current_graph, emit
from . import core

SCAN = define("scan")
WHILE = define("while")
COND = define("cond")
CHECKPOINT_NAME = define("checkpoint_name")  # its operand's value, named (attrs: name) for a remat policy


def _loop_owned(ins, operands) -> bool:
    """A scan's stacked result (``ys``) is an array the scan makes and fills (exec/loops.py). A carry its body
    writes in place is the loop's own copy of the initial value from the start (partition/loops.py); a scan's
    carry its body owns (donated) is, after one iteration or more, the body's buffer. Any other carry may be
    (or view) an operand: a body may hand one on as it is, a loop may run no iteration."""
    node = operands[0]
    if node.op not in (SCAN.name, WHILE.name):
        return False
    k, a = ins.attrs["index"], node.attrs
    if node.op == SCAN.name and k >= a["num_carry"]:
        return True
    body = a["body"]
    return k in body.written_inputs or (node.op == SCAN.name and k in body.donated and a["length"] >= 1)


LOOP_OUT = define("loop_out", fresh_if=_loop_owned)  # result ``index`` of a control node
POLICIES = ("cheap_recomputed", "everything_saveable", "nothing_saveable", "dots_saveable")
DEFAULT_POLICY = "cheap_recomputed"  # a scan's: save all but what is cheaper to recompute (autodiff/loops.py)


@dataclass(frozen=True)
class SaveOnlyTheseNames:
    """The remat policy that saves the values named by ``checkpoint_name`` with one of ``names`` and recomputes
    everything else (JAX's ``checkpoint_policies.save_only_these_names``): e.g. an MoE layer's all-to-all
    results, so that its recomputed forward sends nothing again."""
    names: tuple[str, ...]

    def __post_init__(self):
        if not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"save_only_these_names takes one or more non-empty names; got {self.names!r}")

    def __repr__(self):
        return f"save_only_these_names{self.names!r}"


class checkpoint_policies:  # noqa: N801  (JAX's namespace: sr.checkpoint_policies.save_only_these_names(...))
    """The remat policies by JAX's names (``jax.checkpoint_policies``): pass one as ``sr.remat(f, policy)`` or
    ``sr.scan(..., policy=...)``."""
    nothing_saveable, everything_saveable, dots_saveable = "nothing_saveable", "everything_saveable", "dots_saveable"

    @staticmethod
    def save_only_these_names(*names: str) -> SaveOnlyTheseNames:
        return save_only_these_names(*names)


def save_only_these_names(*names: str) -> SaveOnlyTheseNames:
    """The policy that saves the values ``checkpoint_name`` gave one of ``names`` and recomputes the rest."""
    return SaveOnlyTheseNames(tuple(names))


def checkpoint_name(x, name: str) -> Tensor:
    """``x``, named for a remat policy (JAX's ``ad_checkpoint.checkpoint_name``): under
    ``checkpoint_policies.save_only_these_names(name, ...)`` the backward pass reads it saved instead of
    recomputing it. No instruction of its own after partitioning."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint_name takes a non-empty string name; got {name!r}")
    x = core.asarray(x)
    return emit(CHECKPOINT_NAME, [x], {"name": name}, x.shape, x.dtype)


# ---------------------------------------------------------------- the control node
def _emit_control(op, inputs, attrs, results: list[TensorSpec]) -> list[Tensor]:
    node = emit(op, inputs, {**attrs, "results": tuple(results)}, TUPLE_SHAPE, TUPLE_DTYPE)
    return [emit(LOOP_OUT, [node], {"index": k}, s.shape, s.dtype) for k, s in enumerate(results)]


def _specs(leaves) -> list[TensorSpec]:
    return [TensorSpec(x.shape, x.dtype) for x in leaves]


def _check_same(what, got: list[TensorSpec], want: list[TensorSpec], got_def, want_def):
    if got_def != want_def or len(got) != len(want):
        raise TypeError(f"{what} must keep the carry's structure; got {_describe_def(got_def)} for "
                        f"{_describe_def(want_def)}")
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise TypeError(f"{what} must keep each carry's shape and dtype; got {g} for carry leaf {k}, "
                            f"which enters as {w}")


def _describe_def(treedef) -> str:
    if treedef is None or treedef == "leaf":
        return "None" if treedef is None else "a tensor"
    kind, children = treedef
    return f"{kind.__name__} of {len(children)}"


# ---------------------------------------------------------------- scan and fori_loop
def scan(f, init, xs=None, length=None, reverse=False, *, policy=None):
    """JAX's ``lax.scan``: ``f(carry, x) -> (carry, y)`` over the leading dim of ``xs``; returns
    ``(final carry, stacked ys)``. ``f`` is traced once; ``policy`` (or ``f = sr.remat(g, policy)``)
    says what the backward pass saves per iteration (default: every intermediate it needs)."""
    f, policy = _unwrap_remat(f, policy)
    carry, carry_def = leaves_as_tensors(init)
    x_leaves, x_def = leaves_as_tensors(xs)
    length = _scan_length(x_leaves, length)
    nc = len(carry)

    def flat_body(*params):
        out = f(pytree_unflatten(carry_def, params[:nc]), pytree_unflatten(x_def, params[nc:]))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"a scan body returns a pair (carry, y); got {type(out).__name__}")
        new_carry, new_def = leaves_as_tensors(out[0])
        _check_same("a scan body", _specs(new_carry), _specs(carry), new_def, carry_def)
        return (new_carry, out[1])

    specs = _specs(carry) + [TensorSpec(x.shape[1:], x.dtype) for x in x_leaves]
    names = [f"carry{k}" for k in range(nc)] + [f"x{k}" for k in range(len(x_leaves))]
    body, out_def = trace_body(flat_body, specs, names, "a scan body")
    y_def = out_def[1][1]
    y_specs = [TensorSpec((length,) + body.nodes[o].shape, body.nodes[o].dtype) for o in body.outputs[nc:]]
    inputs = carry + x_leaves + [Tensor(current_graph(), c) for c in body.captured]
    outs = _emit_control(SCAN, inputs, {"body": body, "length": length, "reverse": bool(reverse),
                                          "num_carry": nc, "num_xs": len(x_leaves),
                                          "policy": policy or DEFAULT_POLICY},
                         _specs(carry) + y_specs)
    return pytree_unflatten(carry_def, outs[:nc]), pytree_unflatten(y_def, outs[nc:])


def _scan_length(x_leaves, length) -> int:
    sizes = sorted({x.shape[0] if x.ndim else -1 for x in x_leaves})
    if -1 in sizes:
        raise ValueError(f"scan slices every xs leaf along its leading dim; got a 0-d leaf among shapes "
                         f"{[x.shape for x in x_leaves]}")
    if len(sizes) > 1 or (sizes and length is not None and int(length) != sizes[0]):
        raise ValueError(f"scan needs every xs leaf to have the same leading dim, equal to length if given; "
                         f"got leading dims {sizes} and length={length}")
    if not sizes and length is None:
        raise ValueError("scan needs xs or an explicit length; got neither")
    n = sizes[0] if sizes else int(length)
    if n < 0:
        raise ValueError(f"scan length must be >= 0; got {n}")
    return n


def fori_loop(lower, upper, body_fun, init_val):
    """``for i in range(lower, upper): val = body_fun(i, val)`` as one scan (static int bounds; ``i`` is a
    traced int32 scalar). For bounds known only at run time use ``while_loop``."""
    for name, v in (("lower", lower), ("upper", upper)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"fori_loop needs Python int bounds (a static trip count); got {name}={v!r}; "
                            f"use sr.while_loop for traced bounds")

    def step(carry, _):
        i, val = carry
        return (i + 1, body_fun(i, val)), None
    (_, out), _ = scan(step, (core.asarray(np.int32(lower)), init_val), length=max(int(upper) - int(lower), 0))
    return out


# ---------------------------------------------------------------- while_loop and cond
def while_loop(cond_fun, body_fun, init_val):
    """``while cond_fun(val): val = body_fun(val)``; ``cond_fun`` returns a traced scalar bool.
    Forward only (the trip count is known only at run time)."""
    carry, carry_def = leaves_as_tensors(init_val)
    specs, names = _specs(carry), [f"carry{k}" for k in range(len(carry))]
    cond_g, _ = trace_body(lambda *p: cond_fun(pytree_unflatten(carry_def, p)), specs, names,
                           "a while_loop cond_fun")
    pred = [cond_g.nodes[o].spec for o in cond_g.outputs]
    if len(pred) != 1 or pred[0] != TensorSpec((), "bool"):
        raise TypeError(f"while_loop's cond_fun must return a scalar bool (shape (), dtype bool); got "
                        f"{', '.join(map(str, pred)) or 'nothing'}")

    def flat_body(*p):
        new, new_def = leaves_as_tensors(body_fun(pytree_unflatten(carry_def, p)))
        _check_same("a while_loop body", _specs(new), specs, new_def, carry_def)
        return new
    body_g, _ = trace_body(flat_body, specs, names, "a while_loop body")
    g = current_graph()
    inputs = carry + [Tensor(g, c) for c in cond_g.captured] + [Tensor(g, c) for c in body_g.captured]
    outs = _emit_control(WHILE, inputs, {"cond": cond_g, "body": body_g, "num_carry": len(carry),
                                           "captures": (len(cond_g.captured), len(body_g.captured))}, specs)
    return pytree_unflatten(carry_def, outs)


def cond(pred, true_fun, false_fun, *operands):
    """``true_fun(*operands) if pred else false_fun(*operands)`` with a traced scalar bool ``pred``; both
    branches are traced (once each) and must return the same structure, shapes and dtypes."""
    if isinstance(pred, (bool, np.bool_)):
        return (true_fun if pred else false_fun)(*operands)
    pred = core.asarray(pred)
    if pred.shape != () or pred.dtype != np.bool_:
        raise TypeError(f"cond's predicate must be a scalar bool (shape (), dtype bool); got "
                        f"{pred.node.spec}; compare to get one, e.g. x > 0")
    leaves, tree = leaves_as_tensors(operands)
    specs, names = _specs(leaves), [f"operand{k}" for k in range(len(leaves))]
    traced = []
    for fn, which in ((false_fun, "false_fun"), (true_fun, "true_fun")):
        def flat(*p, fn=fn):
            out, out_def = leaves_as_tensors(fn(*pytree_unflatten(tree, p)))
            traced.append(out_def)
            return out
        traced.append(trace_body(flat, specs, names, f"cond's {which}")[0])
    (false_def, false_g, true_def, true_g) = traced
    false_specs = [false_g.nodes[o].spec for o in false_g.outputs]
    true_specs = [true_g.nodes[o].spec for o in true_g.outputs]
    if true_def != false_def or true_specs != false_specs:
        raise TypeError(f"cond's branches must return the same structure, shapes and dtypes; got true_fun "
                        f"-> {[str(s) for s in true_specs]} and false_fun -> {[str(s) for s in false_specs]}")
    g = current_graph()
    inputs = [pred] + leaves + [Tensor(g, c) for c in false_g.captured] + [Tensor(g, c) for c in true_g.captured]
    outs = _emit_control(COND, inputs, {"branches": (false_g, true_g), "num_operands": len(leaves),
                                          "captures": (len(false_g.captured), len(true_g.captured))}, true_specs)
    return pytree_unflatten(true_def, outs)


# ---------------------------------------------------------------- remat
def remat(fn, policy="nothing_saveable"):
    """``fn`` whose intermediates the backward pass recomputes instead of storing (JAX's ``checkpoint``).
    ``policy``: "nothing_saveable" (recompute all), "dots_saveable" (keep contraction results),
    "cheap_recomputed" (keep all but cheap pointwise and layout ops), "everything_saveable", or
    ``checkpoint_policies.save_only_these_names(...)`` (keep the values ``checkpoint_name`` gave those names). As a
    scan body it sets the scan's policy; elsewhere it runs ``fn`` as a one-step scan with that policy."""
    _check_policy(policy)

    def remat_fn(*args):
        _, ys = scan(lambda carry, _: (carry, fn(*args)), (), length=1, policy=policy)
        leaves, treedef = pytree_flatten(ys)
        return pytree_unflatten(treedef, [y.reshape(y.shape[1:]) for y in leaves])
    remat_fn._remat = (fn, policy)
    remat_fn.__name__ = f"remat_{getattr(fn, '__name__', 'fn')}"
    return remat_fn


def _check_policy(policy):
    if not isinstance(policy, SaveOnlyTheseNames) and policy not in POLICIES:
        raise ValueError(f"a remat policy is one of {POLICIES} or checkpoint_policies.save_only_these_names(...); "
                         f"got {policy!r}")


def _unwrap_remat(f, policy):
    inner = getattr(f, "_remat", None)
    if inner is not None:
        f, policy = inner[0], policy or inner[1]
    if policy is not None:
        _check_policy(policy)
    return f, policy


# ---------------------------------------------------------------- reference kernels
def _evaluate(graph, args, xp):
    return evaluate(graph, *args, xp=xp)


@opdef.kernel(LOOP_OUT)
def _loop_out_kernel(xp, t, index):
    return t[index]


@opdef.kernel(CHECKPOINT_NAME)
def _checkpoint_name_kernel(xp, x, name):
    return x  # the same value: only a remat policy reads the name


# ``policy`` and ``results`` are graph attributes; a program's control instruction (run by its binder) has neither.
# ``adopt`` (a program's loop): the carries it runs in their dying initial buffers (partition/partitioner.py); the
# values are the same either way
@opdef.kernel(SCAN)
def _scan_kernel(xp, *operands, body, length, reverse, num_carry, num_xs, policy=None, results=(), shifts=(),
                 adopt=()):
    carry = list(operands[:num_carry])
    xs, consts = operands[num_carry:num_carry + num_xs], list(operands[num_carry + num_xs:])
    ys = [xp.empty(s.shape, s.dtype) for s in results[num_carry:]]
    shifts = shifts or (0,) * num_xs  # an xs read at t + shift, wrapping (partition/scan_prefetch.py)
    for t in (reversed(range(length)) if reverse else range(length)):
        outs = _evaluate(body, carry + [x[(t + s) % length] for x, s in zip(xs, shifts)] + consts, xp)
        carry = outs[:num_carry]
        for y, o in zip(ys, outs[num_carry:]):
            y[t] = o
    return tuple(carry) + tuple(ys)


@opdef.kernel(WHILE)
def _while_kernel(xp, *operands, cond, body, num_carry, captures, results=(), adopt=()):
    carry = list(operands[:num_carry])
    cond_caps = list(operands[num_carry:num_carry + captures[0]])
    body_caps = list(operands[num_carry + captures[0]:])
    while bool(_evaluate(cond, carry + cond_caps, xp)[0]):
        carry = _evaluate(body, carry + body_caps, xp)
    return tuple(carry)


@opdef.kernel(COND)
def _cond_kernel(xp, pred, *operands, branches, num_operands, captures, results=()):
    which = int(bool(pred))
    start = num_operands + (captures[0] if which else 0)
    own = list(operands[start:start + captures[which]])
    return tuple(_evaluate(branches[which], list(operands[:num_operands]) + own, xp))


__all__ = ["scan", "fori_loop", "while_loop", "cond", "remat"]
