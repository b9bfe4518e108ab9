"""The propagation and partition rules of the ``ops/slicing.py`` family, registered in ``table.py``.

Partitioning (GSPMD's elementwise-like ops): a dim that keeps its size keeps its split (propagation
runs at the elementwise level on those dims only) and is computed locally, like an unsplit dim that
changes size. A split dim that changes size takes the plan with the fewest wire bytes among:

- shift (slice / pad with stride 1 and no interior, result split alike in blocks of the same size):
  result block j is the tail of operand block j+q and the head of block j+q+1, moved by at most two
  collective_permutes of the pieces (x[1:] moves one row: a halo exchange). ``reverse`` on a split
  dim is a local reverse plus the same assembly from blocks k-1-j-q and k-2-j-q (q, r from the
  uneven padding), so it moves one block per rank.
- owned (slice / dynamic_slice): each shard writes the result entries it holds into a zero buffer;
  every entry is owned by exactly one shard, so the result is a partial sum that the planner turns
  into an all-reduce, or a reduce-scatter when the result is wanted split.
- exchange: one all_to_allv sends every result block exactly the operand rows it reads (a window map per
  dim, interior padding included) when that moves fewer bytes than the plans above.
- gather: the planner all-gathers the dim, the op runs locally, and a note names the tensor and
  its shardings.
A concatenation along a split dim reads sliced operands straight from the slices' operand: ``roll`` (the
last s rows, then the rest) on a dim split evenly is a rotation of the blocks (at most two
collective_permutes, block numbers modulo k), on an uneven one a single exchange whose window wraps
around the dim; otherwise one exchange per operand writes its rows into the result. The slices then go unused and the partitioner drops them.
``dynamic_update_slice`` on a split dim: with static starts, one exchange sends each update row to the
shard that owns its place (written into its block); with traced starts each shard writes the part of the
(replicated) update that falls in its block.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...opdef import ELEMENTWISE_LEVEL
from ...ops import core
from ...ops.slicing import (CONCATENATE, DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE, FILL_OUTSIDE, IOTA, OWNED_DYNAMIC_SLICE,
                            OWNED_DYNAMIC_UPDATE_SLICE, OWNED_SLICE, PAD, REVERSE, SLICE, clamp_starts, slice_count)
from ...ops.spmd import ALL_TO_ALLV, COLLECTIVE_PERMUTE, block_pairs
from ...sharding import Sharding, block_size
from ..propagation import combine
from ..resharding import plan_cost, window_exchange
from ..strategy import Strategy, choose
from .table import partition, propagation


# ================================================================ sharding propagation
def _on_kept_dims(s: Sharding, src_shape, dst_shape) -> Sharding:
    """``s`` on the dims whose size the op keeps; replicated on the others."""
    return Sharding(tuple(a if n == m else () for a, n, m in zip(s.dims, src_shape, dst_shape)))


@propagation(SLICE, PAD, DYNAMIC_SLICE, level=ELEMENTWISE_LEVEL)
def _sized_rule():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else _on_kept_dims(ins[0], g.nodes[node.inputs[0]].shape, node.shape)

    def bwd(node, out, ins, g, mesh):
        return [_on_kept_dims(out, node.shape, g.nodes[node.inputs[0]].shape)] + [None] * (len(ins) - 1)
    return fwd, bwd


@propagation(REVERSE, level=ELEMENTWISE_LEVEL)
def _reverse_rule():
    return (lambda node, ins, g, mesh: ins[0]), (lambda node, out, ins, g, mesh: [out])


@propagation(CONCATENATE, level=ELEMENTWISE_LEVEL)
def _concatenate_rule():
    def fwd(node, ins, g, mesh):
        return combine([_without_dim(s, node.attrs["axis"]) for s in ins if s is not None])

    def bwd(node, out, ins, g, mesh):
        return [_without_dim(out, node.attrs["axis"])] * len(ins)
    return fwd, bwd


@propagation(DYNAMIC_UPDATE_SLICE, level=ELEMENTWISE_LEVEL)
def _dynamic_update_slice_rule():
    def fwd(node, ins, g, mesh):
        update = g.nodes[node.inputs[1]].shape
        return combine([ins[0], None if ins[1] is None else _on_kept_dims(ins[1], update, node.shape)])

    def bwd(node, out, ins, g, mesh):
        update = g.nodes[node.inputs[1]].shape
        return [out, _on_kept_dims(out, node.shape, update)] + [None] * (len(ins) - 2)
    return fwd, bwd


@propagation(IOTA, level=ELEMENTWISE_LEVEL)
def _iota_rule():
    return (lambda *a: None), (lambda *a: [])


def _without_dim(s: Sharding, dim) -> Sharding:
    return Sharding(tuple(() if d == dim else a for d, a in enumerate(s.dims)))


# ================================================================ partitioning
# ---------------------------------------------------------------- iota
@partition(IOTA)
def _iota_partition(ctx, node):
    """Each shard computes its own block: indices along the split dim start at shard_index * block."""
    target, dim = ctx.sharding(node.id), node.attrs["dim"]
    axes, local = target.dims[dim], target.local_shape(node.shape, ctx.mesh)
    attrs = {**node.attrs, "shape": local}
    if ctx.mesh.axis_size(axes) == 1:
        return ctx.emit_like(node, IOTA, [], attrs, target)
    return ctx.emit_like(node, IOTA, [ctx.shard_index(axes)], {**attrs, "block": local[dim]}, target)


# ---------------------------------------------------------------- reverse
@partition(REVERSE)
def _reverse_partition(ctx, node):
    """Local reverse; a split dim then takes, for result block j, the tail of reversed block k-1-j-q and
    the head of block k-2-j-q (q, r = divmod(padding, c)): one block's bytes per rank."""
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), target)
    y = ctx.emit_like(node, REVERSE, [x], node.attrs, target)
    for d in node.attrs["axes"]:
        k = ctx.mesh.axis_size(target.dims[d])
        if k > 1:
            c = block_size(node.shape[d], k)
            q, r = divmod(k * c - node.shape[d], c)
            pieces = [(r, c, -1, k - 1 - q)] + ([(0, r, -1, k - 2 - q)] if r else [])
            y = _assemble(ctx, y, d, pieces, target, node.shape)
    return y


