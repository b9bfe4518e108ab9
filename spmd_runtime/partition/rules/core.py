"""The propagation and partition rules of the ``ops/core.py`` family (leaves, elementwise, broadcast /
reshape / transpose and reductions; the records, traced functions and kernels are there), registered in
``table.py``. ``reduce_propagation`` is also the rule of the arg-reductions (``rules/indexing.py``)."""
from __future__ import annotations

import math

import numpy as np

from ...opdef import BROADCAST_LEVEL, ELEMENTWISE_LEVEL
from ...ops.control import CHECKPOINT_NAME
from ...ops.core import (BROADCAST_IN_DIM, CONSTANT, ELEMENTWISE_LIKE, MESH_SPLIT, PARAMETER, REDUCE, RESHAPE,
                         STOP_GRADIENT, TRANSPOSE, WITH_GRADIENTS, reduce_identity)
from ...ops.spmd import ALL_TO_ALLV
from ...sharding import Sharding
from ..pending_sums import sum_carriers
from ..propagation import combine
from ..reshape_map import map_reshape_sharding, unaligned_group
from ..resharding import plan_cost, window_exchange
from ..strategy import Strategy, choose
from .table import partition, propagation


# ================================================================ sharding propagation
@propagation(*ELEMENTWISE_LIKE, level=ELEMENTWISE_LEVEL)
def _elementwise_propagation():
    fwd = lambda node, ins, g, mesh: combine(ins)
    bwd = lambda node, out, ins, g, mesh: [out] * len(ins)
    return fwd, bwd


@propagation(MESH_SPLIT, STOP_GRADIENT, CHECKPOINT_NAME, level=ELEMENTWISE_LEVEL)
def _mesh_split_propagation():
    """The value keeps its operand's layout and offers the operand its own. For a mesh_split the annotation is
    the value's sharding (pinned); dims it leaves UNCONSTRAINED are refined from the operand like an
    elementwise op's (``propagation.refine_free``). A ``reshard_only`` annotation (a ``grad_spec``'s, on a
    cotangent) offers its operand nothing: the gradient is computed as its own operands lay it out (FSDP's: a
    pending sum over the batch) and resharded to the annotation (a reduce-scatter); offered back, a weight's
    split would reach the activation gradients and through them the forward activations."""
    fwd = lambda node, ins, g, mesh: ins[0]
    bwd = lambda node, out, ins, g, mesh: [None if node.attrs.get("reshard_only") else out]
    return fwd, bwd


@propagation(PARAMETER, CONSTANT, level=ELEMENTWISE_LEVEL)
def _leaf_propagation():
    return (lambda *a: None), (lambda *a: [])


@propagation(TRANSPOSE, level=ELEMENTWISE_LEVEL)
def _transpose_propagation():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else Sharding(tuple(ins[0].dims[p] for p in node.attrs["perm"]))

    def bwd(node, out, ins, g, mesh):
        return [_untransposed(out, node.attrs["perm"])]
    return fwd, bwd


def _untransposed(result: Sharding, perm) -> Sharding:
    """The operand sharding that ``transpose(perm)`` turns into ``result`` (pending sums and all)."""
    dims = [()] * len(perm)
    for i, p in enumerate(perm):
        dims[p] = result.dims[i]
    return Sharding(tuple(dims), result.partial, result.reduce_op)


