"""Windowed einsum (collective matmul): an all-gather before an einsum, or a reduce-scatter after it, as a
ring of k collective_permutes each hidden behind one k-th of the einsum (XLA's windowed einsum, Wang et al.
2023 "Overlap communication with dependent computation via decomposition").

The einsum rule chooses its strategy as usual (``ops/einsum.py``); this pass then looks at the collective
the strategy implies next to the einsum and, where it pays, emits the ring instead. ``k`` = shards along the
mesh axes X, ``i`` = this rank's shard number along X:

- **gather, kept letter** (``c`` split on X in operand P, absent from Q, kept in the result): step t
  computes the result block of c that P's current block is (block (i + t) mod k); P's block moves one
  shard back each step (``collective_permute``: shard j receives from j + 1). ``rotated_concat`` puts step
  t's block at block (i + t) mod k of the result.
- **gather, contracted letter** (c in P and Q, summed): step t multiplies P's current block with the same
  block of Q's (``shard_slice`` with ``shift`` t) and adds it up: FSDP's weight gathers, attention's
  probabilities times values under sequence parallelism.
- **reduce-scatter** (the result partial over X, wanted split on X along a letter c of P): step t computes
  the partial sum of block (i + t + 1) mod k, adds it to the running sum received from shard i + 1 and
  passes it on; after k steps each shard holds the whole sum of its own block.

The scheduler (``partition/schedule.py``) then starts each permute as soon as its operand exists and waits
right before the step that reads it, so the transfer of step t + 1's block runs during step t's einsum.

When it pays (decided once, at partition time): only when asked, as in XLA (``partition(windowed_einsum=
bytes)`` or ``$SPMD_WINDOWED_EINSUM`` bytes: the threshold the replaced collective's operand must reach), with
the overlap pass on (without start/done pairs nothing would hide), and when the cost model prices the ring's
exposed time, (k - 1) * max(0, permute - one step's compute), below the collective it replaces (a measured
profile's per-message latency makes small einsums lose). Off by default: on CPUs the ranks copy each
other's bytes themselves, so a transfer takes the same cores as the einsum it would hide behind
(docs/BENCHMARKS.md, windowed einsum).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os

import numpy as np

from ..cost import BYTES_PER_FLOP, active_model
from ..ops.core import ADD
from ..ops.einsum import EINSUM
from ..ops.spmd import COLLECTIVE_PERMUTE, RESIZE, ROTATED_CONCAT, SHARD_SLICE, block_pairs
from ..sharding import Sharding, block_size
from .resharding import plan_cost

WINDOWED_ENV = "SPMD_WINDOWED_EINSUM"
OFF = math.inf  # the threshold when windowing is off (no collective is that big)
_THRESHOLD: contextvars.ContextVar = contextvars.ContextVar("windowed_einsum_threshold", default=None)


def windowed_threshold(value: int | None):
    """Bytes from which a collective next to an einsum may become a ring: ``value``, else the threshold of the
    partition() in progress (loop bodies), else ``$SPMD_WINDOWED_EINSUM``; ``OFF`` when none is set."""
    where = "windowed_einsum"
    if value is None and _THRESHOLD.get() is not None:
        return _THRESHOLD.get()
    if value is None:
        value, where = os.environ.get(WINDOWED_ENV, "").strip(), f"${WINDOWED_ENV}"
        if not value:
            return OFF
        try:
            value = int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where} must be a whole number of bytes >= 0 (the smallest gathered operand or summed "
                         f"result to window) or unset; got {value!r}")
    return int(value)


@contextlib.contextmanager
def windowing(threshold):
    """The threshold for the partition() in progress (nested partitions of loop bodies see it too)."""
    token = _THRESHOLD.set(threshold)
    try:
        yield
    finally:
        _THRESHOLD.reset(token)


def windowed_einsum(ctx, node, best, terms, values):
    """The einsum of ``node`` under strategy ``best`` as a ring of permutes, or None where no ring applies or
    it does not pay. ``terms``: (lhs, rhs, out) letters; ``values``: the two operands as they are."""
    if _THRESHOLD.get() in (None, OFF) or ctx.mesh.size < 2:
        return None
    for k_op in (0, 1):
        ring = _gather_ring(ctx, node, best, terms, values, k_op)
        if ring is not None:
            return ring
    return _reduce_scatter_ring(ctx, node, best, terms, values)


# ================================================================ the gather ring
def _gather_ring(ctx, node, best, terms, values, p_pos):
    """Operand ``p_pos`` brought from one letter split on X to that letter whole, nothing else moved: that
    gather as a ring."""
    (lhs, rhs, out), q_pos, mesh = terms, 1 - p_pos, ctx.mesh
    p, q = values[p_pos], values[q_pos]
    tp, tq = (lhs, rhs)[p_pos], (lhs, rhs)[q_pos]
    dim = _only_change(mesh, p.sharding, best.operands[p_pos])
    if dim is None or p.sharding.partial or _real(mesh, best.operands[p_pos].dims[dim]):
        return None
    axes, c = _real(mesh, p.sharding.dims[dim]), tp[dim]
    if (c in tq) == (c in out):  # a batch letter, or a letter only P has (summed)
        return None
    k, gathered = mesh.axis_size(axes), best.operands[p_pos]
    if ctx.has_resharded(p, gathered):
        return None  # gathered already for another user: free here
    block = _nbytes(p.sharding.local_shape(p.shape, mesh), p.dtype)
    if not _pays(ctx, ctx.cost(p, gathered), k, block * k, block, best.flops / k):
        return None
    q_full = _masked(ctx, ctx.reshard(q, best.operands[q_pos]), terms, q_pos)
    if c in out:  # each block's rows of the result
        local = _local(ctx, best.result, node.shape, out.index(c), axes)
        parts = []
        blocks = _ring(ctx, _masked(ctx, p, terms, p_pos), axes, k,
                       lambda t, b: parts.append(_einsum(ctx, node, b, q_full, p_pos, best.result, local)))
        result = _joined(ctx, parts, out.index(c), axes, best.result, node.shape, node.dtype, node.shape[out.index(c)])
    else:  # each block times the same block of Q, summed
        q_dim, total = tq.index(c), []
        q_local = _local(ctx, q_full.sharding, q_full.shape, q_dim, axes)

        def step(t, b):
            q_block = ctx.emit(SHARD_SLICE, [q_full], {"dim": q_dim, "axes": axes, "shift": t}, q_full.sharding,
                               q_full.shape, q_full.dtype, q_local)
            part = _einsum(ctx, node, b, q_block, p_pos, best.result)
            total[:] = [_add(ctx, node, total[0], part, best.result) if total else part]
        blocks = _ring(ctx, _masked(ctx, p, terms, p_pos), axes, k, step)
        result = total[0]
    # the blocks joined are the gathered operand: later users of it (attention's k and v after q) take it from
    # here at the cost of one copy, not another ring (dropped as dead code when nobody does)
    ctx.remember_reshard(p, gathered, _joined(ctx, blocks, dim, axes, gathered, p.shape, p.dtype, p.shape[dim]))
    return result


def _ring(ctx, p, axes, k, step) -> list:
    """P's block and the k - 1 blocks after it along ``axes``, each permuted from the next shard: step t holds
    block (i + t) mod k. ``step(t, block)`` emits step t's compute before the permute that fetches the next
    block, so the scheduler can run that transfer during it."""
    shift = {"pairs": tuple(block_pairs(ctx.mesh, axes, 1, 1, cyclic=True))}
    blocks = [p]
    for t in range(k):
        step(t, blocks[-1])
        if t < k - 1:
            blocks.append(ctx.emit(COLLECTIVE_PERMUTE, [blocks[-1]], shift, p.sharding, p.shape, p.dtype))
    return blocks


def _joined(ctx, parts, dim, axes, sharding, shape, dtype, size):
    """The k blocks of ``dim`` (step t's at block (i + t) mod k) as one value, trimmed to ``size``."""
    local = list(ctx.local_shape(parts[0]))
    local[dim] *= len(parts)
    whole = ctx.emit(ROTATED_CONCAT, parts, {"dim": dim, "axes": axes}, sharding, shape, dtype, local)
    if local[dim] != size:
        whole = ctx.emit(RESIZE, [whole], {"dim": dim, "size": size}, sharding, shape, dtype)
    return whole


# ================================================================ the reduce-scatter ring
def _reduce_scatter_ring(ctx, node, best, terms, values):
    """A result partial over X that the node's layout wants split on X along a letter of one operand: the
    reduce-scatter as a ring of running sums. Returns the value already in the node's layout."""
    (lhs, rhs, out), target, mesh = terms, ctx.sharding(node.id), ctx.mesh
    dim = _only_change(mesh, best.result, target)
    if dim is None or best.result.reduce_op != "sum" or _real(mesh, target.partial):
        return None
    axes, c = _real(mesh, target.dims[dim]), out[dim]
    if (c in lhs) == (c in rhs) or _real(mesh, best.result.dims[dim]) or \
            set(_real(mesh, best.result.partial)) != set(axes):  # a batch letter, the blocks of a block, or
        return None  # sums pending over other axes too
    p_pos = 0 if c in lhs else 1
    k = mesh.axis_size(axes)
    summed_bytes = _nbytes(best.result.local_shape(node.shape, mesh), node.dtype)
    replaced = plan_cost(best.result, target, node.shape, node.dtype, mesh)
    if not _pays(ctx, replaced, k, summed_bytes, summed_bytes // k, best.flops / k):
        return None
    p, q = (_masked(ctx, ctx.reshard(values[pos], best.operands[pos]), terms, pos) for pos in (p_pos, 1 - p_pos))
    p_dim = (lhs, rhs)[p_pos].index(c)
    p_local = _local(ctx, p.sharding, p.shape, p_dim, axes)
    summed = target.local_shape(node.shape, ctx.mesh)  # a partial sum of this step's block
    shift = {"pairs": tuple(block_pairs(ctx.mesh, axes, 1, 1, cyclic=True))}
    total = None
    for t in range(k):
        p_block = ctx.emit(SHARD_SLICE, [p], {"dim": p_dim, "axes": axes, "shift": (t + 1) % k}, p.sharding,
                           p.shape, p.dtype, p_local)
        part = _einsum(ctx, node, p_block, q, p_pos, best.result, summed)
        if total is not None:
            moved = ctx.emit(COLLECTIVE_PERMUTE, [total], shift, best.result, node.shape, node.dtype, summed)
            last = t == k - 1  # the whole sum of this rank's block: the node's layout
            part = _add(ctx, node, moved, part, target if last else best.result, None if last else summed)
        total = part
    return total


# ================================================================ helpers
def _only_change(mesh, src: Sharding, dst: Sharding):
    """The one dim whose (size > 1) axes differ between src and dst, or None (none or several differ)."""
    changed = [d for d, (x, y) in enumerate(zip(src.dims, dst.dims)) if _real(mesh, x) != _real(mesh, y)]
    return changed[0] if len(changed) == 1 else None


def _pays(ctx, replaced: float, k: int, big: int, block: int, step_flops: float) -> bool:
    """Windowed only from the threshold up (``big``: the bytes per rank of the gathered operand or the summed
    result), and where the ring's exposed time, (k - 1) permutes of ``block`` bytes less the compute each hides
    behind, costs less than the plan it replaces (``replaced``, cost-model units)."""
    if k < 2 or big < _THRESHOLD.get():
        return False
    permute = active_model().collective(COLLECTIVE_PERMUTE.name, k, block, block)
    exposed = (k - 1) * max(0.0, permute - BYTES_PER_FLOP * step_flops)
    return exposed < replaced


def _einsum(ctx, node, p, other, p_pos, label, local=None):
    args = [p, other] if p_pos == 0 else [other, p]
    return ctx.emit(EINSUM, args, node.attrs, label, node.shape, node.dtype, local)


def _add(ctx, node, x, y, label, local=None):
    return ctx.emit(ADD, [x, y], {}, label, node.shape, node.dtype, local)


def _local(ctx, s: Sharding, shape, dim: int, axes) -> tuple:
    """The local shape under ``s`` with ``dim`` cut to one block over ``axes``: a step's piece. Its label stays
    ``s`` (one value of the ring, not a layout of its own)."""
    local = list(s.local_shape(shape, ctx.mesh))
    local[dim] = block_size(shape[dim], ctx.mesh.axis_size(axes))
    return tuple(local)


def _real(mesh, axes) -> tuple:
    """``axes`` without those of size 1 (the planner moves nothing over them: the same blocks)."""
    return tuple(a for a in axes if mesh.axis_size((a,)) > 1)


def _masked(ctx, value, terms, pos):
    """Operand ``pos`` with the padding of its uneven contracted dims zeroed, as the plain einsum has it."""
    mine, other = terms[pos], terms[1 - pos]
    return ctx.mask_padding(value, [d for d, x in enumerate(mine) if x in other and x not in terms[2]], 0)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
