"""Reverse-mode differentiation of control nodes: a scan's VJP is a reverse scan over saved residuals.

For a scan body ``f(c, x, k) -> (c', y)`` the VJP rule builds one joint graph: the body's forward
nodes, then its backward nodes (``backward_from`` with cotangent parameters for c' and y). Forward
nodes read by backward nodes are the residuals; the remat policy picks which are SAVED (stacked by the
forward scan as extra ys: "everything_saveable" all, "cheap_recomputed" (the default) all but cheap
pointwise and layout ops whose operands cost no more to store, "dots_saveable" contraction results,
"nothing_saveable" none, ``save_only_these_names`` the values ``checkpoint_name`` gave those names) and
which the backward body recomputes from the iteration's carry (then stacked too), its x slice and the loop
invariants. The forward scan node is rewritten in place to
also output the saved residuals (JAX's partial evaluation, done on the traced graph), and a reverse
scan over them emits the cotangents: carry cotangents flow through its carry, loop-invariant
cotangents are summed in its carry, xs cotangents are its stacked ys.

``cond``'s VJP is a ``cond`` on the same predicate whose branches recompute their forward pass and
differentiate it. ``while_loop`` is forward only. This module holds the machinery (the split of a body,
the residual policies, a control node's tuple cotangent); the VJP rules that use it, registered per op,
are in ``rules/control.py`` (and the shard_map region's in ``rules/manual.py``).
"""
from __future__ import annotations

import numpy as np

from ..bodies import TUPLE_DTYPE, TUPLE_SHAPE, BodyGraph, extract, inline, tracing
from ..dtypes import is_floating
from ..graph import TensorSpec
from ..ops.control import CHECKPOINT_NAME, COND, LOOP_OUT, SCAN, WHILE, SaveOnlyTheseNames
from ..ops.core import BROADCAST_IN_DIM, PARAMETER, RESHAPE, TRANSPOSE, zeros
from ..ops.einsum import EINSUM
from ..opdef import OPS
from ..trace import Tensor, emit
from .engine import backward_from

# Recomputed by the backward body rather than stacked by the forward scan ("cheap_recomputed", the default):
# cheaper to redo, fused into the backward's loops, than to write, stack and reread.
RECOMPUTED = frozenset(r.name for r in OPS.values() if r.cheap) | {BROADCAST_IN_DIM.name, RESHAPE.name, TRANSPOSE.name}

CONTROL_OPS = (SCAN.name, WHILE.name, COND.name)


class TupleCotangent:
    """Cotangents of some results of a control node, by result index (what its ``loop_out`` nodes got)."""
    shape, dtype = TUPLE_SHAPE, np.dtype(TUPLE_DTYPE)

    def __init__(self, parts: dict):
        self.parts = dict(parts)

    def __add__(self, other: "TupleCotangent") -> "TupleCotangent":
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts[k] + v if k in parts else v
        return TupleCotangent(parts)


def floating(dtype) -> bool:
    return is_floating(dtype)  # bfloat16 too, which NumPy does not count as np.floating


# ---------------------------------------------------------------- scan
class Linearized:
    """A scan body split for differentiation: ``forward`` (the body plus saved residuals and needed carries
    as extra outputs) and ``backward`` (cotangents of the floating inputs from the residuals)."""

    def __init__(self, body: BodyGraph, num_carry: int, policy: str):
        n_in = len(body.params)
        joint = BodyGraph()
        with tracing(joint):
            ps = [joint.add_param(joint_spec, f"in{k}") for k, joint_spec in enumerate(body.input_specs)]
            start = len(joint.nodes)
            outs = inline(body, ps)
            self.float_outs = [k for k, o in enumerate(outs) if floating(o.dtype)]
            cts = [joint.add_param(outs[k].node.spec, f"ct{k}") for k in self.float_outs]
            seeds = {}
            for k, ct in zip(self.float_outs, cts):
                seeds[outs[k].id] = seeds[outs[k].id] + ct if outs[k].id in seeds else ct
            self.float_ins = [i for i, p in enumerate(ps) if floating(p.dtype)]
            grads = backward_from(seeds, [ps[i] for i in self.float_ins], start)
        saved = _residuals(joint, {c.id for c in cts}, {p.id for p in ps}, policy)
        inputs = saved + [p.id for p in ps] + [c.id for c in cts]
        self.backward, used = extract(joint, inputs, [t.id for t in grads])
        self.used = used  # positions in saved + inputs + cotangents that the backward body reads
        s = len(saved)
        self.carries_saved = [p - s for p in used if s <= p < s + n_in and p - s < num_carry]
        fwd_outs = [o.id for o in outs] + saved + [ps[i].id for i in self.carries_saved]
        self.forward, _ = extract(joint, [p.id for p in ps], fwd_outs, keep_inputs=True)
        self.saved_specs = [joint.nodes[v].spec for v in saved] + [ps[i].node.spec for i in self.carries_saved]
        self.num_saved = s