@propagation(RESHAPE, level=ELEMENTWISE_LEVEL)
def _reshape_propagation():
    def fwd(node, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return None if ins[0] is None else map_reshape_sharding(ins[0], src, node.shape, mesh, exact=False)

    def bwd(node, out, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return [map_reshape_sharding(out, node.shape, src, mesh, exact=False)]
    return fwd, bwd


@propagation(BROADCAST_IN_DIM, level=BROADCAST_LEVEL)
def _broadcast_propagation():
    def fwd(node, ins, g, mesh):
        if ins[0] is None:
            return None
        src, dims = g.nodes[node.inputs[0]].shape, node.attrs["dims"]
        out = [()] * len(node.shape)
        for i, d in enumerate(dims):
            out[d] = ins[0].dims[i] if src[i] == node.shape[d] else ()
        return Sharding(tuple(out))

    def bwd(node, out, ins, g, mesh):
        return [_broadcast_operand(out, g.nodes[node.inputs[0]].shape, node)]
    return fwd, bwd


def _broadcast_operand(result: Sharding, src, node) -> Sharding:
    """The operand dims keep the result's split where they are not expanded from size 1."""
    dims = node.attrs["dims"]
    return Sharding(tuple(result.dims[d] if src[i] == node.shape[d] else () for i, d in enumerate(dims)))


@propagation(REDUCE, level=BROADCAST_LEVEL)
def reduce_propagation():
    """Kept dims keep their split, reduced ones are dropped (also the rule of arg-reductions)."""
    def fwd(node, ins, g, mesh):
        axes = node.attrs["axes"]
        return None if ins[0] is None else Sharding(tuple(d for i, d in enumerate(ins[0].dims) if i not in axes))

    def bwd(node, out, ins, g, mesh):
        kept = iter(out.dims)
        return [Sharding(tuple(() if i in node.attrs["axes"] else next(kept)
                               for i in range(len(g.nodes[node.inputs[0]].shape))))]
    return fwd, bwd


# ================================================================ partition rules
@partition(PARAMETER)
def _parameter_partition(ctx, node):
    return ctx.emit_like(node, PARAMETER.name, [], {"index": node.attrs["index"]}, ctx.sharding(node.id))


@partition(CONSTANT)
def _constant_partition(ctx, node):
    return ctx.emit_like(node, CONSTANT.name, [], node.attrs, Sharding.replicated(len(node.shape)))


@propagation(WITH_GRADIENTS, level=ELEMENTWISE_LEVEL)
def _with_gradients_propagation():
    """The value's layout, both ways; the arrays it gives derivatives to and their gradients are not read."""
    fwd = lambda node, ins, g, mesh: ins[0]
    bwd = lambda node, out, ins, g, mesh: [out] + [None] * (len(ins) - 1)
    return fwd, bwd


@partition(MESH_SPLIT, STOP_GRADIENT, CHECKPOINT_NAME, WITH_GRADIENTS)
def _mesh_split_partition(ctx, node):
    """No instruction of its own: the (first) operand's value, laid out as wanted (UNCONSTRAINED dims: as
    propagated)."""
    return ctx.reshard(ctx.value(node.inputs[0]), ctx.sharding(node.id))


@partition(*ELEMENTWISE_LIKE)
def _elementwise_partition(ctx, node):
    target = ctx.sharding(node.id)
    operands = _pending_sum_operands(ctx, node, target) or [target] * len(node.inputs)
    args = [ctx.reshard(ctx.value(i), s) for i, s in zip(node.inputs, operands)]
    return ctx.emit_like(node, node.op, args, node.attrs, target)


def _pending_sum_operands(ctx, node, target: Sharding):
    """Where the wanted result is a pending sum and the op is linear in its partial operands: the operand
    layouts that keep the sum pending, so no collective runs here. None otherwise (operands are completed)."""
    if not target.partial or target.reduce_op != "sum":
        return None
    pending = [ctx.value(i).sharding.partial if ctx.value(i).sharding.reduce_op == "sum" else None
               for i in node.inputs]
    carriers = sum_carriers(node.op, pending)
    if carriers is None or pending[carriers[0]] != target.partial:
        return None
    return [target if j in carriers else target.without_partial() for j in range(len(node.inputs))]


@partition(TRANSPOSE)
def _transpose_partition(ctx, node):
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), _untransposed(target, node.attrs["perm"]))
    return ctx.emit_like(node, TRANSPOSE.name, [x], node.attrs, target)


@partition(BROADCAST_IN_DIM)
def _broadcast_partition(ctx, node):
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), _broadcast_operand(target, ctx.graph[node.inputs[0]].shape, node))
    local = target.local_shape(node.shape, ctx.mesh)
    return ctx.emit_like(node, BROADCAST_IN_DIM.name, [x], {"shape": local, "dims": node.attrs["dims"]}, target)