# ---------------------------------------------------------------- concatenate
@partition(CONCATENATE)
def _concatenate_partition(ctx, node):
    """Operands take the result's split on every other dim; along ``axis`` they are joined whole, so a
    split axis is gathered first (an expensive fallback, noted)."""
    axis, target = node.attrs["axis"], ctx.sharding(node.id)
    need = _without_dim(target, axis)
    values = [ctx.value(i) for i in node.inputs]
    split = [(i, v.sharding) for i, v in zip(node.inputs, values)
             if ctx.mesh.axis_size(v.sharding.dims[axis]) > 1]
    sources = [_slice_source(ctx, i, axis) for i in node.inputs]
    split += [(i, v.sharding) for i, (v, _) in zip(node.inputs, sources)
              if ctx.mesh.axis_size(v.sharding.dims[axis]) > 1 and i not in dict(split)]
    if split:
        gather = sum(ctx.cost(v, need) for v, _ in sources)  # a sliced operand: its operand's gather
        plans = _exchange_plans(ctx, node, sources, target)
        exchanged = gather if plans is None else min(gather, sum(a["wire_bytes"] for _, a in plans))
        rotated = _rotation(ctx, node, sources, target, exchanged)
        if rotated is not None:
            return rotated
        if exchanged < gather:
            return _emit_exchanges(ctx, node, plans, target)
        ctx.notes.append(f"concatenate %{node.id} {list(node.shape)} along split dim {axis}: gathers operands "
                         + ", ".join(f"%{i} {s}" for i, s in split) + f" to {need} and joins locally")
    args = [ctx.reshard(v, need) for v in values]
    return ctx.emit_like(node, CONCATENATE, args, node.attrs, need)


def _slice_source(ctx, vid, axis):
    """(value, (start, limit, stride)) read by operand ``vid`` of a concatenation: the operand of a slice that
    cuts only ``axis`` (its rows then move straight from where they lie, and the slice itself goes unused),
    else the operand itself, whole."""
    node = ctx.graph[vid]
    if node.op == SLICE.name:
        src, a = ctx.graph[node.inputs[0]], node.attrs
        if all((a["start"][d], a["limit"][d], a["strides"][d]) == (0, n, 1)
               for d, n in enumerate(src.shape) if d != axis):
            return ctx.value(src.id), (a["start"][axis], a["limit"][axis], a["strides"][axis])
    return ctx.value(vid), (0, node.shape[axis], 1)