def _residuals(joint, ct_ids: set, in_ids: set, policy: str) -> list[int]:
    """Forward values read by backward nodes that the policy saves (never parameters, constants or what
    depends on no input: those are recomputed)."""
    on_ct, on_in = {}, {}
    for n in joint.nodes:
        on_ct[n.id] = n.id in ct_ids or any(on_ct[i] for i in n.inputs)
        on_in[n.id] = n.id in in_ids or any(on_in[i] for i in n.inputs)
    read = {i for n in joint.nodes if on_ct[n.id] for i in n.inputs if not on_ct[i]}
    saveable = _saveable(policy)
    saved = {v for v in read if _storable(joint, v, on_in) and saveable(joint.nodes[v])}
    return sorted(_cheap_recomputed(joint, saved, on_in) if policy == "cheap_recomputed" else saved)


def _saveable(policy):
    """Whether the policy saves a node (when the backward reads it)."""
    if isinstance(policy, SaveOnlyTheseNames):
        return lambda n: n.op == CHECKPOINT_NAME.name and n.attrs["name"] in policy.names
    return {"everything_saveable": lambda n: True, "cheap_recomputed": lambda n: True,
            "nothing_saveable": lambda n: False, "dots_saveable": lambda n: n.op == EINSUM.name}[policy]


def _storable(joint, v: int, on_in: dict) -> bool:
    return on_in[v] and joint.nodes[v].op not in (PARAMETER.name,) + CONTROL_OPS


def _cheap_recomputed(joint, saved: set, on_in: dict) -> set:
    """``saved`` with each cheap residual (a pointwise op without transcendental or division, a broadcast, a
    reshape or transpose: ``RECOMPUTED``) replaced by its operands, where storing those costs no more bytes
    than storing it (they are often saved already: GELU's ``0.5 * x`` beside ``x``; a broadcast's operand is
    smaller). The backward body recomputes it, inside a fusion there; the forward scan neither writes nor
    stacks it. Latest first, so that a chain of cheap ops folds back to the value it starts from."""
    saved, todo = set(saved), sorted(saved)
    while todo:
        v = todo.pop()
        node = joint.nodes[v]
        if v not in saved or node.op not in RECOMPUTED:
            continue
        needed = {i for i in node.inputs if on_in[i] and joint.nodes[i].op != PARAMETER.name} - saved
        if all(_storable(joint, i, on_in) for i in needed) and \
                sum(joint.nodes[i].spec.nbytes for i in needed) <= node.spec.nbytes:
            saved = (saved - {v}) | needed
            todo = sorted(set(todo) | needed)
    return saved


def add_results(node_tensor: Tensor, specs: list[TensorSpec]) -> list[Tensor]:
    """More results of an existing control node (the residuals a backward pass asks a forward scan to save)."""
    node = node_tensor.node
    start = len(node.attrs["results"])
    node.attrs["results"] = tuple(node.attrs["results"]) + tuple(specs)
    return [emit(LOOP_OUT, [node_tensor], {"index": start + k}, s.shape, s.dtype) for k, s in enumerate(specs)]


def linearize(body: BodyGraph, num_carry: int, policy: str) -> Linearized:
    cache = body.__dict__.setdefault("_linearized", {})
    if policy not in cache:
        cache[policy] = Linearized(body, num_carry, policy)
    return cache[policy]


def zeros_like(spec: TensorSpec):
    return zeros(spec.shape, spec.dtype)
