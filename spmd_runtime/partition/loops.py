"""Sharding propagation and partitioning of control nodes (scan, while, cond): each body is partitioned ONCE.

Propagation crosses the loop boundary the GSPMD way: a carry has ONE sharding, shared by the loop
operand, the body's parameter, the body's output (the back edge) and the loop result. The rule for a
control node propagates its body with the outside's shardings as seeds, merges what the body says
about the carry parameter and output into the carry, and repeats to a fixed point (merging only
refines, so it ends). A ``mesh_split`` inside the body therefore constrains the carry; ``xs`` and
``ys`` keep their other dims' shardings (the body sees one slice); loop invariants get the
sharding their body parameter wants.

The result of a control node is a ``TupleSharding`` (one sharding per result, None while unknown),
read by its ``loop_out`` nodes. Partitioning reshards the operands to the agreed shardings and
partitions each body as its own SPMD program (``partition`` with the parameter shardings as in_specs
and the carry shardings as out_specs, so a disagreeing back edge is resharded inside the body).

Pending sums (partition/pending_sums.py): a carry that starts at zero and to which the body adds a pending sum
(gradient accumulation) is carried as pending summands, started from zeros of that layout, and its loop result
completed once by whoever reads it; stacked results the enclosing body lets wait come out pending too.

The scanned dim of ``xs`` is never split: propagation does not propose it, and an operand that has it
split (a user annotation) is all-gathered over it first, with a note. Scanning a split dim (each
rank its slice, the carry handed between ranks) is not implemented.

The rules here are registered in the partition layer's tables by ``rules/control.py``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..bodies import TUPLE_DTYPE, extract
from ..ops.control import COND, LOOP_OUT, SCAN, WHILE
from ..ops.core import BROADCAST_IN_DIM, CONSTANT, RESHAPE
from ..ops.slicing import SLICE
from ..sharding import Sharding
from .partitioner import (LocalValue, assign_buffers, buffer_roots, donated_program, live_nodes, made_fresh,
                          partition, user_shardings)
from .scan_accumulate import accumulate_in_scans
from .scan_prefetch import pipelined_body, prefetch_enabled
from .schedule import overlap_budget
from .pending_sums import holds_pending_sum, is_zeros
from .propagation import legalize, merge, propagate


@dataclass(frozen=True)
class TupleSharding:
    """The shardings of a control node's results (None: not known yet)."""
    parts: tuple

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for p in self.parts if p is not None for a in p.axes)

    def refine(self, cur, node, mesh) -> "TupleSharding":
        """``cur`` refined part by part (what ``propagation._Sweeps._update`` calls for a tuple)."""
        specs = node.attrs["results"]
        old = cur.parts if isinstance(cur, TupleSharding) else (None,) * len(specs)
        out = []
        for o, c, spec in zip(old, self.parts, specs):
            c = None if c is None else legalize(c, spec.shape, mesh)
            out.append(c if o is None else o if c is None else merge(o, c))
        return TupleSharding(tuple(out))

    def __str__(self):
        return "(" + ", ".join("?" if p is None else str(p) for p in self.parts) + ")"


@dataclass
class Agreement:
    result: TupleSharding
    operands: list  # Sharding | None per operand
    bodies: dict  # body graph -> {node id: Sharding | None}


def _merge_all(shardings) -> Sharding | None:
    out = None
    for s in shardings:
        if s is not None:
            out = s if out is None else merge(out, s)
    return out


def _strip(s):
    return None if s is None else Sharding(s.dims[1:])


def _stacked(s):
    return None if s is None else Sharding(((),) + s.dims, s.partial, s.reduce_op)


