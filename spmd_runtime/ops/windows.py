"""Windowed ops: convolution, reduce_window (pooling) and cumsum, partitioned with halo exchange.

Global semantics are XLA's (``ConvGeneralDilated``, ``ReduceWindow``) and NumPy's (``cumsum``):

- ``conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, feature_group_count)``: lhs is
  (N, C, *spatial), rhs is (O, C / groups, *window), the result (N, O, *out_spatial), for 1 to 3 (or
  more) spatial dims. ``padding`` is one (low, high) pair per spatial dim (negative crops), or
  "SAME" / "VALID". ``lhs_dilation`` inserts zeros between input elements (transposed convolution),
  ``rhs_dilation`` between window taps (atrous convolution).
- ``reduce_window(x, kind, window, strides, padding)``: one window/stride/padding entry per dim of x
  (pooling over NCHW is window (1, 1, kh, kw)). Padding holds the reduction's identity: -inf for
  'max', +inf for 'min', 0 for 'sum'. 'avg' is the window sum divided by the full window size,
  padding included (XLA's ``avg_pool`` default, ``count_include_pad=True`` in PyTorch terms).
- ``cumsum(x, axis)``: NumPy's, including ``axis=None`` (flattened) and its dtype promotion.

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
- cumsum along a split dim: local cumsum of the masked block, all-gather of the k block totals (one
  element per shard along the dim), then each shard adds the sum of the totals before it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .. import opdef
from ..opdef import BROADCAST_LEVEL, DOT_LEVEL, define
from ..partition.propagation import combine
from ..program_check import reduction
from ..partition.resharding import plan_cost
from ..partition.strategy import Strategy, choose, distinct
from ..sharding import Sharding, block_size
from ..trace import Tensor, emit
from . import core
from .core import reduce_identity
from .slicing import flip
from .spmd import block_pairs

__all__ = ["conv", "conv_general_dilated", "reduce_window", "cumsum"]

CONV = define("conv")
REDUCE_WINDOW = define("reduce_window")
CUMSUM = define("cumsum")
WINDOW_EDGE = define("window_edge", "program")  # a range of one dim: the edge sent to a neighbour
HALO_WINDOW = define("halo_window", "program")  # the window a shard reads from its block and halos
CUMSUM_CARRY = define("cumsum_carry", "program")  # a block's cumsum plus the totals of the blocks before


REDUCE_WINDOW_KINDS = ("max", "min", "sum", "avg")


# ================================================================ traced API
def conv(lhs, rhs, window_strides=None, padding="VALID", lhs_dilation=None, rhs_dilation=None,
         feature_group_count=1) -> Tensor:
    """XLA's ConvGeneralDilated in (N, C, *spatial) x (O, C / groups, *window) -> (N, O, *out) layout.

    ``window_strides``, ``lhs_dilation`` and ``rhs_dilation`` take an int or one int per spatial dim
    (default 1); ``padding`` is "VALID", "SAME" or one (low, high) pair per spatial dim.
    """
    lhs, rhs = core.asarray(lhs), core.asarray(rhs)
    if lhs.ndim < 3 or rhs.ndim != lhs.ndim:
        raise ValueError(f"conv needs lhs (N, C, *spatial) and rhs (O, C / groups, *window) of one rank >= 3; "
                         f"got shapes {lhs.shape} and {rhs.shape}")
    nsp, groups = lhs.ndim - 2, int(feature_group_count)
    (n, c), (o, cg) = lhs.shape[:2], rhs.shape[:2]
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise ValueError(f"conv needs feature_group_count >= 1 dividing lhs features C and rhs outputs O, and rhs "
                         f"dim 1 == C / groups; got C={c}, O={o}, rhs dim 1={cg}, feature_group_count={groups}")
    strides = _per_dim(window_strides, nsp, "window_strides")
    lhs_dil = _per_dim(lhs_dilation, nsp, "lhs_dilation")
    rhs_dil = _per_dim(rhs_dilation, nsp, "rhs_dilation")
    window = rhs.shape[2:]
    pads = _padding(padding, lhs.shape[2:], window, strides, lhs_dil, rhs_dil, "conv")
    out = tuple(out_size(*args) for args in zip(lhs.shape[2:], window, strides, pads, lhs_dil, rhs_dil))
    if any(m < 1 for m in out):
        raise ValueError(f"conv windows must fit the padded input at least once; got output spatial size {out} for "
                         f"input {lhs.shape[2:]}, window {window}, padding {pads}, dilations {lhs_dil}/{rhs_dil}")
    dtype = np.result_type(lhs.dtype, rhs.dtype)
    attrs = {"strides": strides, "padding": pads, "lhs_dilation": lhs_dil, "rhs_dilation": rhs_dil, "groups": groups}
    return emit(CONV, [core.astype(lhs, dtype), core.astype(rhs, dtype)], attrs, (n, o) + out, dtype)


conv_general_dilated = conv  # JAX's name for the same op and signature


def reduce_window(x, kind, window, strides=None, padding="VALID") -> Tensor:
    """XLA's ReduceWindow with the identity as padding; ``kind`` is 'max', 'min', 'sum' or 'avg'.

    ``window`` has one entry per dim of x; ``strides`` an int or one per dim (default 1); ``padding``
    "VALID", "SAME" or one (low, high) pair per dim. 'avg' divides each window sum by the full window
    size, padded positions included (XLA's default; ``count_include_pad=True``); it is computed in floats.
    """
    x = core.asarray(x)
    if kind not in REDUCE_WINDOW_KINDS:
        raise ValueError(f"reduce_window kind must be one of {REDUCE_WINDOW_KINDS}; got {kind!r}")
    if isinstance(window, int) or len(window) != x.ndim:
        raise ValueError(f"reduce_window needs one window size per dim of x (shape {x.shape}); got {window!r}")
    window = _per_dim(window, x.ndim, "window")
    strides = _per_dim(strides, x.ndim, "strides")
    pads = _padding(padding, x.shape, window, strides, (1,) * x.ndim, (1,) * x.ndim, "reduce_window")
    out = tuple(out_size(n, w, s, p) for n, w, s, p in zip(x.shape, window, strides, pads))
    if any(m < 1 for m in out):
        raise ValueError(f"reduce_window windows must fit the padded input at least once; got output shape {out} "
                         f"for input {x.shape}, window {window}, padding {pads}")
    if kind == "avg":
        x = core.astype(x, np.result_type(x.dtype, 1.0))
    attrs = {"kind": "sum" if kind == "avg" else kind, "window": window, "strides": strides, "padding": pads}
    y = emit(REDUCE_WINDOW, [x], attrs, out, x.dtype)
    return core.multiply(y, 1.0 / math.prod(window)) if kind == "avg" else y


def cumsum(x, axis=None, dtype=None) -> Tensor:
    """NumPy's cumsum: ``axis=None`` runs over the flattened array; ints and bools accumulate in int64."""
    x = core.asarray(x)
    if axis is None:
        x, axis = core.reshape(x, -1), 0
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"cumsum axis must be in [-{x.ndim}, {x.ndim}) for shape {x.shape}; got {axis}")
    dtype = np.dtype(dtype) if dtype is not None else np.cumsum(np.zeros(0, x.dtype)).dtype
    x = core.astype(x, dtype)
    return emit(CUMSUM, [x], {"axis": int(axis) % x.ndim}, x.shape, dtype)


