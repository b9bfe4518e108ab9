"""Per-op partition rules: ``rule(ctx, node) -> LocalValue`` in any sharding.

Each rule picks operand shardings it can compute on locally, reshards the
operands through ``ctx.reshard`` (the one planner), and emits the local op with
local attributes. The driver then reshards the result to the node's sharding.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..graph import ELEMENTWISE_OPS
from ..sharding import Sharding
from .partitioner import PartitionContext, partition_rule
from .propagation import einsum_terms
from .reshape_map import map_reshape_sharding
from ..cost import strategy_cost
from .resharding import plan_cost


@partition_rule("parameter")
def _parameter(ctx: PartitionContext, node):
    return ctx.emit_like(node, "parameter", [], {"index": node.attrs["index"]}, ctx.sharding(node.id))


@partition_rule("constant")
def _constant(ctx, node):
    return ctx.emit_like(node, "constant", [], node.attrs, Sharding.replicated(len(node.shape)))


@partition_rule("mesh_split")
def _mesh_split(ctx, node):
    return ctx.reshard(ctx.value(node.inputs[0]), node.attrs["sharding"])


@partition_rule(*ELEMENTWISE_OPS)
def _elementwise(ctx, node):
    target = ctx.sharding(node.id)
    args = [ctx.reshard(ctx.value(i), target) for i in node.inputs]
    return ctx.emit_like(node, node.op, args, node.attrs, target)


@partition_rule("transpose")
def _transpose(ctx, node):
    target, perm = ctx.sharding(node.id), node.attrs["perm"]
    dims = [()] * len(perm)
    for i, p in enumerate(perm):
        dims[p] = target.dims[i]
    x = ctx.reshard(ctx.value(node.inputs[0]), Sharding(tuple(dims)))
    return ctx.emit_like(node, "transpose", [x], node.attrs, target)


@partition_rule("broadcast_in_dim")
def _broadcast(ctx, node):
    target, dims = ctx.sharding(node.id), node.attrs["dims"]
    src = ctx.graph[node.inputs[0]].shape
    need = Sharding(tuple(target.dims[d] if src[i] == node.shape[d] else () for i, d in enumerate(dims)))
    x = ctx.reshard(ctx.value(node.inputs[0]), need)
    local = target.local_shape(node.shape, ctx.mesh)
    return ctx.emit_like(node, "broadcast_in_dim", [x], {"shape": local, "dims": dims}, target)


@partition_rule("reshape")
def _reshape(ctx, node):
    """Cheapest of: reshard the operand so the result comes out as wanted, reshape the operand as it lies
    and reshard the result, or (when neither is exact) replicate the operand first."""
    x, target, mesh = ctx.value(node.inputs[0]), ctx.sharding(node.id), ctx.mesh
    options = []
    need = map_reshape_sharding(target, node.shape, x.shape, mesh, exact=True)
    if need is not None:
        options.append((ctx.cost(x, need), need, target))
    got = map_reshape_sharding(x.sharding, x.shape, node.shape, mesh, exact=True)
    if got is not None:
        options.append((plan_cost(got, target, node.shape, node.dtype, mesh), x.sharding, got))
    if not options:
        ctx.notes.append(f"reshape %{node.id} {x.shape}->{node.shape} cannot keep {x.sharding} -> {target} "
                         f"local; it replicates the operand first")
        options.append((0.0, Sharding.replicated(len(x.shape)), Sharding.replicated(len(node.shape))))
    _, need, result = min(options, key=lambda o: o[0])
    x = ctx.reshard(x, need)
    return ctx.emit_like(node, "reshape", [x], {"shape": result.local_shape(node.shape, mesh)}, result)


@partition_rule("reduce")
def _reduce(ctx, node):
    """Reduce locally; split reduced dims make the result a partial reduction over their axes, which the
    planner turns into an all-reduce or a reduce-scatter. Of the operand layouts (the one the result asks
    for, or the operand's own), take the one whose resharding before plus after moves fewest bytes."""
    x, target, axes = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["axes"]
    options = []
    for need in dict.fromkeys((_reduce_operand_for(target, x, axes), x.sharding.without_partial())):
        result = _reduced(need, axes, node.attrs["kind"])
        moved = ctx.cost(x, need) + plan_cost(result, target, node.shape, node.dtype, ctx.mesh)
        options.append((moved, need, result))
    _, need, result = min(options, key=lambda o: o[0])
    x = ctx.mask_padding(ctx.reshard(x, need), axes, reduce_identity(node.attrs["kind"], x.dtype))
    return ctx.emit_like(node, "reduce", [x], node.attrs, result)


def _reduce_operand_for(target: Sharding, x, axes) -> Sharding:
    """Kept dims as the result wants them; reduced dims keep the operand's axes the result does not use."""
    kept, dims = iter(target.dims), []
    for i in range(len(x.shape)):
        dims.append(tuple(a for a in x.sharding.dims[i] if a not in target.axes) if i in axes else next(kept))
    return Sharding(tuple(dims))


def _reduced(operand: Sharding, axes, kind) -> Sharding:
    partial = tuple(a for i in axes for a in operand.dims[i])
    return Sharding(tuple(d for i, d in enumerate(operand.dims) if i not in axes), partial,
                    kind if partial else "sum")


def reduce_identity(kind: str, dtype):
    """The value padding must hold so a ``kind`` reduction ignores it."""
    dtype = np.dtype(dtype)
    if kind == "sum":
        return 0
    if dtype == np.bool_:
        return kind == "min"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(info.min if kind == "max" else info.max)
    return float("-inf") if kind == "max" else float("inf")


# ---------------------------------------------------------------- einsum
@partition_rule("einsum")
def _einsum(ctx, node):
    """Pick the per-letter split (strategy) with the least bytes moved plus local compute (cost.py).

    A letter split alike on both operands is a batch dim (result split) or a
    contracting dim (result partial: all-reduce, or reduce-scatter when the
    result is wanted split); a free letter split on one side needs the other
    operand replicated over that axis.
    """
    lhs_t, rhs_t, out_t = einsum_terms(node)
    a, b, target = ctx.value(node.inputs[0]), ctx.value(node.inputs[1]), ctx.sharding(node.id)
    sizes = {**dict(zip(lhs_t, a.shape)), **dict(zip(rhs_t, b.shape))}
    options = _letter_options(sizes, [(lhs_t, a.sharding), (rhs_t, b.sharding), (out_t, target)], ctx.mesh)
    best = None
    for choice in itertools.product(*options.values()):
        split = dict(zip(options, choice))
        if not _distinct(split):
            continue
        shard_a, shard_b, result = _strategy_shardings(split, lhs_t, rhs_t, out_t, ctx.mesh)
        bytes_moved = ctx.cost(a, shard_a) + ctx.cost(b, shard_b) + plan_cost(result, target, node.shape, node.dtype, ctx.mesh)
        work = math.prod(-(-sizes[c] // ctx.mesh.axis_size(split[c])) for c in sizes)
        key = (strategy_cost(bytes_moved, 2 * work), bytes_moved, work)
        if best is None or key < best[0]:
            best = (key, shard_a, shard_b, result)
    _, shard_a, shard_b, result = best
    contracting = [c for c in lhs_t if c in rhs_t and c not in out_t]
    args = [ctx.mask_padding(ctx.reshard(v, s), [t.index(c) for c in contracting], 0)
            for v, s, t in ((a, shard_a, lhs_t), (b, shard_b, rhs_t))]
    return ctx.emit_like(node, "einsum", args, node.attrs, result)


def _letter_options(sizes, termed, mesh) -> dict[str, list[tuple[str, ...]]]:
    """Candidate axes per letter: unsplit, or as either operand or the result splits it."""
    opts = {c: [()] for c in sizes}
    for term, s in termed:
        for c, axes in zip(term, s.dims):
            if axes and axes not in opts[c] and mesh.axis_size(axes) <= sizes[c]:
                opts[c].append(axes)
    return opts


def _distinct(split) -> bool:
    used = [a for axes in split.values() for a in axes]
    return len(used) == len(set(used))


def _strategy_shardings(split, lhs_t, rhs_t, out_t, mesh):
    contracting = [c for c in lhs_t if c in rhs_t and c not in out_t]
    partial = tuple(a for name in mesh.axis_names for c in contracting if name in split[c] for a in (name,))
    shard = lambda term: Sharding(tuple(split[c] for c in term))
    result = Sharding(tuple(split[c] for c in out_t), partial)
    return shard(lhs_t), shard(rhs_t), result
