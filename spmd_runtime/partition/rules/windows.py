"""The propagation and partition rules of the ``ops/windows.py`` family (conv, reduce_window, cumsum), registered
in ``table.py``, with the halo plans and halo exchange they emit.

Partitioning (GSPMD section 3, spatial partitioning):

- A split windowed dim keeps its split. Shard i owns the canonical ceil-size block i of the OUTPUT
  dim; ``halo_plan`` works out which input elements those outputs read. Shard i gets the last
  ``left`` elements of shard i-1 and the first ``right`` of shard i+1 by two collective-permutes
  (the edge ranks receive zeros), cuts the window it reads out of that extended block at an offset
  that may grow linearly with i (stride != 1 or shrinking VALID windows), and sets every element
  outside the global dim to the padding value (uneven-shard padding, global edges), then runs the
  op locally with local padding. A halo wider than a shard comes from the shards further on, one
  collective-permute per hop (each moves only the rows the windows read). Where an lhs dilation puts
  the window at a different phase on each shard, each shard cuts its window from the dilated input
  (zeros in the holes) and runs the op without lhs dilation. Where a halo would need more than the
  other shards hold, the dim is resharded to replicated instead and the program's notes say so.
- conv: batch and output-feature splits are local; an input-feature split on both operands gives
  partial sums (like einsum's contracting dims); with feature groups the feature dims may be split
  together, whole groups per shard. Candidates are ranked by bytes moved, then local work.
- window_select reads its windows as reduce_window does (NaN as the halo fill: never a window's result);
  window_scatter, x-shaped from result-shaped operands, gets by a halo exchange the cotangents and chosen taps
  of every window that reaches its block (``scatter_plan``) and scatters them locally with an offset that
  grows with the shard index.
- cumsum along a split dim: local cumsum of the masked block, all-gather of the k block totals (one
  element per shard along the dim), then each shard adds the sum of the totals before it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ...opdef import BROADCAST_LEVEL, DOT_LEVEL, lookup
from ...ops import core
from ...ops.slicing import CONCATENATE
from ...ops.spmd import ALL_GATHER, COLLECTIVE_PERMUTE, block_pairs
from ...ops.windows import (CONV, CUMSUM, CUMSUM_CARRY, HALO_WINDOW, REDUCE_WINDOW, WINDOW_EDGE, WINDOW_SCATTER,
                            WINDOW_SELECT, out_size)
from ...sharding import Sharding, block_size
from ..propagation import combine
from ..resharding import plan_cost
from ..strategy import Strategy, choose, distinct
from .table import partition, propagation


# ================================================================ halo plans
@dataclass(frozen=True)
class HaloPlan:
    """How every shard of a dim split k ways computes its block of the windowed op's output locally.

    Shard i extends its input block (``block`` elements) by ``left`` elements of shard i-1 and
    ``right`` of shard i+1, reads ``length`` elements from offset ``start + step * i`` of that
    extended block, and runs the op with local padding ``pad``: exactly ``out_block`` outputs.
    With ``dilation`` > 1 (an lhs dilation whose window phase differs between shards) the shard instead cuts
    ``length`` positions of the DILATED input, from dilated position ``start + step * i`` on (zeros in the
    holes), and runs the op without lhs dilation.
    """
    block: int
    out_block: int
    left: int
    right: int
    start: int
    step: int
    length: int
    pad: tuple[int, int]
    dilation: int = 1

    def is_local(self, n: int, k: int) -> bool:
        """True when the block itself is what the window reads: no exchange, no cut, no padding to mask."""
        return (self.left == self.right == self.start == self.step == 0 and self.length == self.block
                and n % k == 0 and self.dilation == 1)


def halo_plan(n, k, window, stride=1, padding=(0, 0), lhs_dilation=1, rhs_dilation=1) -> HaloPlan | str:
    """The HaloPlan of a windowed dim of size ``n`` split into k canonical blocks, or why there is none.

    Output block i (ceil(m / k) outputs) reads dilated input positions from i * co * stride - low on;
    only the shards holding real outputs count (the others compute padding).
    """
    lo, hi = padding
    c, span_w = block_size(n, k), (window - 1) * rhs_dilation + 1
    m = out_size(n, window, stride, padding, lhs_dilation, rhs_dilation)
    co = block_size(m, k)
    firsts, lasts, phases = {}, {}, set()
    for i in range(k):
        if i * co >= m:
            break
        begin = i * co * stride - lo  # first dilated position output block i reads
        end = (min((i + 1) * co, m) - 1) * stride - lo + span_w  # one past its last
        firsts[i], lasts[i] = -(-begin // lhs_dilation), (end - 1) // lhs_dilation
        phases.add(firsts[i] * lhs_dilation - begin)
    left = max(0, max(i * c - f for i, f in firsts.items()))
    right = max(0, max(last - (i + 1) * c + 1 for i, last in lasts.items()))
    if max(left, right) > (k - 1) * c:
        return f"the halo ({left} left, {right} right) is wider than the other {k - 1} shards ({c} each)"
    if len(phases) > 1:  # the window starts at a different phase on each shard: cut it from the dilated input
        span = (co - 1) * stride + span_w
        return HaloPlan(c, co, left, right, -lo, co * stride, span, (0, 0), lhs_dilation)
    # one phase: firsts[i] = (i * co * stride - lo + phase) / lhs_dilation, linear in i
    starts = [left + f - i * c for i, f in firsts.items()]
    step = starts[1] - starts[0] if len(starts) > 1 else 0
    phase, span = phases.pop(), (co - 1) * stride + span_w
    # a window that reads only dilation holes still takes one element (cropped again by a negative pad)
    length = max(1, (span - 1 - phase) // lhs_dilation + 1)
    return HaloPlan(c, co, left, right, starts[0], step, length,
                    (phase, span - phase - (length - 1) * lhs_dilation - 1))


def shift_pairs(mesh, axes, shift: int) -> tuple[tuple[int, int], ...]:
    """(sender, receiver) world ranks: every shard along ``axes`` sends to the shard ``shift`` further
    on, at the same position on the other axes; nobody sends past the ends (those receive zeros)."""
    return tuple(block_pairs(mesh, axes, 1, -shift))


def extend_with_halo(ctx, value, dim, axes, plan: HaloPlan, fill):
    """``value``'s block of ``dim`` cut to what the shard's window reads: halo exchange + halo_window."""
    n, k = value.shape[dim], ctx.mesh.axis_size(axes)
    if plan.is_local(n, k):
        return value
    halos = [_halo(ctx, value, dim, axes, plan.block, width, side) for width, side in ((plan.left, 1), (plan.right, -1))
             if width]
    local = ctx.local_shape(value)
    local[dim] = plan.length
    attrs = {"dim": dim, "left": plan.left, "right": plan.right, "block": plan.block, "size": n,
             "start": plan.start, "step": plan.step, "length": plan.length, "fill": fill}
    attrs.update({"dilation": plan.dilation} if plan.dilation > 1 else {})
    return ctx.emit(HALO_WINDOW, [value, *halos, ctx.shard_index(axes)], attrs, value.sharding, value.shape,
                    value.dtype, local)


def _halo(ctx, value, dim, axes, block, width, side):
    """The ``width`` elements of ``dim`` just before (side 1) or after (side -1) this shard's block: the
    neighbour's edge, or, when wider than a block, whole blocks of the shards further on (one collective_permute
    per hop, nearest last on the left and first on the right), joined in global order."""
    parts = []
    for hop in range(1, -(-width // block) + 1):
        lo, hi = (max(0, hop * block - width), block) if side == 1 else (0, min(block, width - (hop - 1) * block))
        local = ctx.local_shape(value)
        local[dim] = hi - lo
        edge = ctx.emit(WINDOW_EDGE, [value], {"dim": dim, "start": lo, "stop": hi}, value.sharding, value.shape,
                        value.dtype, local)
        parts.append(ctx.emit(COLLECTIVE_PERMUTE, [edge], {"pairs": shift_pairs(ctx.mesh, axes, side * hop)},
                              value.sharding, value.shape, value.dtype, local))
    if len(parts) == 1:
        return parts[0]
    local = ctx.local_shape(value)
    local[dim] = width
    return ctx.emit(CONCATENATE, parts[::-1] if side == 1 else parts, {"axis": dim}, value.sharding, value.shape,
                    value.dtype, local)


def _halo_bytes(plan: HaloPlan, local_shape, dim, dtype) -> float:
    """Bytes the two collective-permutes of a halo exchange put on the wire, per rank."""
    row = math.prod(local_shape) // max(local_shape[dim], 1)
    return float((plan.left + plan.right) * row * np.dtype(dtype).itemsize)


# ================================================================ propagation
@propagation(REDUCE_WINDOW, CUMSUM, WINDOW_SELECT, WINDOW_SCATTER, level=BROADCAST_LEVEL)
def _windowed_like_elementwise():
    """Every dim keeps its split (legalised to the result's sizes); every operand has the result's rank."""
    forward = lambda node, ins, g, mesh: combine(list(ins))
    backward = lambda node, out, ins, g, mesh: [out] * len(ins)
    return forward, backward


@propagation(CONV, level=DOT_LEVEL)
def _conv_propagation():
    """Batch and spatial dims map like elementwise, output features to rhs dim 0, input features between
    the operands (as einsum's contracting letters); with feature groups, lhs features map to the
    output's when every shard can hold whole groups."""
    def forward(node, ins, g, mesh):
        (lhs, rhs), nsp = ins, len(node.shape) - 2
        cands = []
        if lhs is not None:
            cands.append(Sharding((lhs.dims[0], _whole_groups(node, lhs.dims[1], mesh)) + lhs.dims[2:]))
        if rhs is not None:
            cands.append(Sharding(((), rhs.dims[0]) + ((),) * nsp))
        return combine(cands)

    def backward(node, out, ins, g, mesh):
        (lhs, rhs), nsp, grouped = ins, len(node.shape) - 2, node.attrs["groups"] > 1
        lhs_c = _whole_groups(node, out.dims[1], mesh) if grouped else rhs.dims[1] if rhs is not None else ()
        rhs_c = () if grouped or lhs is None else lhs.dims[1]
        return [_distinct_axes((out.dims[0], lhs_c) + out.dims[2:]), _distinct_axes((out.dims[1], rhs_c) + ((),) * nsp)]
    return forward, backward


def _whole_groups(node, axes, mesh) -> tuple[str, ...]:
    """``axes`` when splitting a grouped conv's features over them keeps whole groups per shard, else ()."""
    groups = node.attrs["groups"]
    return axes if groups > 1 and groups % mesh.axis_size(axes) == 0 else ()


def _distinct_axes(dims) -> Sharding:
    """Drop a dim's axes when an earlier dim already uses one of them."""
    used, out = set(), []
    for d in dims:
        keep = d if not used & set(d) else ()
        used.update(keep)
        out.append(keep)
    return Sharding(tuple(out))


# ================================================================ partition rules
@dataclass
class _Layout:
    lhs: Sharding
    rhs: Sharding
    result: Sharding
    plans: dict  # spatial index -> HaloPlan, for split spatial dims
    group_shards: int


@partition(CONV)
def _conv(ctx, node):
    """Pick per role (batch, features, each spatial dim) the split that moves the fewest bytes, then
    the least local work; spatial splits need a halo plan, else that dim is replicated (noted)."""
    lhs, rhs, target = ctx.value(node.inputs[0]), ctx.value(node.inputs[1]), ctx.sharding(node.id)
    options, plans, refused = _conv_options(ctx, node, lhs, rhs, target)
    costs = {}
    cost = lambda v, s: costs.setdefault((v.slot, s), ctx.cost(v, s))

    def strategies():
        for choice in itertools.product(*options.values()):
            split = dict(zip(options, choice))
            if not distinct(split) or any(split[f"s{j}"] and split[f"w{j}"] for j in range(len(node.shape) - 2)):
                continue
            lay = _conv_layout(ctx, node, split, plans)
            local_lhs = lay.lhs.local_shape(lhs.shape, ctx.mesh)
            moved = cost(lhs, lay.lhs) + cost(rhs, lay.rhs) + plan_cost(lay.result, target, node.shape, node.dtype,
                                                                        ctx.mesh)
            moved += sum(_halo_bytes(p, local_lhs, 2 + j, node.dtype) for j, p in lay.plans.items())
            work = math.prod(lay.result.local_shape(node.shape, ctx.mesh)) * local_lhs[1]
            # ties (size-1 axes move nothing) go to the layouts the values already have
            changes = (lay.lhs != lhs.sharding) + (lay.rhs != rhs.sharding) + (lay.result != target)
            yield Strategy(moved, 2 * work, (lay.lhs, lay.rhs), lay.result, plan=(lay, split), tiebreak=changes)
    lay, split = choose(strategies()).plan
    for role, (axes, why) in refused.items():
        if split[role] != axes and split.get("w" + role[1:]) != axes:
            what = "features" if role == "g" else f"spatial dim {2 + int(role[1:])}"
            ctx.notes.append(f"conv %{node.id}: lhs {what} split over {axes} cannot be computed locally ({why}); "
                             f"that dim is resharded to replicated")
    return _emit_conv(ctx, node, lhs, rhs, lay, split)


def _conv_roles(node) -> dict[str, list[tuple[int, int]]]:
    """Role -> the (operand, dim) places it occupies: operand 0 lhs, 1 rhs, 2 result."""
    nsp = len(node.shape) - 2
    roles = {"n": [(0, 0), (2, 0)]}
    if node.attrs["groups"] > 1:
        roles["g"] = [(0, 1), (1, 0), (2, 1)]  # whole feature groups per shard
    else:
        roles.update(o=[(1, 0), (2, 1)], c=[(0, 1), (1, 1)])
    roles.update({f"s{j}": [(0, 2 + j), (2, 2 + j)] for j in range(nsp)})
    # a spatial dim contracted: lhs positions and window taps split alike (the kernel-gradient convolution)
    roles.update({f"w{j}": [(1, 2 + j), (0, 2 + j)] for j in range(nsp)})
    return roles


def _conv_options(ctx, node, lhs, rhs, target):
    """Candidate axes per role (unsplit, or as an operand or the result splits it) that can work; the
    halo plans of the spatial ones; the lhs splits refused, and why."""
    shapes, shardings = (lhs.shape, rhs.shape, node.shape), (lhs.sharding, rhs.sharding, target)
    options, plans, refused = {}, {}, {}
    for role, places in _conv_roles(node).items():
        options[role] = [()]
        for which, dim in places:
            axes, size = shardings[which].dims[dim], shapes[which][dim]
            if not axes or axes in options[role] or ctx.mesh.axis_size(axes) > size:
                continue
            plan = _role_plan(node, role, lhs.shape, rhs.shape, ctx.mesh.axis_size(axes))
            if isinstance(plan, str):
                if which == 0 and role[0] != "w":  # a contraction is only an alternative: the s role notes
                    refused.setdefault(role, (axes, plan))
                continue
            if plan is not None:
                plans[(role, axes)] = plan
            options[role].append(axes)
    return options, plans, refused


def _role_plan(node, role, lhs_shape, rhs_shape, k) -> HaloPlan | str | None:
    """A spatial role's halo plan over k shards, None for other roles that can split k ways, or why not."""
    a = node.attrs
    if role == "g" and a["groups"] % k:
        return f"{a['groups']} feature groups do not divide into {k} shards"
    if role[0] not in "sw" or k == 1:  # a size-1 axis splits nothing: the op keeps its global padding
        return None
    j = int(role[1:])
    args = (lhs_shape[2 + j], k, rhs_shape[2 + j], a["strides"][j], a["padding"][j], a["lhs_dilation"][j],
            a["rhs_dilation"][j])
    return halo_plan(*args) if role[0] == "s" else contracted_plan(*args)


def contracted_plan(n, k, window, stride=1, padding=(0, 0), lhs_dilation=1, rhs_dilation=1) -> HaloPlan | str:
    """The plan of a spatial dim whose input positions (n, canonical blocks of c) and window taps (blocks of cw)
    are both split k ways: shard i convolves its taps [i*cw, i*cw + cw) with the input positions they meet,
    from i*cw*rhs_dilation - low on, for ALL m outputs, giving a partial sum of the result (the
    kernel-gradient convolution: a local conv, then a reduction of the output)."""
    if lhs_dilation != 1:
        return f"lhs dilation {lhs_dilation} on a contracted spatial dim"
    lo, hi = padding
    c, cw = block_size(n, k), block_size(window, k)
    m = out_size(n, window, stride, padding, 1, rhs_dilation)
    length = (m - 1) * stride + (cw - 1) * rhs_dilation + 1
    begins = [i * cw * rhs_dilation - lo for i in range(k) if i * cw < window]
    left = max(0, max(i * c - g for i, g in enumerate(begins)))
    right = max(0, max(g + length - (i + 1) * c for i, g in enumerate(begins)))
    if max(left, right) > (k - 1) * c:
        return f"the halo ({left} left, {right} right) is wider than the other {k - 1} shards ({c} each)"
    return HaloPlan(c, m, left, right, left - lo, cw * rhs_dilation - c, length, (0, 0))


def _conv_layout(ctx, node, split, plans) -> _Layout:
    nsp, grouped = len(node.shape) - 2, "g" in split
    feat_in, feat_out = (split["g"], split["g"]) if grouped else (split["c"], split["o"])
    spatial = tuple(split[f"s{j}"] for j in range(nsp))
    taps = tuple(split[f"w{j}"] for j in range(nsp))
    summed = {a for axes in taps for a in axes} | set(() if grouped else split["c"])
    partial = tuple(a for a in ctx.mesh.axis_names if a in summed)
    lhs = Sharding((split["n"], feat_in) + tuple(s or w for s, w in zip(spatial, taps)))
    rhs = Sharding((feat_out, () if grouped else split["c"]) + taps)
    result = Sharding((split["n"], feat_out) + spatial, partial)
    chosen = {j: plans[(role, axes)] for j in range(nsp) for role, axes in ((f"s{j}", spatial[j]), (f"w{j}", taps[j]))
              if (role, axes) in plans}
    return _Layout(lhs, rhs, result, chosen, ctx.mesh.axis_size(split["g"]) if grouped else 1)


def _emit_conv(ctx, node, lhs, rhs, lay: _Layout, split):
    a, b = ctx.reshard(lhs, lay.lhs), ctx.reshard(rhs, lay.rhs)
    if split.get("c"):  # contracting over a split (maybe uneven) feature dim: padding must add nothing
        a, b = ctx.mask_padding(a, [1], 0), ctx.mask_padding(b, [1], 0)
    b = ctx.mask_padding(b, [2 + j for j in range(len(node.shape) - 2) if split[f"w{j}"]], 0)  # taps past the end
    pads, lhs_dilation = list(node.attrs["padding"]), list(node.attrs["lhs_dilation"])
    for j, plan in lay.plans.items():
        a = extend_with_halo(ctx, a, 2 + j, lay.lhs.dims[2 + j], plan, 0)
        pads[j] = plan.pad
        lhs_dilation[j] = 1 if plan.dilation > 1 else lhs_dilation[j]  # the window is cut already dilated
    attrs = {**node.attrs, "padding": tuple(pads), "lhs_dilation": tuple(lhs_dilation),
             "groups": node.attrs["groups"] // lay.group_shards}
    return ctx.emit_like(node, CONV, [a, b], attrs, lay.result)


@partition(REDUCE_WINDOW, WINDOW_SELECT)
def _reduce_window(ctx, node):
    """Split dims keep their split where a halo plan exists (else they are replicated, noted); of the
    operand's and the result's layouts, the one moving fewer bytes (then doing less work) wins. window_select
    (max pooling's gradient: the chosen tap of each window) reads its windows alike, with NaN as padding (never
    equal to a result), and takes the result-shaped pooled values in the result's layout."""
    x, extra, target = ctx.value(node.inputs[0]), [ctx.value(v) for v in node.inputs[1:]], ctx.sharding(node.id)
    candidates = []
    for cand in dict.fromkeys((x.sharding, target)):
        need, plans, refused = _window_layout(ctx, node, x.shape, cand)
        local = need.local_shape(x.shape, ctx.mesh)
        moved = ctx.cost(x, need) + plan_cost(need, target, node.shape, node.dtype, ctx.mesh)
        moved += sum(ctx.cost(v, need) for v in extra)
        moved += sum(_halo_bytes(p, local, d, x.dtype) for d, p in plans.items())
        # the window work is the same whatever the split: ties go to less local output, then fewer changes
        work, changes = math.prod(need.local_shape(node.shape, ctx.mesh)), (need != x.sharding) + (need != target)
        candidates.append(Strategy(moved, operands=(need,) * (1 + len(extra)), result=need, tiebreak=(work, changes),
                                   plan=(plans, refused if cand == x.sharding else {})))
    best = choose(candidates)
    need, (plans, refused) = best.result, best.plan
    _note_refused(ctx, node, refused)
    fill = np.nan if extra else core.reduce_identity(node.attrs["kind"], node.dtype)
    value, pads = ctx.reshard(x, need), list(node.attrs["padding"])
    for d, plan in plans.items():
        value = extend_with_halo(ctx, value, d, need.dims[d], plan, fill)
        pads[d] = plan.pad
    operands = [value] + [ctx.reshard(v, need) for v in extra]
    return ctx.emit_like(node, lookup(node.op), operands, {**node.attrs, "padding": tuple(pads)}, need)


def scatter_plan(n, m, k, window, stride, low) -> HaloPlan | str:
    """How shard i of an x dim of size n (blocks of c) gets the window_scatter contributions of its elements:
    the outputs o (m of them, blocks of co) whose taps reach [i*c, i*c + c), o * stride + t - low for t in
    [0, window), come from its own output block and ``left`` / ``right`` outputs of its neighbours' (a halo
    exchange of the cotangents and the taps; entries past the global outputs hold the fill and route nothing).
    The local scatter then runs with low = low + left * stride + i * (c - co * stride)."""
    c, co = block_size(n, k), block_size(m, k)
    left = right = 0
    for i in range(k):
        if i * c >= n:
            break
        first = max(0, -((i * c + low - window + 1) // -stride))  # ceil((i*c + low - window + 1) / stride)
        last = min(m - 1, (min((i + 1) * c, n) - 1 + low) // stride)
        if first <= last:
            left, right = max(left, i * co - first), max(right, last - (i + 1) * co + 1)
    if max(left, right) > (k - 1) * co:
        return f"the halo ({left} left, {right} right) is wider than the other {k - 1} shards ({co} each)"
    return HaloPlan(co, c, left, right, 0, 0, left + co + right, (0, 0))


@partition(WINDOW_SCATTER)
def _window_scatter(ctx, node):
    """Split x dims keep their split where a scatter plan exists (else replicated, noted): every shard gathers
    the cotangents and taps of the windows that reach its block by a halo exchange, then scatters locally."""
    g, taps, target = ctx.value(node.inputs[0]), ctx.value(node.inputs[1]), ctx.sharding(node.id)
    a, candidates = node.attrs, []
    for cand in dict.fromkeys((target, g.sharding)):
        dims, plans, refused = [], {}, {}
        for d, axes in enumerate(cand.dims):
            k = ctx.mesh.axis_size(axes)
            if k > 1 and (a["window"][d], a["strides"][d], a["low"][d]) != (1, 1, 0):
                plan = scatter_plan(node.shape[d], g.shape[d], k, a["window"][d], a["strides"][d], a["low"][d])
                if isinstance(plan, str):
                    refused[d], axes = (axes, plan), ()
                else:
                    plans[d] = plan
            dims.append(axes)
        need = Sharding(tuple(dims))
        local = need.local_shape(g.shape, ctx.mesh)
        moved = ctx.cost(g, need) + ctx.cost(taps, need) + plan_cost(need, target, node.shape, node.dtype, ctx.mesh)
        moved += sum(_halo_bytes(p, local, d, g.dtype) + _halo_bytes(p, local, d, taps.dtype) for d, p in plans.items())
        changes = (need != g.sharding) + (need != target)
        candidates.append(Strategy(moved, operands=(need, need), result=need, tiebreak=changes,
                                   plan=(plans, refused if cand == target else {})))
    best = choose(candidates)
    need, (plans, refused) = best.result, best.plan
    _note_refused(ctx, node, refused)
    gv, tv = ctx.reshard(g, need), ctx.reshard(taps, need)
    low, step, index = list(a["low"]), [0] * len(node.shape), []
    for d, plan in plans.items():
        gv = extend_with_halo(ctx, gv, d, need.dims[d], plan, 0)
        tv = extend_with_halo(ctx, tv, d, need.dims[d], plan, -1)
        low[d] += plan.left * a["strides"][d]
        step[d] = plan.out_block - plan.block * a["strides"][d]
        index.append(ctx.shard_index(need.dims[d]))
    attrs = {**a, "low": tuple(low), "shape": tuple(need.local_shape(node.shape, ctx.mesh))}
    attrs.update({"low_step": tuple(step), "index_dims": tuple(plans)} if plans else {})
    return ctx.emit_like(node, WINDOW_SCATTER, [gv, tv, *index], attrs, need)


def _note_refused(ctx, node, refused):
    for d, (axes, why) in refused.items():
        ctx.notes.append(f"{node.op} %{node.id}: dim {d} split over {axes} cannot be computed locally with a "
                         f"halo exchange ({why}); that dim is resharded to replicated")


def _window_layout(ctx, node, shape, cand: Sharding):
    """``cand`` with the dims no halo plan can serve replicated; the plans; the refused dims and why."""
    a, dims, plans, refused = node.attrs, [], {}, {}
    for d, axes in enumerate(cand.dims):
        if ctx.mesh.axis_size(axes) > 1:
            plan = halo_plan(shape[d], ctx.mesh.axis_size(axes), a["window"][d], a["strides"][d], a["padding"][d])
            if isinstance(plan, str):
                refused[d], axes = (axes, plan), ()
            else:
                plans[d] = plan
        dims.append(axes)
    return Sharding(tuple(dims)), plans, refused


@partition(CUMSUM)
def _cumsum(ctx, node):
    """Along a split axis: cumsum of the masked block, all-gather of the k block totals, then each
    shard adds the totals of the shards before it. Other dims are local."""
    x, target, axis = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["axis"]

    def moved(s: Sharding) -> float:
        carry = 0.0
        if ctx.mesh.axis_size(s.dims[axis]) > 1:  # all-gather of one element per shard along the axis
            row = math.prod(s.local_shape(node.shape, ctx.mesh)) // s.local_shape(node.shape, ctx.mesh)[axis]
            k = ctx.mesh.axis_size(s.dims[axis])
            carry = (k - 1) * row * np.dtype(node.dtype).itemsize
        return ctx.cost(x, s) + plan_cost(s, target, node.shape, node.dtype, ctx.mesh) + carry
    need = choose(Strategy(moved(s), operands=(s,), result=s, tiebreak=s != x.sharding)
                  for s in dict.fromkeys((target, x.sharding))).result
    value, axes = ctx.reshard(x, need), need.dims[axis]
    if ctx.mesh.axis_size(axes) == 1:
        return ctx.emit_like(node, CUMSUM, [value], node.attrs, need)
    local = ctx.emit_like(node, CUMSUM, [ctx.mask_padding(value, [axis], 0)], node.attrs, need)
    block, k = ctx.local_shape(local)[axis], ctx.mesh.axis_size(axes)
    shape = node.shape[:axis] + (k,) + node.shape[axis + 1:]
    totals = ctx.emit(WINDOW_EDGE, [local], {"dim": axis, "start": block - 1, "stop": block}, need, shape,
                      node.dtype)
    gathered_layout = need.with_dims(tuple(() if d == axis else s for d, s in enumerate(need.dims)))
    gathered = ctx.emit(ALL_GATHER, [totals], {"axes": axes, "dim": axis}, gathered_layout, shape, node.dtype)
    return ctx.emit_like(node, CUMSUM_CARRY, [local, gathered, ctx.shard_index(axes)], {"axis": axis}, need)