def out_size(n, window, stride=1, padding=(0, 0), lhs_dilation=1, rhs_dilation=1) -> int:
    """Number of window positions along one dim (XLA's ``ConvolutionDimensionNumbers`` arithmetic)."""
    lo, hi = padding
    return ((n - 1) * lhs_dilation + 1 + lo + hi - ((window - 1) * rhs_dilation + 1)) // stride + 1


def _per_dim(value, ndim, what) -> tuple[int, ...]:
    if value is None:
        return (1,) * ndim
    values = (value,) * ndim if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) != ndim or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in values):
        raise ValueError(f"{what} takes a positive int or one per dim ({ndim}); got {value!r}")
    return tuple(int(v) for v in values)


def _padding(padding, sizes, window, strides, lhs_dil, rhs_dil, what) -> tuple[tuple[int, int], ...]:
    """(low, high) per dim; 'SAME' gives ceil(n / stride) outputs, the odd element of padding going high."""
    if isinstance(padding, str):
        if padding.upper() == "VALID":
            return ((0, 0),) * len(sizes)
        if padding.upper() != "SAME":
            raise ValueError(f"{what} padding is 'SAME', 'VALID' or one (low, high) pair per dim; got {padding!r}")
        pads = []
        for n, w, s, ld, rd in zip(sizes, window, strides, lhs_dil, rhs_dil):
            dilated = (n - 1) * ld + 1
            total = max((-(-dilated // s) - 1) * s + (w - 1) * rd + 1 - dilated, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        pads = ()
    if len(pads) != len(sizes):
        raise ValueError(f"{what} padding is 'SAME', 'VALID' or one (low, high) pair per dim ({len(sizes)}); "
                         f"got {padding!r}")
    return pads


# ================================================================ kernels
@opdef.kernel(CONV)
def conv_kernel(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    """im2col through a strided view, then one batched matmul (BLAS) over the feature groups."""
    nsp, (n, c), o = lhs.ndim - 2, lhs.shape[:2], rhs.shape[0]
    x = _dilate_and_pad(xp, lhs, 2, lhs_dilation, padding, 0)
    view = _window_view(xp, x, 2, rhs.shape[2:], strides, rhs_dilation)  # (N, C, *out, *window)
    out, taps = view.shape[2:2 + nsp], math.prod(rhs.shape[2:])
    cg, og = c // groups, o // groups
    cols = view.reshape((n, groups, cg) + view.shape[2:])
    sp, win = tuple(range(3, 3 + nsp)), tuple(range(3 + nsp, 3 + 2 * nsp))
    cols = cols.transpose((1, 0) + sp + (2,) + win).reshape(groups, n * math.prod(out), cg * taps)
    weights = rhs.reshape(groups, og, cg * taps).transpose(0, 2, 1)
    y = xp.matmul(cols, weights).reshape((groups, n) + out + (og,))
    return y.transpose((1, 0, 2 + nsp) + tuple(range(2, 2 + nsp))).reshape((n, o) + out)


@opdef.kernel(REDUCE_WINDOW)
def reduce_window_kernel(xp, x, kind, window, strides, padding):
    ones = (1,) * x.ndim
    padded = _dilate_and_pad(xp, x, 0, ones, padding, reduce_identity(kind, x.dtype))
    view = _window_view(xp, padded, 0, window, strides, ones)
    return reduction(xp, kind)(view, axis=tuple(range(x.ndim, 2 * x.ndim))).astype(x.dtype, copy=False)


@opdef.kernel(CUMSUM)
def cumsum_kernel(xp, x, axis):
    return xp.cumsum(x, axis=axis, dtype=x.dtype)


def _dilate_and_pad(xp, x, first, dilation, padding, fill):
    """Dims ``first``.. of x with (d - 1) zeros between elements (lhs dilation: conv only), then padded
    with ``fill`` or, for negative pads, cropped."""
    if any(d > 1 for d in dilation):
        shape = x.shape[:first] + tuple((n - 1) * d + 1 for n, d in zip(x.shape[first:], dilation))
        spread = xp.zeros(shape, x.dtype)
        spread[(slice(None),) * first + tuple(slice(None, None, d) for d in dilation)] = x
        x = spread
    if any(lo > 0 or hi > 0 for lo, hi in padding):
        widths = [(0, 0)] * first + [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
        x = xp.pad(x, widths, constant_values=fill)
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        x = x[(slice(None),) * first + tuple(slice(max(-lo, 0), n - max(-hi, 0))
                                             for n, (lo, hi) in zip(x.shape[first:], padding))]
    return x


def _window_view(xp, x, first, window, strides, dilation):
    """Read-only view (..., *positions, *window) of dims ``first``..: one strided view, no copy."""
    sizes, steps = x.shape[first:], x.strides[first:]
    positions = tuple(max(0, (n - (w - 1) * d - 1) // s + 1) for n, w, s, d in zip(sizes, window, strides, dilation))
    shape = x.shape[:first] + positions + tuple(window)
    view_strides = (x.strides[:first] + tuple(b * s for b, s in zip(steps, strides))
                    + tuple(b * d for b, d in zip(steps, dilation)))
    return xp.lib.stride_tricks.as_strided(x, shape, view_strides)


@opdef.kernel(WINDOW_EDGE)
def window_edge(xp, x, dim, start, stop):
    """Elements [start, stop) of ``dim``: the edge a shard sends to its neighbour, or its block total."""
    return x[(slice(None),) * dim + (slice(start, stop),)]


@opdef.kernel(HALO_WINDOW)
def halo_window(xp, x, *halos_and_index, dim, left, right, block, size, start, step, length, fill, dilation=1):
    """The ``length`` elements of [left halo | block | right halo] along ``dim`` that this shard's window
    reads, from offset start + step * shard; entries outside the global dim [0, size) (uneven-shard
    padding, the global edges, past the extended block) hold ``fill``. With ``dilation`` > 1: the window of
    the dilated input from dilated position start + step * shard (see HaloPlan)."""
    *halos, index = halos_and_index
    i = int(index)
    before, after = halos[:1] if left else [], halos[-1:] if right else []
    ext = xp.concatenate(before + [x] + after, axis=dim) if halos else x
    if dilation > 1:
        return _dilated_window(xp, ext, dim, i * block - left, size, start + step * i, length, fill, dilation)
    offset = start + step * i
    origin = i * block - left + offset  # global element index of the window's first entry
    t0 = max(0, -offset, -origin)
    t1 = min(length, ext.shape[dim] - offset, size - origin)
    shape = list(x.shape)
    shape[dim] = length
    out = xp.full(shape, fill, dtype=x.dtype)
    if t1 > t0:
        lead = (slice(None),) * dim
        out[lead + (slice(t0, t1),)] = ext[lead + (slice(offset + t0, offset + t1),)]
    return out


def _dilated_window(xp, ext, dim, base, size, origin, length, fill, dilation):
    """Dilated positions [origin, origin + length) of the input whose real element q sits at q * dilation: the
    elements ``ext`` holds (q in [base, base + len) within [0, size)) where they fall, ``fill`` elsewhere."""
    shape = list(ext.shape)
    shape[dim] = length
    out = xp.full(shape, fill, dtype=ext.dtype)
    t0 = (-origin) % dilation  # the first window position on a real element
    q0 = (origin + t0) // dilation
    count = max(0, -(-(length - t0) // dilation))
    qa, qb = max(q0, base, 0), min(q0 + count, base + ext.shape[dim], size)
    if qb > qa:
        lead, first = (slice(None),) * dim, t0 + (qa - q0) * dilation
        out[lead + (slice(first, first + (qb - qa - 1) * dilation + 1, dilation),)] = \
            ext[lead + (slice(qa - base, qb - base),)]
    return out


@opdef.kernel(CUMSUM_CARRY)
def cumsum_carry(xp, local, totals, index, axis):
    """``local`` plus the sum of the block totals of the shards before this one (an exclusive prefix)."""
    before = totals[(slice(None),) * axis + (slice(0, int(index)),)]
    return (local + xp.sum(before, axis=axis, keepdims=True)).astype(local.dtype, copy=False)


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
        parts.append(ctx.emit("collective_permute", [edge], {"pairs": shift_pairs(ctx.mesh, axes, side * hop)},
                              value.sharding, value.shape, value.dtype, local))
    if len(parts) == 1:
        return parts[0]
    local = ctx.local_shape(value)
    local[dim] = width
    return ctx.emit("concatenate", parts[::-1] if side == 1 else parts, {"axis": dim}, value.sharding, value.shape,
                    value.dtype, local)


def _halo_bytes(plan: HaloPlan, local_shape, dim, dtype) -> float:
    """Bytes the two collective-permutes of a halo exchange put on the wire, per rank."""
    row = math.prod(local_shape) // max(local_shape[dim], 1)
    return float((plan.left + plan.right) * row * np.dtype(dtype).itemsize)


# ================================================================ propagation
@opdef.propagation(REDUCE_WINDOW, CUMSUM, level=BROADCAST_LEVEL)
def _windowed_like_elementwise():
    """Every dim keeps its split (legalised to the result's sizes)."""
    forward = lambda node, ins, g, mesh: ins[0]
    backward = lambda node, out, ins, g, mesh: [out]
    return forward, backward


@opdef.propagation(CONV, level=DOT_LEVEL)
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


@opdef.partition(CONV)
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


@opdef.partition(REDUCE_WINDOW)
def _reduce_window(ctx, node):
    """Split dims keep their split where a halo plan exists (else they are replicated, noted); of the
    operand's and the result's layouts, the one moving fewer bytes (then doing less work) wins."""
    x, target = ctx.value(node.inputs[0]), ctx.sharding(node.id)
    candidates = []
    for cand in dict.fromkeys((x.sharding, target)):
        need, plans, refused = _window_layout(ctx, node, x.shape, cand)
        local = need.local_shape(x.shape, ctx.mesh)
        moved = ctx.cost(x, need) + plan_cost(need, target, node.shape, node.dtype, ctx.mesh)
        moved += sum(_halo_bytes(p, local, d, node.dtype) for d, p in plans.items())
        # the window work is the same whatever the split: ties go to less local output, then fewer changes
        work, changes = math.prod(need.local_shape(node.shape, ctx.mesh)), (need != x.sharding) + (need != target)
        candidates.append(Strategy(moved, operands=(need,), result=need, tiebreak=(work, changes),
                                   plan=(plans, refused if cand == x.sharding else {})))
    best = choose(candidates)
    need, (plans, refused) = best.result, best.plan
    for d, (axes, why) in refused.items():
        ctx.notes.append(f"reduce_window %{node.id}: dim {d} split over {axes} cannot be computed locally with a "
                         f"halo exchange ({why}); that dim is resharded to replicated")
    fill = reduce_identity(node.attrs["kind"], node.dtype)
    value, pads = ctx.reshard(x, need), list(node.attrs["padding"])
    for d, plan in plans.items():
        value = extend_with_halo(ctx, value, d, need.dims[d], plan, fill)
        pads[d] = plan.pad
    return ctx.emit_like(node, REDUCE_WINDOW, [value], {**node.attrs, "padding": tuple(pads)}, need)


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


@opdef.partition(CUMSUM)
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
    gathered = ctx.emit("all_gather", [totals], {"axes": axes, "dim": axis}, gathered_layout, shape, node.dtype)
    return ctx.emit_like(node, CUMSUM_CARRY, [local, gathered, ctx.shard_index(axes)], {"axis": axis}, need)


# ================================================================ VJPs
# Reverse-mode rules (VJPs) of the windowed ops: conv, reduce_window and cumsum.
#
# Every rule is written with traced ops that already exist and partition (conv, reduce_window, cumsum,
# reverse, transpose, reshape, select), so a gradient graph partitions like any other.
#
# - conv (JAX's ``_conv_general_dilated_transpose_lhs`` / ``_rhs``): the input cotangent is a conv of
#   the cotangent with the spatially flipped kernel whose input and output features trade places in
#   every group, with ``lhs_dilation`` = the forward strides, stride = the forward ``lhs_dilation``,
#   and padding that puts each input element under exactly the outputs that read it. The kernel
#   cotangent is a conv of the input (features as batch) with the cotangent (batch as features):
#   the batch is contracted, window taps come out as output positions (stride = forward
#   ``rhs_dilation``, rhs dilation = forward strides). Feature groups are folded into the contracted
#   dim, which does what XLA's ``batch_group_count`` would.
# - reduce_window, seen as a conv with one input feature (``PoolAsConv``: the windowed dims become
#   spatial dims, the others fold into the batch), so its gradient partitions with the conv's halo
#   exchange. 'sum' (and 'avg': a window sum times a constant whose ``mul`` has its own rule): the
#   transpose of a window sum is the input cotangent of a conv with a ones kernel.
# - reduce_window 'max' / 'min': each window's cotangent goes to the FIRST in-bounds tap, in row-major
#   window order, that holds the window's result, as XLA's SelectAndScatter with a ``>=`` (``<=``)
#   select does (JAX's gradient of max pooling): ties inside a window never split the cotangent, and
#   padding is never chosen (a window of padding only, or whose result is NaN, routes nothing). An
#   element chosen by several overlapping windows collects all their cotangents. A conv with a one-hot
#   kernel lays every window's taps out along the feature dim (exactly), equality with the result and
#   a cumsum over the taps pick the first hit, and the transposed conv scatters the cotangents back.
# - cumsum: the reverse cumulative sum, ``flip(cumsum(flip(g)))``.


# ================================================================ conv
@opdef.vjp(CONV)
def _conv_vjp(node, g, ops, y):
    lhs, rhs = ops
    return [lambda: conv_lhs_cotangent(g, rhs, node.attrs, lhs.shape),
            lambda: conv_rhs_cotangent(lhs, g, node.attrs, rhs.shape)]


def conv_lhs_cotangent(g, rhs, attrs, lhs_shape):
    """d conv / d lhs applied to ``g``: conv of g with the flipped, feature-swapped kernel."""
    nsp, a = g.ndim - 2, attrs
    kernel = flip(_swap_kernel_features(rhs, a["groups"]), tuple(range(2, 2 + nsp)))
    pads = []
    for n, w, m, s, (lo, _), ld, rd in zip(lhs_shape[2:], rhs.shape[2:], g.shape[2:], a["strides"], a["padding"],
                                           a["lhs_dilation"], a["rhs_dilation"]):
        lhs_span, rhs_span, out_span = (n - 1) * ld + 1, (w - 1) * rd + 1, (m - 1) * s + 1
        before = rhs_span - 1 - lo
        pads.append((before, lhs_span + rhs_span - 1 - out_span - before))  # exactly n outputs
    return conv(g, kernel, window_strides=a["lhs_dilation"], padding=pads, lhs_dilation=a["strides"],
                rhs_dilation=a["rhs_dilation"], feature_group_count=a["groups"])


def conv_rhs_cotangent(lhs, g, attrs, rhs_shape):
    """d conv / d rhs applied to ``g``: lhs (features as batch) convolved with g (batch as features)."""
    a, groups, spatial = attrs, attrs["groups"], tuple(range(2, g.ndim))
    pads = []
    for n, w, m, s, (lo, _), ld, rd in zip(lhs.shape[2:], rhs_shape[2:], g.shape[2:], a["strides"], a["padding"],
                                           a["lhs_dilation"], a["rhs_dilation"]):
        lhs_span, rhs_span, out_span = (n - 1) * ld + 1, (w - 1) * rd + 1, (m - 1) * s + 1
        pads.append((lo, out_span - lhs_span + rhs_span - 1 - lo))  # exactly w outputs: one per window tap
    taps = conv(_features_as_batch(lhs, groups), core.transpose(g, (1, 0) + spatial),
                window_strides=a["rhs_dilation"], padding=pads, lhs_dilation=a["lhs_dilation"],
                rhs_dilation=a["strides"], feature_group_count=groups)
    return core.transpose(taps, (1, 0) + spatial)  # (C / G, O, *window) -> (O, C / G, *window)


def _swap_kernel_features(rhs, groups):
    """(O, C / G, *window) -> (C, O / G, *window): inside each group, input and output features swap."""
    window = rhs.shape[2:]
    spatial = tuple(range(2, 2 + len(window)))
    if groups == 1:
        return core.transpose(rhs, (1, 0) + spatial)
    cg, og = rhs.shape[1], rhs.shape[0] // groups
    grouped = core.reshape(rhs, (groups, og, cg) + window)
    swapped = core.transpose(grouped, (0, 2, 1) + tuple(d + 1 for d in spatial))
    return core.reshape(swapped, (groups * cg, og) + window)


def _features_as_batch(lhs, groups):
    """(N, C, *spatial) -> (C / G, G * N, *spatial): a group-g feature sits in contracted block g, which
    the kernel-gradient conv (feature_group_count = G) pairs with group g's output features."""
    (n, c), spatial = lhs.shape[:2], lhs.shape[2:]
    dims = tuple(range(2, 2 + len(spatial)))
    if groups == 1:
        return core.transpose(lhs, (1, 0) + dims)
    grouped = core.reshape(lhs, (n, groups, c // groups) + spatial)
    moved = core.transpose(grouped, (2, 1, 0) + tuple(d + 1 for d in dims))
    return core.reshape(moved, (c // groups, groups * n) + spatial)


# ================================================================ reduce_window
@opdef.vjp(REDUCE_WINDOW)
def _reduce_window_vjp(node, g, ops, y):
    x, attrs = ops[0], node.attrs
    pool = PoolAsConv.of(attrs, x.shape)
    if pool is None:  # every window is one element: the identity
        return [g]
    if attrs["kind"] == "sum":
        return [lambda: window_sum_transpose(g, pool, x.shape)]
    return [lambda: route_to_first_chosen(g, x, y, pool)]


@dataclass(frozen=True)
class PoolAsConv:
    """A reduce_window seen as a conv with one input feature, so its gradient rides on the conv's halo
    exchange (a strided static slice of a split dim would gather it): the windowed dims become the
    spatial dims of an (N, 1, *spatial) lhs; the other dims (window 1, stride 1, no padding) fold into N."""
    perm: tuple[int, ...]  # x's dims, folded ones first, then the windowed ones
    lhs_shape: tuple[int, ...]  # (N, 1, *spatial)
    window: tuple[int, ...]
    attrs: dict  # the conv's attributes: strides, padding, dilations 1, one group

    @classmethod
    def of(cls, attrs, shape) -> PoolAsConv | None:
        w, s, p = attrs["window"], attrs["strides"], attrs["padding"]
        windowed = [d for d in range(len(shape)) if (w[d], s[d], tuple(p[d])) != (1, 1, (0, 0))]
        if not windowed:
            return None
        folded = [d for d in range(len(shape)) if d not in windowed]
        ones = (1,) * len(windowed)
        conv_attrs = {"strides": tuple(s[d] for d in windowed), "padding": tuple(tuple(p[d]) for d in windowed),
                      "lhs_dilation": ones, "rhs_dilation": ones, "groups": 1}
        lhs_shape = (math.prod(shape[d] for d in folded), 1) + tuple(shape[d] for d in windowed)
        return cls(tuple(folded + windowed), lhs_shape, tuple(w[d] for d in windowed), conv_attrs)

    def to_conv(self, t):
        """x-shaped (or result-shaped) t in conv layout (N, 1, *spatial)."""
        moved = core.transpose(t, self.perm)
        return core.reshape(moved, self.lhs_shape[:2] + moved.shape[moved.ndim - len(self.window):])

    def from_conv(self, t, shape):
        moved = core.reshape(t, tuple(shape[d] for d in self.perm))
        return core.transpose(moved, tuple(int(d) for d in np.argsort(self.perm)))

    def windows(self, t, kernel):
        return conv(t, kernel, self.attrs["strides"], self.attrs["padding"])


def window_sum_transpose(g, pool: PoolAsConv, shape):
    """Each input element gets the sum of the cotangents of the windows that read it: the input
    cotangent of a conv with a ones kernel."""
    ones = core.asarray(np.ones((1, 1) + pool.window, g.dtype))
    return pool.from_conv(conv_lhs_cotangent(pool.to_conv(g), ones, pool.attrs, pool.lhs_shape), shape)


def route_to_first_chosen(g, x, y, pool: PoolAsConv):
    """Max / min pooling's input cotangent: every window's cotangent lands on its first (row-major)
    in-bounds tap equal to the window's result. A conv with a one-hot kernel lays each window's taps
    along the feature dim (exact: one product by 1, the others by 0), a cumsum over the taps finds
    the first hit, and the transposed conv scatters the routed cotangents back."""
    taps = math.prod(pool.window)
    one_hot = core.asarray(np.eye(taps, dtype=x.dtype).reshape((taps, 1) + pool.window))
    xc = pool.to_conv(x)
    # 0 * inf is NaN, so infinities travel as codes: 1 finite, 2 +inf, 3 -inf, 0 NaN or padding (never chosen)
    code = core.astype(core.where(xc == np.inf, 2.0, core.where(xc == -np.inf, 3.0, core.where(xc == xc, 1.0, 0.0))),
                      x.dtype)
    codes, values = pool.windows(code, one_hot), pool.windows(core.where(code == 1.0, xc, 0.0), one_hot)
    values = core.where(codes == 2.0, np.inf, core.where(codes == 3.0, -np.inf, values))
    hit = (codes != 0.0) & (values == pool.to_conv(y))  # (N, taps, *out)
    first = hit & (cumsum(core.astype(hit, "int64"), axis=1) == 1)
    routed = core.where(first, pool.to_conv(g), 0.0)
    return pool.from_conv(conv_lhs_cotangent(routed, one_hot, pool.attrs, pool.lhs_shape), x.shape)


# ================================================================ cumsum
@opdef.vjp(CUMSUM)
def _cumsum_vjp(node, g, ops, y):
    axis = node.attrs["axis"]
    return [lambda: flip(cumsum(flip(g, axis), axis), axis)]
