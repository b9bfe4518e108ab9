"""The propagation and partition rules of the ``ops/top_k.py`` family, registered in ``table.py``.

Partitioning, last axis split over axes A into blocks of c (GSPMD-style, like argmax):
1. mask this rank's padding with the identity of max (-inf, or the dtype's minimum): padding sits at
   the end of the block and at global positions >= n, so a real entry wins every tie against it;
2. local top-min(k, c) of the block, its indices made global (``shard_index * c``);
3. all-gather those candidates along A (the planner: candidates split over A, wanted whole);
4. top-k of the gathered candidates (``top_k_merge``): ties go to the earlier candidate, and
   candidates lie in shard order, each shard's sorted by position, so to the lower global index.
The strategy chooser weighs that against gathering the last axis first and running ``top_k`` locally.
Other dims keep their split.
"""
from __future__ import annotations

from ...opdef import BROADCAST_LEVEL
from ...ops import core
from ...ops.top_k import INDEX_DTYPE, TOP_K, TOP_K_MERGE
from ...sharding import Sharding, block_size
from ..resharding import plan_cost
from ..strategy import Strategy, choose
from .table import partition, propagation


# ================================================================ propagation
@propagation(TOP_K, level=BROADCAST_LEVEL)
def _top_k_propagation():
    """Leading dims keep their split; the last axis (k results) is never split, the operand's is free."""
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else Sharding(ins[0].dims[:-1] + ((),))

    def bwd(node, out, ins, g, mesh):
        return [Sharding(out.dims[:-1] + ((),))]
    return fwd, bwd


# ================================================================ partition rule
@partition(TOP_K)
def _top_k_partition(ctx, node):
    """Local top-k + all-gather of the candidates + merge on a split last axis, or gather the axis and
    run top_k locally, whichever the chooser finds cheaper (module doc)."""
    x, target, k = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["k"]
    batch = target.dims[:-1]
    result = Sharding(batch + ((),))
    last = tuple(a for a in x.sharding.dims[-1] if a not in target.axes)
    whole = Sharding(batch + ((),))
    candidates = [Strategy(ctx.cost(x, whole) + _result_cost(ctx, node, result), operands=(whole,), result=result,
                           plan="gather")]
    if ctx.mesh.axis_size(last) > 1:
        split = Sharding(batch + (last,))
        gathered = _candidate_bytes(ctx, node, split, k)
        candidates.append(Strategy(ctx.cost(x, split) + gathered + _result_cost(ctx, node, result),
                                   operands=(split,), result=result, plan="merge"))
    best = choose(candidates)
    x = ctx.reshard(x, best.operands[0])
    if best.plan == "gather":
        return ctx.emit_like(node, TOP_K, [x], node.attrs, result)
    return _merge(ctx, node, x, last, result)


def _result_cost(ctx, node, result: Sharding) -> float:
    return plan_cost(result, ctx.sharding(node.id), node.shape, node.dtype, ctx.mesh)


def _candidate_bytes(ctx, node, split: Sharding, k: int) -> float:
    """Bytes of the all-gather of every shard's local top-k values and indices along the split axes."""
    axes = split.dims[-1]
    local_k = min(k, block_size(ctx.graph[node.inputs[0]].shape[-1], ctx.mesh.axis_size(axes)))
    shape = node.shape[:-1] + (local_k * ctx.mesh.axis_size(axes),)
    per = Sharding(split.dims)
    whole = Sharding(split.dims[:-1] + ((),))
    return sum(plan_cost(per, whole, shape, dtype, ctx.mesh) for dtype in (node.dtype, INDEX_DTYPE))


def _merge(ctx, node, x, axes, result: Sharding):
    """Steps 1-4 of the module doc on ``x`` split over ``axes`` along its last axis; the values and the
    indices node of one top_k share steps 1-3."""
    k = node.attrs["k"]
    values, indices = ctx.shared((TOP_K, x.slot, x.sharding, k, result), lambda: _candidates(ctx, node, x, axes, result))
    return ctx.emit_like(node, TOP_K_MERGE, [values, indices], {"k": k, "output": node.attrs["output"]}, result)


def _candidates(ctx, node, x, axes, result: Sharding):
    """Every shard's local top-k values and global indices, gathered whole along ``axes``."""
    block = block_size(x.shape[-1], ctx.mesh.axis_size(axes))
    local_k = min(node.attrs["k"], block)
    x = ctx.mask_padding(x, [len(x.shape) - 1], core.reduce_identity("max", x.dtype))
    # global shape (..., k_local * shards), split over the axes in blocks of k_local
    shape = node.shape[:-1] + (local_k * ctx.mesh.axis_size(axes),)
    per_shard = Sharding(result.dims[:-1] + (axes,))
    values = ctx.emit(TOP_K, [x], {"k": local_k, "output": "values"}, per_shard, shape, x.dtype)
    indices = ctx.emit(TOP_K, [x, ctx.shard_index(axes)], {"k": local_k, "output": "indices", "block": block},
                       per_shard, shape, INDEX_DTYPE)
    return ctx.reshard(values, result), ctx.reshard(indices, result)  # the planner's all-gathers