def _rotation(ctx, node, sources, target, wire):
    """np.roll (x[n-s:] then x[:n-s], along a dim the result splits evenly) as a rotation of x's blocks: result
    block j is the tail of block j+q and the head of block j+q+1 (mod k), at most two collective_permutes, when
    that moves no more bytes than ``wire`` (the cheaper of the exchanges and the gather); None otherwise."""
    axis = node.attrs["axis"]
    (x, (a0, b0, s0)), (x1, (a1, b1, s1)) = sources if len(sources) == 2 else ((None, (0, 0, 0)),) * 2
    axes, n = target.dims[axis], node.shape[axis]
    k = ctx.mesh.axis_size(axes)
    if x is None or x.slot != x1.slot or (s0, s1, b0, a1, a0) != (1, 1, n, 0, b1) or target.partial or k == 1 \
            or x.shape[axis] != n:
        return None
    if n % k:  # uneven blocks: no block-periodic plan, one exchange with a wrapped window instead
        return _wrapped_exchange(ctx, node, x, a0, target, wire)
    pieces = _shift_pieces(a0, n, k)
    rows = math.prod(target.local_shape(node.shape, ctx.mesh)) // (n // k) * np.dtype(node.dtype).itemsize
    moved = ctx.cost(x, Sharding(target.dims)) + sum(hi - lo for lo, hi, _, q in pieces if q % k) * rows
    if moved > wire:
        return None
    y = ctx.reshard(x, Sharding(target.dims))
    return _assemble(ctx, y, axis, pieces, Sharding(target.dims), node.shape, cyclic=True)


def _wrapped_exchange(ctx, node, x, offset, target, wire):
    """A rotation as one all_to_allv whose window wraps around the dim (result entry p reads x[(p + offset) mod
    n]), when it moves no more than ``wire`` and no pair needs two pieces; None otherwise."""
    if x.sharding.partial:
        return None
    axis = node.attrs["axis"]
    maps = [(offset, 1, node.shape[axis], 0, node.shape[axis], 1, 1) if d == axis else None
            for d in range(len(node.shape))]
    try:
        attrs = window_exchange(x.sharding, target.dims, x.shape, ctx.mesh, maps, np.dtype(node.dtype).itemsize)
    except ValueError:  # a source block holding both ends of some target block's run
        return None
    if attrs["wire_bytes"] > wire:
        return None
    return ctx.emit(ALL_TO_ALLV, [x], attrs, Sharding(target.dims), node.shape, node.dtype)


def _exchange_plans(ctx, node, sources, target):
    """Each operand's rows sent straight to the result blocks that hold them (a sliced operand's rows read from
    the slice's operand): (value, all_to_allv attrs) per operand, None for partial sums."""
    axis, offset = node.attrs["axis"], 0
    itemsize, plans = np.dtype(node.dtype).itemsize, []
    for v, (start, limit, stride) in sources:
        if v.sharding.partial or target.partial:
            return None
        window = (start - stride * offset, stride, node.shape[axis], start, limit)
        maps = [window if d == axis else None for d in range(len(node.shape))]
        plans.append((v, window_exchange(v.sharding, target.dims, v.shape, ctx.mesh, maps, itemsize)))
        offset += slice_count(start, limit, stride)
    return plans


def _emit_exchanges(ctx, node, plans, target):
    """One all_to_allv per operand, the later ones written into the earlier result."""
    out = None
    for v, attrs in plans:
        out = ctx.emit(ALL_TO_ALLV, [v] + ([out] if out is not None else []), attrs, Sharding(target.dims),
                       node.shape, node.dtype)
    return out