@partition(RESHAPE)
def _reshape_partition(ctx, node):
    """Cheapest of: reshard the operand so the result comes out as wanted, reshape the operand as it lies
    and reshard the result, or (when neither is exact) replicate the operand first."""
    x, target, mesh = ctx.value(node.inputs[0]), ctx.sharding(node.id), ctx.mesh
    candidates = []
    need = map_reshape_sharding(target, node.shape, x.shape, mesh, exact=True)
    if need is not None:
        candidates.append(Strategy(ctx.cost(x, need), operands=(need,), result=target))
    got = map_reshape_sharding(x.sharding, x.shape, node.shape, mesh, exact=True)
    if got is not None:
        candidates.append(Strategy(plan_cost(got, target, node.shape, node.dtype, mesh), operands=(x.sharding,),
                                   result=got))
    exchange = _reshape_exchange(ctx, node, x)
    if exchange is not None:
        candidates.append(Strategy(exchange[0]["wire_bytes"] + plan_cost(exchange[1], target, node.shape, node.dtype,
                                                                          mesh), operands=(x.sharding,),
                                   result=exchange[1], plan=exchange))
    if not candidates:
        ctx.notes.append(f"reshape %{node.id} {x.shape}->{node.shape} cannot keep {x.sharding} -> {target} "
                         f"local; it replicates the operand first")
        candidates.append(Strategy(0.0, operands=(Sharding.replicated(len(x.shape)),),
                                   result=Sharding.replicated(len(node.shape))))
    best = choose(candidates)
    if best.plan is not None:
        return _emit_reshape_exchange(ctx, node, x, *best.plan)
    x = ctx.reshard(x, best.operands[0])
    return ctx.emit_like(node, RESHAPE.name, [x], {"shape": best.result.local_shape(node.shape, mesh)}, best.result)


def _reshape_exchange(ctx, node, x):
    """A reshape that merges or splits a split dim across unaligned shard boundaries: each shard flattens its
    block of the group (a contiguous run of the flattened group), one all_to_allv sends every result block the
    flat entries it holds, and each shard unflattens its block. (exchange attrs, result sharding, the flat
    layouts) or None where ``unaligned_group`` finds no such group."""
    group = unaligned_group(x.sharding, x.shape, node.shape, ctx.mesh)
    if group is None:
        return None
    (a, b), (c, d) = group
    axes, total = x.sharding.dims[a], math.prod(x.shape[a:b + 1])
    k = ctx.mesh.axis_size(axes)
    flat_src = -(-x.shape[a] // k) * total // x.shape[a] * k  # k blocks of whole operand rows, flattened
    flat_dst = -(-node.shape[c] // k) * total // node.shape[c] * k
    src = Sharding(x.sharding.dims[:a] + (axes,) + x.sharding.dims[b + 1:])
    src_shape, dst_shape = x.shape[:a] + (flat_src,) + x.shape[b + 1:], x.shape[:a] + (flat_dst,) + x.shape[b + 1:]
    maps = [(0, 1, flat_dst, 0, total) if e == a else None for e in range(len(src_shape))]
    attrs = window_exchange(src, src.dims, src_shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize)
    result = Sharding(x.sharding.dims[:a] + (axes,) + ((),) * (d - c) + x.sharding.dims[b + 1:])
    return attrs, result, src, src_shape, dst_shape


def _emit_reshape_exchange(ctx, node, x, attrs, result, flat, src_shape, dst_shape):
    local = lambda shape: flat.local_shape(shape, ctx.mesh)  # noqa: E731
    v = ctx.emit(RESHAPE.name, [x], {"shape": local(src_shape)}, flat, src_shape, x.dtype)
    v = ctx.emit(ALL_TO_ALLV, [v], attrs, flat, dst_shape, x.dtype)
    return ctx.emit_like(node, RESHAPE.name, [v], {"shape": result.local_shape(node.shape, ctx.mesh)}, result)


@partition(REDUCE)
def _reduce_partition(ctx, node):
    """Reduce locally; split reduced dims make the result a partial reduction over their axes, which the
    planner turns into an all-reduce or a reduce-scatter. Of the operand layouts (the one the result asks
    for, or the operand's own), take the one whose resharding before plus after moves fewest bytes."""
    x, target, axes = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["axes"]
    candidates = []
    for need in dict.fromkeys((_reduce_operand_for(target, x, axes), x.sharding.without_partial())):
        result = _reduced(need, axes, node.attrs["kind"])
        moved = ctx.cost(x, need) + plan_cost(result, target, node.shape, node.dtype, ctx.mesh)
        candidates.append(Strategy(moved, operands=(need,), result=result))
    best = choose(candidates)
    x = ctx.mask_padding(ctx.reshard(x, best.operands[0]), axes, reduce_identity(node.attrs["kind"], x.dtype))
    return ctx.emit_like(node, REDUCE.name, [x], node.attrs, best.result)


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