def body_shardings(body, mesh, seeds: dict) -> dict:
    """Propagation of ``body`` from ``seeds`` (parameter id -> Sharding): node id -> Sharding, None where
    nothing is known. Cached per body, mesh and seeds."""
    seeds = {p: legalize(s, body.nodes[p].shape, mesh) for p, s in seeds.items() if s is not None}
    key = (mesh, tuple(sorted(seeds.items(), key=lambda kv: kv[0])))
    cache = body.__dict__.setdefault("_propagation", {})
    if key not in cache:
        prop = propagate(body, mesh, user_shardings(body, mesh, None), seeds)
        cache[key] = {v: None if prop.origin[v] == "default" else s for v, s in prop.shardings.items()}
    return cache[key]


def _parts(node, out):
    return list(out.parts) if isinstance(out, TupleSharding) else [None] * len(node.attrs["results"])


def scan_agreement(node, ins, out, mesh) -> Agreement:
    a, outs = node.attrs, _parts(node, out)
    body, nc, nx = a["body"], a["num_carry"], a["num_xs"]
    params, results = body.params, body.outputs
    carry = [_merge_all([ins[i], outs[i]]) for i in range(nc)]
    fixed = {params[i]: _strip(ins[i]) if i < nc + nx else ins[i] for i in range(nc, len(params))}
    while True:
        sh = body_shardings(body, mesh, {**fixed, **dict(zip(params, carry))})
        new = [_merge_all([carry[i], sh[params[i]], sh[results[i]]]) for i in range(nc)]
        if new == carry:
            break
        carry = new
    ys = [_merge_all([outs[k], _stacked(sh[results[k]])]) for k in range(nc, len(results))]
    operands = carry + [_stacked(sh[p]) for p in params[nc:nc + nx]] + [sh[p] for p in params[nc + nx:]]
    return Agreement(TupleSharding(tuple(carry + ys)), operands, {body: sh})


def while_agreement(node, ins, out, mesh) -> Agreement:
    a, outs = node.attrs, _parts(node, out)
    cond_g, body, n = a["cond"], a["body"], a["num_carry"]
    n_cond = a["captures"][0]
    cond_caps = dict(zip(cond_g.params[n:], ins[n:n + n_cond]))
    body_caps = dict(zip(body.params[n:], ins[n + n_cond:]))
    carry = [_merge_all([ins[i], outs[i]]) for i in range(n)]
    while True:
        cs = body_shardings(cond_g, mesh, {**cond_caps, **dict(zip(cond_g.params, carry))})
        bs = body_shardings(body, mesh, {**body_caps, **dict(zip(body.params, carry))})
        new = [_merge_all([carry[i], bs[body.params[i]], bs[body.outputs[i]], cs[cond_g.params[i]]])
               for i in range(n)]
        if new == carry:
            break
        carry = new
    operands = carry + [cs[p] for p in cond_g.params[n:]] + [bs[p] for p in body.params[n:]]
    return Agreement(TupleSharding(tuple(carry)), operands, {cond_g: cs, body: bs})


def cond_agreement(node, ins, out, mesh) -> Agreement:
    a, outs = node.attrs, _parts(node, out)
    n, branches = a["num_operands"], a["branches"]
    ops = ins[1:1 + n]
    caps = (ins[1 + n:1 + n + a["captures"][0]], ins[1 + n + a["captures"][0]:])
    sh = [body_shardings(g, mesh, {**dict(zip(g.params, ops)), **dict(zip(g.params[n:], c))})
          for g, c in zip(branches, caps)]
    results = [_merge_all([outs[k]] + [s[g.outputs[k]] for g, s in zip(branches, sh)]) for k in range(len(outs))]
    operands = [Sharding(())] + [_merge_all([ops[j]] + [s[g.params[j]] for g, s in zip(branches, sh)])
                                 for j in range(n)]
    operands += [s[p] for g, s in zip(branches, sh) for p in g.params[n:]]
    return Agreement(TupleSharding(tuple(results)), operands, dict(zip(branches, sh)))


AGREEMENTS = {SCAN.name: scan_agreement, WHILE.name: while_agreement, COND.name: cond_agreement}