# ---------------------------------------------------------------- slice
@partition(SLICE)
def _slice_partition(ctx, node):
    """Stages, each on the dims it names: local slice of unsplit dims; gather + local slice (noted);
    owned slice (partial sum); shift (collective_permutes). Slices are separable per dim."""
    x, target = ctx.value(node.inputs[0]), ctx.sharding(node.id)
    start, limit, strides = node.attrs["start"], node.attrs["limit"], node.attrs["strides"]
    if 0 in node.shape:
        return _empty(ctx, node)
    kept = [d for d in range(len(x.shape)) if node.shape[d] == x.shape[d]]
    need = _operand_need(x.sharding, target, kept)

    def shift_pieces(d):
        return _shift_pieces(start[d], x.shape[d], ctx.mesh.axis_size(need.dims[d])) if strides[d] == 1 else None
    modes, wire = _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok=True)
    if {"owned", "gather"} & set(modes.values()):
        maps = [None if d in kept else (start[d], strides[d], node.shape[d]) for d in range(len(x.shape))]
        moved = _exchanged(ctx, node, x, target, maps, wire + ctx.cost(x, need))
        if moved is not None:
            return moved
    by_mode = lambda mode: [d for d, m in sorted(modes.items()) if m == mode]
    y = ctx.reshard(x, need)
    y = _local_slice(ctx, y, [d for d in range(len(x.shape)) if d not in kept and d not in modes], node.attrs)
    if by_mode("gather"):
        y = _local_slice(ctx, _gather_dims(ctx, node, y, by_mode("gather")), by_mode("gather"), node.attrs)
    if by_mode("owned"):
        y = _owned(ctx, y, OWNED_SLICE, [], by_mode("owned"), node.shape,
                   {"start": start, "strides": strides})
    for d in by_mode("shift"):
        y = _assemble(ctx, y, d, shift_pieces(d), y.sharding, y.shape[:d] + node.shape[d:d + 1] + y.shape[d + 1:])
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


def _local_slice(ctx, v, dims, attrs):
    """v sliced as ``attrs`` says on ``dims`` (unsplit), whole on the others."""
    if not dims:
        return v
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    pick = lambda name, d, whole: attrs[name][d] if d in dims else whole
    local_attrs = {"start": tuple(pick("start", d, 0) for d in range(len(local))),
                   "limit": tuple(pick("limit", d, n) for d, n in enumerate(local)),
                   "strides": tuple(pick("strides", d, 1) for d in range(len(local)))}
    shape = tuple(slice_count(a, b, s) if d in dims else n for d, (a, b, s, n) in
                  enumerate(zip(local_attrs["start"], local_attrs["limit"], local_attrs["strides"], v.shape)))
    return ctx.emit(SLICE, [v], local_attrs, v.sharding, shape, v.dtype)


def _owned(ctx, v, op, operands, dims, sizes, attrs):
    """The owned kernel ``op`` on split ``dims`` of v (others kept whole): a partial sum over their axes."""
    blocks, shards = [-1] * len(v.shape), []
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    for d in dims:
        blocks[d] = local[d]
        shards.append(ctx.shard_index(v.sharding.dims[d]))
    shape = tuple(sizes[d] if d in dims else n for d, n in enumerate(v.shape))
    partial = v.sharding.partial + tuple(a for d in dims for a in v.sharding.dims[d])
    sharding = Sharding(tuple(() if d in dims else a for d, a in enumerate(v.sharding.dims)), partial, "sum")
    all_attrs = {"blocks": tuple(blocks), "shape": v.shape, "sizes": tuple(sizes), **attrs}
    return ctx.emit(op, [v] + operands + shards, all_attrs, sharding, shape, v.dtype)


