"""top_k: the k largest entries along the last axis and their positions (``jax.lax.top_k``).

``top_k(x, k) -> (values, indices)``: ``values[..., j]`` is the j-th largest entry of ``x[..., :]``
(descending), ``indices[..., j]`` its position (int32, as JAX); equal values are ordered by position,
the lower first. ``1 <= k <= x.shape[-1]``. NaN inputs are not supported.

A graph node has one result, so ``top_k`` emits two nodes of ONE op, ``top_k`` with
``output="values"`` or ``output="indices"``: one record, one kernel, one rule.

Partitioning, last axis split over axes A into blocks of c (GSPMD-style, like argmax):
1. mask this rank's padding with the identity of max (-inf, or the dtype's minimum): padding sits at
   the end of the block and at global positions >= n, so a real entry wins every tie against it;
2. local top-min(k, c) of the block, its indices made global (``shard_index * c``);
3. all-gather those candidates along A (the planner: candidates split over A, wanted whole);
4. top-k of the gathered candidates (``top_k_merge``): ties go to the earlier candidate, and
   candidates lie in shard order, each shard's sorted by position, so to the lower global index.
The strategy chooser weighs that against gathering the last axis first and running ``top_k`` locally.
Other dims keep their split. Gradient: the values' cotangent goes to the chosen positions (a one-hot
scatter written with existing ops, so it partitions like any other graph).
"""
from __future__ import annotations

import numpy as np

from .. import opdef
from ..opdef import BROADCAST_LEVEL, define
from ..partition.resharding import plan_cost
from ..partition.strategy import Strategy, choose
from ..sharding import Sharding, block_size
from ..trace import Tensor, emit
from . import core
from .core import reduce_identity
from .slicing import broadcasted_iota

__all__ = ["top_k"]

TOP_K = define("top_k")
TOP_K_MERGE = define("top_k_merge", "program")  # top-k of gathered (value, index) candidates
OUTPUTS = ("values", "indices")
INDEX_DTYPE = "int32"  # as jax.lax.top_k


# ================================================================ traced API
def top_k(x, k) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the ``k`` largest entries along the last axis, descending; ties go to the
    lower index. ``values`` keeps x's dtype, ``indices`` are int32; both have shape ``x.shape[:-1] + (k,)``."""
    x = core.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"top_k needs an operand of rank >= 1 (it searches the last axis); got shape {x.shape}")
    if isinstance(k, Tensor) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= x.shape[-1]:
        raise ValueError(f"top_k needs a static int k with 1 <= k <= x.shape[-1] = {x.shape[-1]}; got k={k!r}")
    shape = x.shape[:-1] + (int(k),)
    values = emit(TOP_K, [x], {"k": int(k), "output": "values"}, shape, x.dtype)
    indices = emit(TOP_K, [x], {"k": int(k), "output": "indices"}, shape, INDEX_DTYPE)
    return values, indices


# ================================================================ kernels
def _order(xp, x, k):
    """Positions of the k largest entries along the last axis, descending, ties to the lower position.

    A stable ascending sort of the REVERSED axis lists equal values from the highest position down;
    reading it backwards gives descending values with equal ones from the lowest position up."""
    n = x.shape[-1]
    ascending = xp.argsort(x[..., ::-1], axis=-1, kind="stable")
    return (n - 1 - ascending[..., ::-1])[..., :k]


@opdef.kernel(TOP_K)
def _top_k_kernel(xp, x, *shard, k, output, block=0):
    """``output`` of top_k over the last axis; given a shard operand, positions start at shard * block."""
    order = _order(xp, x, k)
    if output == "values":
        return xp.take_along_axis(x, order, axis=-1)
    first = int(shard[0]) * block if shard else 0
    return (order + first).astype(INDEX_DTYPE, copy=False)


@opdef.kernel(TOP_K_MERGE)
def _top_k_merge_kernel(xp, values, indices, k, output):
    """``output`` of the top k of candidates (values, global indices), the earlier candidate first on ties."""
    order = _order(xp, values, k)
    source = values if output == "values" else indices
    return xp.take_along_axis(source, order, axis=-1)


# ================================================================ propagation
@opdef.propagation(TOP_K, level=BROADCAST_LEVEL)
def _top_k_propagation():
    """Leading dims keep their split; the last axis (k results) is never split, the operand's is free."""
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else Sharding(ins[0].dims[:-1] + ((),))

    def bwd(node, out, ins, g, mesh):
        return [Sharding(out.dims[:-1] + ((),))]
    return fwd, bwd


# ================================================================ partition rule
@opdef.partition(TOP_K)
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
    values, indices = ctx.shared(("top_k", x.slot, x.sharding, k, result), lambda: _candidates(ctx, node, x, axes, result))
    return ctx.emit_like(node, TOP_K_MERGE, [values, indices], {"k": k, "output": node.attrs["output"]}, result)


def _candidates(ctx, node, x, axes, result: Sharding):
    """Every shard's local top-k values and global indices, gathered whole along ``axes``."""
    block = block_size(x.shape[-1], ctx.mesh.axis_size(axes))
    local_k = min(node.attrs["k"], block)
    x = ctx.mask_padding(x, [len(x.shape) - 1], reduce_identity("max", x.dtype))
    # global shape (..., k_local * shards), split over the axes in blocks of k_local
    shape = node.shape[:-1] + (local_k * ctx.mesh.axis_size(axes),)
    per_shard = Sharding(result.dims[:-1] + (axes,))
    values = ctx.emit(TOP_K, [x], {"k": local_k, "output": "values"}, per_shard, shape, x.dtype)
    indices = ctx.emit(TOP_K, [x, ctx.shard_index(axes)], {"k": local_k, "output": "indices", "block": block},
                       per_shard, shape, INDEX_DTYPE)
    return ctx.reshard(values, result), ctx.reshard(indices, result)  # the planner's all-gathers


# ================================================================ VJP
@opdef.vjp(TOP_K)
def _top_k_vjp(node, g, ops, y):
    """The values' cotangent goes to the positions they came from: sum over j of one_hot(indices[j]) * g[j];
    the indices carry no gradient."""
    if node.attrs["output"] == "indices":
        return [None]
    x = ops[0]

    def scatter():
        indices = emit(TOP_K, [x], {**node.attrs, "output": "indices"}, node.shape, INDEX_DTYPE)
        positions = broadcasted_iota(INDEX_DTYPE, node.shape + (x.shape[-1],), x.ndim)  # (..., k, n)
        hit = core.equal(positions, core.expand_dims(indices, -1))
        return core.sum(core.where(hit, core.expand_dims(g, -1), 0.0), axis=-2)
    return [scatter]