# ---------------------------------------------------------------- propagation rules (rules/control.py registers them)
def control_propagation():
    fwd = lambda node, ins, g, mesh: AGREEMENTS[node.op](node, ins, None, mesh).result
    bwd = lambda node, out, ins, g, mesh: AGREEMENTS[node.op](node, ins, out, mesh).operands
    return fwd, bwd


def loop_out_propagation():
    def fwd(node, ins, g, mesh):
        return ins[0].parts[node.attrs["index"]] if isinstance(ins[0], TupleSharding) else None

    def bwd(node, out, ins, g, mesh):
        parts = [None] * len(g.nodes[node.inputs[0]].attrs["results"])
        parts[node.attrs["index"]] = out
        return [TupleSharding(tuple(parts))]
    return fwd, bwd


# ---------------------------------------------------------------- partition rules (rules/control.py registers them)
def _or_replicated(s, spec) -> Sharding:
    return s if s is not None else Sharding.replicated(len(spec.shape))


def _agreed(ctx, node) -> Agreement:
    cur = ctx.sharding(node.id)
    return AGREEMENTS[node.op](node, [ctx.sharding(i) for i in node.inputs],
                               cur if isinstance(cur, TupleSharding) else None, ctx.mesh)


def partition_body(ctx, node, body, in_shardings, out_shardings, what, pending=()):
    """``body`` as its own SPMD program; its notes join the enclosing program's, naming the node. ``pending``:
    the outputs the loop takes as pending sums (``partition``'s)."""
    in_shardings = [_or_replicated(s, body.nodes[p].spec) for s, p in zip(in_shardings, body.params)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = partition(body, ctx.mesh, in_specs=in_shardings, out_specs=out_shardings, pending=pending,
                            regather=False)
    ctx.notes += [f"in the {what} of %{node.id}: {n}" for n in program.notes]
    return program


def emit_control(ctx, node, args, attrs, results) -> LocalValue:
    value = ctx.emit(node.op, args, attrs, Sharding(()), (), TUPLE_DTYPE)
    ctx.shardings[node.id] = TupleSharding(tuple(results))
    return LocalValue(value.slot, ctx.shardings[node.id], (), TUPLE_DTYPE)


def partition_scan(ctx, node):
    a, ag = node.attrs, _agreed(ctx, node)
    body, nc, nx = a["body"], a["num_carry"], a["num_xs"]
    sh, specs = ag.bodies[body], a["results"]
    carry = [_or_replicated(s, spec) for s, spec in zip(ag.result.parts[:nc], specs)]
    inner = carry + [sh[p] for p in body.params[nc:]]
    # initial carries that are pending sums (an accumulator of an earlier loop): kept pending if the body accumulates
    init_pending = {k for k in range(nc) if holds_pending_sum(ctx.value(node.inputs[k]).sharding)}
    args = [None if k in init_pending else ctx.reshard(ctx.value(i), s)
            for k, (i, s) in enumerate(zip(node.inputs[:nc], carry))]
    for i, s, p in zip(node.inputs[nc:nc + nx], inner[nc:nc + nx], body.params[nc:nc + nx]):
        x = ctx.value(i)
        if x.sharding.dims[0]:
            ctx.notes.append(f"scan %{node.id} runs over dim 0 of %{i} {list(x.shape)}, split over "
                             f"{x.sharding.dims[0]}: all-gathered first (a split scanned dim is not supported)")
        args.append(ctx.reshard(x, Sharding(((),) + _or_replicated(s, body.nodes[p].spec).dims)))
    args += [ctx.reshard(ctx.value(i), _or_replicated(s, ctx.graph[i].spec))
             for i, s in zip(node.inputs[nc + nx:], inner[nc + nx:])]
    kept = _live_results(ctx, node, range(nc, len(specs)))
    if len(kept) < len(specs) - nc:  # stacked ys nobody reads (e.g. cotangents of undifferentiated xs)
        body = extract(body, body.params, body.outputs[:nc] + [body.outputs[k] for k in kept], keep_inputs=True)[0]
    ys = [_strip(ag.result.parts[k]) for k in kept]
    waiting = ctx.pending_results.get(node.id, ())
    pending = [k for k in range(nc) if is_zeros(ctx.graph, node.inputs[k]) or k in init_pending] + \
        [nc + p for p, k in enumerate(kept) if k in waiting]
    program = partition_body(ctx, node, body, inner, carry + ys, "scan body", pending)
    unmatched = {k for k in init_pending  # the body carries the sum in another layout: completed before the loop
                 if program.inputs[k].sharding not in (carry[k], ctx.value(node.inputs[k]).sharding)}
    if unmatched:
        pending = [k for k in pending if k not in unmatched]
        program = partition_body(ctx, node, body, inner, carry + ys, "scan body", pending)
    for k in range(nc):  # accumulators kept pending (pending_sums): start from zero summands, or the pending init
        if program.inputs[k].sharding != carry[k]:
            carry[k] = program.inputs[k].sharding
            args[k] = ctx.value(node.inputs[k]) if k in init_pending else _zeros(ctx, program.inputs[k])
        elif k in init_pending:
            args[k] = ctx.reshard(ctx.value(node.inputs[k]), carry[k])
    attrs = {"body": program, "length": a["length"], "reverse": a["reverse"], "num_carry": nc, "num_xs": nx}
    args, m = _prefetching(ctx, attrs, args) if prefetch_enabled() and a["length"] > 1 else (args, 0)
    program = attrs["body"] = _carries_in_place(attrs["body"], attrs["num_carry"])
    results = carry + [o.sharding for o in program.outputs[nc:nc + m]] \
        + [_stacked(o.sharding) for o in program.outputs[nc + m:]]
    ctx.result_positions[node.id] = {k: p + (m if p >= nc else 0) for p, k in enumerate(list(range(nc)) + kept)}
    return emit_control(ctx, node, args, attrs, results)


def _zeros(ctx, like) -> LocalValue:
    """Zeros laid out as the body input ``like`` (an accumulator's pending sums: every summand zero)."""
    zero = ctx.emit(CONSTANT, [], {"value": np.zeros((), like.dtype)}, Sharding(()), (), like.dtype)
    return ctx.emit(BROADCAST_IN_DIM, [zero], {"shape": like.sharding.local_shape(like.shape, ctx.mesh), "dims": ()},
                    like.sharding, like.shape, like.dtype)


def _carries_in_place(body, nc: int):
    """``body`` with the carries it makes buffers of its own for marked donated: it may then write an
    iteration's carry into the last one's buffer (a gradient accumulator updated in place) instead of a new
    buffer per iteration. A carry qualifies when its body result can only be (or view) buffers that body ops
    make fresh, none shared with another result: then each iteration's carry is the loop's alone, from the
    scan's own copy of the initial value (exec/loops.py) to the final result, which is the scan's fresh
    buffer (ops/control.py)."""
    roots = buffer_roots(body.instrs)[0]
    results = [roots[o.slot] for o in body.outputs]
    owned = [k for k in range(nc) if made_fresh(results[k])
             and not any(results[k] & r for j, r in enumerate(results) if j != k)]
    # an accumulator carry now the body's to overwrite: its inner scans may add their stacked results into it
    return accumulate_in_scans(donated_program(body, owned), assign_buffers) if owned else body


def _prefetching(ctx, attrs: dict, args: list) -> tuple[list, int]:
    """The scan's operands and how many gathers it prefetches, with ``attrs`` (its body, arity and ``shifts``)
    rewritten where the body's gathers of xs slices start an iteration early (partition/scan_prefetch.py)."""
    nc, nx = attrs["num_carry"], attrs["num_xs"]
    piped = pipelined_body(attrs["body"], nc, nx, overlap_budget(None))
    if piped is None:
        return args, 0
    program, picks = piped
    assign_buffers(program.instrs, {o.slot for o in program.outputs})
    m, first = len(picks), attrs["length"] - 1 if attrs["reverse"] else 0
    gathered = [_gathered_slice(ctx, args[nc + x], first, program.outputs[nc + j]) for j, x in enumerate(picks)]
    attrs.update(body=program, num_carry=nc + m, num_xs=nx + m,
                 shifts=(0,) * nx + ((-1 if attrs["reverse"] else 1),) * m)
    return args[:nc] + gathered + args[nc:nc + nx] + [args[nc + x] for x in picks] + args[nc + nx:], m


def _gathered_slice(ctx, stacked: LocalValue, t: int, like) -> LocalValue:
    """Iteration ``t``'s slice of the stacked xs operand laid out as the body's gathered weight ``like``
    (through the resharding planner: the body's all-gather): the first iteration's prefetched weight,
    computed before the loop."""
    one = ctx.emit(SLICE, [stacked], {"start": (t,) + (0,) * (len(stacked.shape) - 1),
                                      "limit": (t + 1,) + stacked.sharding.local_shape(stacked.shape, ctx.mesh)[1:],
                                      "strides": (1,) * len(stacked.shape)},
                   stacked.sharding, (1,) + stacked.shape[1:], stacked.dtype)
    body_operand = Sharding(stacked.sharding.dims[1:])
    flat = ctx.emit(RESHAPE, [one], {"shape": body_operand.local_shape(stacked.shape[1:], ctx.mesh)},
                    body_operand, stacked.shape[1:], stacked.dtype)
    return ctx.reshard(flat, like.sharding)


def partition_while(ctx, node):
    a, ag = node.attrs, _agreed(ctx, node)
    n, (cond_g, body) = a["num_carry"], (a["cond"], a["body"])
    carry = [_or_replicated(s, spec) for s, spec in zip(ag.result.parts, a["results"])]
    n_cond = a["captures"][0]
    ops = carry + [_or_replicated(s, ctx.graph[i].spec) for i, s in zip(node.inputs[n:], ag.operands[n:])]
    args = [ctx.reshard(ctx.value(i), s) for i, s in zip(node.inputs, ops)]
    cond_p = partition_body(ctx, node, cond_g, carry + ops[n:n + n_cond], [Sharding(())], "while cond")
    body_p = _carries_in_place(partition_body(ctx, node, body, carry + ops[n + n_cond:], carry, "while body"), n)
    return emit_control(ctx, node, args, {"cond": cond_p, "body": body_p, "num_carry": n,
                                          "captures": a["captures"]}, carry)


def partition_cond(ctx, node):
    a, ag = node.attrs, _agreed(ctx, node)
    n, caps = a["num_operands"], a["captures"]
    ops = [_or_replicated(s, ctx.graph[i].spec) for i, s in zip(node.inputs, ag.operands)]
    args = [ctx.reshard(ctx.value(i), s) for i, s in zip(node.inputs, ops)]
    results = [_or_replicated(s, spec) for s, spec in zip(ag.result.parts, a["results"])]
    own = (ops[1 + n:1 + n + caps[0]], ops[1 + n + caps[0]:])
    programs = tuple(partition_body(ctx, node, g, ops[1:1 + n] + list(c), results, f"cond {which} branch")
                     for g, c, which in zip(a["branches"], own, ("false", "true")))
    return emit_control(ctx, node, args, {"branches": programs, "num_operands": n, "captures": caps}, results)


def _live_results(ctx, node, indices) -> list[int]:
    """The results among ``indices`` that some live ``loop_out`` reads."""
    if ctx.live_nodes is None:
        ctx.live_nodes = live_nodes(ctx.graph)
    read = {n.attrs["index"] for n in ctx.graph.nodes
            if n.op == LOOP_OUT.name and n.inputs[0] == node.id and n.id in ctx.live_nodes}
    return [k for k in indices if k in read]


def partition_loop_out(ctx, node):
    t, index = ctx.value(node.inputs[0]), node.attrs["index"]
    position = ctx.result_positions.get(node.inputs[0], {}).get(index, index)
    return ctx.emit_like(node, LOOP_OUT, [t], {"index": position}, t.sharding.parts[position])