# ---------------------------------------------------------------- pad
@partition(PAD)
def _pad_partition(ctx, node):
    """Unsplit dims pad locally; a split dim shifts blocks (no interior padding, result blocks of the
    same size) and fills what lies outside the operand, else it is gathered (noted)."""
    x, target, a = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs
    low, high, interior, value = a["low"], a["high"], a["interior"], a["value"]
    kept = [d for d in range(len(x.shape)) if (low[d], high[d], interior[d]) == (0, 0, 0)]
    need = _operand_need(x.sharding, target, kept)

    def shift_pieces(d):
        return _shift_pieces(-low[d], x.shape[d], ctx.mesh.axis_size(need.dims[d])) if not interior[d] else None
    modes, wire = _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok=False)
    shift = [d for d, m in sorted(modes.items()) if m == "shift"]
    gather = [d for d, m in sorted(modes.items()) if m == "gather"]
    if gather:  # interior padding: target entry low + q * (interior + 1) reads operand entry q
        maps = [None if d in kept else (-low[d], 1, node.shape[d], 0, x.shape[d], interior[d] + 1)
                for d in range(len(x.shape))]
        moved = _exchanged(ctx, node, x, target, maps, wire + ctx.cost(x, need), fill=value)
        if moved is not None:
            return moved
    y = ctx.reshard(x, need)
    if gather:  # before padding: the operand is the smaller
        y = _gather_dims(ctx, node, y, gather)
    local = [(0, 0, 0) if d in shift else (low[d], high[d], interior[d]) for d in range(len(x.shape))]
    if any(c != (0, 0, 0) for c in local):
        attrs = {"low": tuple(c[0] for c in local), "high": tuple(c[1] for c in local),
                 "interior": tuple(c[2] for c in local), "value": value}
        shape = tuple(x.shape[d] if d in shift else node.shape[d] for d in range(len(x.shape)))
        y = ctx.emit(PAD, [y], attrs, y.sharding, shape, node.dtype)
    for d in shift:
        y = _assemble(ctx, y, d, shift_pieces(d), y.sharding, y.shape[:d] + node.shape[d:d + 1] + y.shape[d + 1:])
        c = y.sharding.local_shape(y.shape, ctx.mesh)[d]
        attrs = {"dim": d, "block": c, "lo": low[d], "hi": low[d] + x.shape[d], "value": value}
        y = ctx.emit(FILL_OUTSIDE, [y, ctx.shard_index(y.sharding.dims[d])], attrs, y.sharding, y.shape, y.dtype)
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


# ---------------------------------------------------------------- dynamic slice / update
@partition(DYNAMIC_SLICE)
def _dynamic_slice_partition(ctx, node):
    """Split dims that change size: owned window (partial sum: all-reduce / reduce-scatter of the
    result) or gather, whichever moves fewer bytes; starts are clamped to the global dims either way.
    Stages: window the unsplit dims; gather + window (noted); owned window."""
    x, target, sizes = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["sizes"]
    starts = [ctx.value(i) for i in node.inputs[1:]]
    if 0 in node.shape:
        return _empty(ctx, node)
    kept = [d for d in range(len(x.shape)) if sizes[d] == x.shape[d]]
    need = _operand_need(x.sharding, target, kept)
    modes, _ = _choose_modes(ctx, node, x, need, target, kept, lambda d: None, owned_ok=True)
    by_mode = lambda mode: [d for d, m in sorted(modes.items()) if m == mode]
    y = ctx.reshard(x, need)
    y = _window(ctx, y, starts, [d for d in range(len(x.shape)) if d not in kept and d not in modes], sizes)
    if by_mode("gather"):
        y = _window(ctx, _gather_dims(ctx, node, y, by_mode("gather")), starts, by_mode("gather"), sizes)
    if by_mode("owned"):
        y = _owned(ctx, y, OWNED_DYNAMIC_SLICE, starts, by_mode("owned"), sizes, {})
    return dataclasses.replace(y, sharding=_result_sharding(need, target, kept, modes))


def _window(ctx, v, starts, dims, sizes):
    """v's clamped window on unsplit ``dims`` (local = global there), whole on the others."""
    if not dims:
        return v
    local = v.sharding.local_shape(v.shape, ctx.mesh)
    shape = tuple(sizes[d] if d in dims else n for d, n in enumerate(v.shape))
    local_sizes = tuple(sizes[d] if d in dims else n for d, n in enumerate(local))
    return ctx.emit(DYNAMIC_SLICE, [v] + starts, {"sizes": local_sizes}, v.sharding, shape, v.dtype)


@partition(DYNAMIC_UPDATE_SLICE)
def _dynamic_update_slice_partition(ctx, node):
    """x keeps its split; the update is replicated on the dims it does not cover whole, and each shard
    writes the part of it that falls in its block: no communication beyond the update's resharding."""
    target, update = ctx.sharding(node.id), ctx.value(node.inputs[1])
    x = ctx.reshard(ctx.value(node.inputs[0]), target)
    placed = _update_by_exchange(ctx, node, x, update, target)
    if placed is not None:
        return placed
    starts = [ctx.value(i) for i in node.inputs[2:]]
    kept = [d for d in range(len(x.shape)) if update.shape[d] == x.shape[d]]
    need = Sharding(tuple(target.dims[d] if d in kept else () for d in range(len(x.shape))))
    gathered = [d for d in range(len(x.shape)) if d not in kept and ctx.mesh.axis_size(update.sharding.dims[d]) > 1]
    if gathered:
        ctx.notes.append(f"dynamic_update_slice %{node.id}: the update %{node.inputs[1]} {list(update.shape)} is "
                         f"replicated on dims {gathered} ({update.sharding} -> {need}) to be written into x {target}")
    update = ctx.reshard(update, need)
    split = [d for d in range(len(x.shape)) if d not in kept and ctx.mesh.axis_size(target.dims[d]) > 1]
    if not split:
        return ctx.emit_like(node, DYNAMIC_UPDATE_SLICE, [x, update] + starts, {}, target)
    local = target.local_shape(x.shape, ctx.mesh)
    blocks = tuple(-1 if d in kept else local[d] if d in split else 0 for d in range(len(x.shape)))
    shards = [ctx.shard_index(target.dims[d]) for d in split]
    attrs = {"blocks": blocks, "shape": x.shape, "sizes": update.shape}
    return ctx.emit_like(node, OWNED_DYNAMIC_UPDATE_SLICE, [x, update] + starts + shards, attrs, target)


def _update_by_exchange(ctx, node, x, update, target):
    """With static starts, one all_to_allv sends each update row straight to the shard that owns its place in x,
    written into x's block (at most the update's bytes; rows already home stay), when that moves no more than
    replicating the update would; None otherwise (traced starts, partial sums)."""
    consts = [ctx.graph[i] for i in node.inputs[2:]]
    if any(c.op != core.CONSTANT.name for c in consts) or target.partial or update.sharding.partial \
            or not update.sharding.axes:  # a replicated update is written locally, no collective at all
        return None
    starts = clamp_starts([np.asarray(c.attrs["value"]).item() for c in consts], x.shape, update.shape)
    maps = [(-s, 1, n, 0, m) for s, n, m in zip(starts, x.shape, update.shape)]
    attrs = window_exchange(update.sharding, target.dims, update.shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize)
    replicate = ctx.cost(update, Sharding(((),) * len(x.shape)))
    if attrs["wire_bytes"] > replicate:
        return None
    return ctx.emit(ALL_TO_ALLV, [update, x], attrs, target, node.shape, node.dtype)


# ---------------------------------------------------------------- planning helpers
def _operand_need(src: Sharding, target: Sharding, kept) -> Sharding:
    """The target's split on the dims the op keeps (elementwise-like); on the others the operand's own
    split, where no kept dim of the target uses its axes."""
    used = {a for d in kept for a in target.dims[d]}
    return Sharding(tuple(target.dims[d] if d in kept else () if used & set(axes) else axes
                          for d, axes in enumerate(src.dims)))


def _choose_modes(ctx, node, x, need, target, kept, shift_pieces, owned_ok) -> tuple[dict[int, str], float]:
    """'shift', 'owned' or 'gather' per split dim that changes size, the fewest wire bytes winning
    (ties in that order), and the bytes of the choices; bool data never takes 'owned' (its partial sum is
    not an MPI reduction)."""
    mesh, modes, wire = ctx.mesh, {}, 0.0
    local = need.local_shape(x.shape, mesh)
    for d, axes in enumerate(need.dims):
        k = mesh.axis_size(axes)
        if d in kept or k == 1:
            continue
        n, m, tgt = x.shape[d], node.shape[d], target.dims[d]
        rows = math.prod(local[e] if mesh.axis_size(need.dims[e]) > 1 else node.shape[e]
                         for e in range(len(local)) if e != d)
        options = []
        pieces = shift_pieces(d) if tgt == axes and block_size(m, k) == block_size(n, k) else None
        if pieces is not None:
            moved = sum(hi - lo for lo, hi, sign, shift in pieces if (sign, shift) != (1, 0))
            options.append(Strategy(moved * rows * np.dtype(x.dtype).itemsize, plan="shift"))
        one_dim = lambda src, dst, size: plan_cost(src, dst, (size,), x.dtype, mesh) * rows
        to_target = Sharding((tgt,)) if tgt and mesh.axis_size(tgt) <= m else Sharding(((),))
        if owned_ok and np.dtype(x.dtype) != np.bool_:
            options.append(Strategy(one_dim(Sharding(((),), axes), to_target, m), plan="owned"))
        options.append(Strategy(one_dim(Sharding((axes,)), Sharding(((),)), n), plan="gather"))
        best = choose(options)
        modes[d], wire = best.plan, wire + best.wire
    return modes, wire


def _exchanged(ctx, node, x, target, maps, wire, fill=0, into=None):
    """The op as ONE all_to_allv from the operand's blocks straight to the target's (``maps``: per dim the
    (offset, stride, size) window, see exchange.window_parts) when that moves fewer bytes than ``wire``
    (the gather / owned-sum plan); None otherwise, or for partial sums."""
    if x.sharding.partial or target.partial:
        return None
    attrs = window_exchange(x.sharding, target.dims, x.shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize, fill)
    if attrs["wire_bytes"] >= wire:
        return None
    return ctx.emit(ALL_TO_ALLV, [x] + ([into] if into is not None else []), attrs, Sharding(target.dims),
                    node.shape, node.dtype)


def _gather_dims(ctx, node, v, dims):
    """v with split ``dims`` gathered whole (an expensive fallback, noted)."""
    whole = Sharding(tuple(() if d in dims else a for d, a in enumerate(v.sharding.dims)), v.sharding.partial,
                     v.sharding.reduce_op)
    ctx.notes.append(f"{node.op} %{node.id} {list(ctx.graph[node.inputs[0]].shape)}->{list(node.shape)}: operand "
                     f"%{node.inputs[0]} is gathered on split dims {dims} ({v.sharding} -> {whole}) and "
                     f"{node.op} runs locally")
    return ctx.reshard(v, whole)


def _result_sharding(need, target, kept, modes) -> Sharding:
    """Kept dims as the target, shifted dims as the operand, owned dims partial sums, the rest unsplit."""
    dims = tuple(target.dims[d] if d in kept else axes if modes.get(d) == "shift" else ()
                 for d, axes in enumerate(need.dims))
    partial = tuple(a for d, m in sorted(modes.items()) if m == "owned" for a in need.dims[d])
    return Sharding(dims, partial, "sum")


def _shift_pieces(offset, n, k):
    """Result block j when result entry p reads operand entry p + offset, both in blocks of c: the tail
    [r, c) of block j+q, then the head [0, r) of block j+q+1. A piece is (lo, hi, sign, shift): it comes
    from block sign*j + shift."""
    c = block_size(n, k)
    q, r = divmod(offset, c)
    return [(r, c, 1, q)] + ([(0, r, 1, q + 1)] if r else [])


def _assemble(ctx, v, d, pieces, sharding, shape, cyclic=False):
    """Result block of dim d from pieces of other shards' blocks: slice, collective_permute, concatenate
    (``cyclic``: block numbers modulo k, a rotation)."""
    local, parts = list(v.sharding.local_shape(v.shape, ctx.mesh)), []
    axes, k = v.sharding.dims[d], ctx.mesh.axis_size(v.sharding.dims[d])
    for lo, hi, sign, shift in pieces:
        part_local = local[:d] + [hi - lo] + local[d + 1:]
        part = v
        if (lo, hi) != (0, local[d]):
            attrs = {"start": tuple(lo if e == d else 0 for e in range(len(local))),
                     "limit": tuple(hi if e == d else s for e, s in enumerate(local)), "strides": (1,) * len(local)}
            part = ctx.emit(SLICE, [v], attrs, v.sharding, v.shape, v.dtype, part_local)
        if (sign, shift % k if cyclic else shift) != (1, 0):
            pairs = block_pairs(ctx.mesh, axes, sign, shift, cyclic)
            part = ctx.emit(COLLECTIVE_PERMUTE, [part], {"pairs": pairs}, v.sharding, v.shape, v.dtype, part_local)
        parts.append(part)
    if len(parts) == 1:
        return dataclasses.replace(parts[0], sharding=sharding, shape=tuple(shape))
    return ctx.emit(CONCATENATE, parts, {"axis": d}, sharding, shape, v.dtype)


def _empty(ctx, node):
    """A result with no entries is a constant."""
    value = np.zeros(node.shape, node.dtype)
    return ctx.emit_like(node, core.CONSTANT, [], {"value": value}, Sharding.replicated(len(node.shape)))
