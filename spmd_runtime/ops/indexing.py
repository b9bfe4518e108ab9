"""Index reductions (argmax, argmin) and the max-shifted reductions built on them (logsumexp, softmax).

``argmax`` / ``argmin`` follow NumPy: the FIRST position of the extreme value, an int64
result; ``axis=None`` searches the flattened array. NaN inputs are not supported on a
split axis (MPI max/min do not order NaN like ``np.argmax``).

Along a split axis (GSPMD-style, as XLA partitions a variadic (value, index) reduce):
1. mask this rank's padding with the identity (-inf for argmax, +inf for argmin: padding
   sits at the END of a block, so a real element always wins the local first-occurrence tie),
2. local value = max of the block (``reduce``), local index = first position in the block
   plus ``shard_index * block`` (``arg_in_block``),
3. best value = all-reduce MAX of the local values,
4. among the shards holding the best value, the smallest global index: each rank offers its
   index if its value equals the best, else the largest int64 (``arg_candidate``), and an
   all-reduce MIN picks the answer, the first occurrence across shard boundaries.
Both collectives come from the planner: the local value is a ``reduce`` result with a
partial 'max' (or 'min') sharding over the axis, resharded to a non-partial layout, and
the candidate index is returned with a partial 'min' sharding that the driver reshards to
the assigned result sharding. No direct ``ctx.emit`` of a collective is needed, so the cost
model, the comm summary and uneven padding are handled in one place (the planner).
"""
from __future__ import annotations

import numpy as np

from .. import opdef
from ..opdef import BROADCAST_LEVEL, define
from ..sharding import Sharding
from ..trace import Tensor, emit
from . import core
from .core import reduce_identity, reduce_propagation

__all__ = ["argmax", "argmin", "logsumexp", "softmax"]

ARGMAX = define("argmax")
ARGMIN = define("argmin")
ARG_IN_BLOCK = define("arg_in_block", "program")  # global position of a block's first extreme
ARG_CANDIDATE = define("arg_candidate", "program")  # a block's index where it holds the best value


_KIND = {"argmax": "max", "argmin": "min"}
_NO_INDEX = np.iinfo(np.int64).max  # loses every MIN against a real index


# ---------------------------------------------------------------- traced API
def argmax(x, axis=None, keepdims=False) -> Tensor:
    """``np.argmax``: int64 positions of the first maximum along ``axis`` (None: of the flattened array)."""
    return _arg_reduce("argmax", x, axis, keepdims)


def argmin(x, axis=None, keepdims=False) -> Tensor:
    """``np.argmin``: int64 positions of the first minimum along ``axis`` (None: of the flattened array)."""
    return _arg_reduce("argmin", x, axis, keepdims)


def _arg_reduce(op, x, axis, keepdims) -> Tensor:
    x = core.asarray(x)
    if x.dtype == np.bool_:  # MPI has no max/min on booleans; False < True holds in int8 too
        x = core.astype(x, "int8")
    flat, ndim = axis is None, x.ndim
    if flat:
        x, axis = core.reshape(x, (x.size,)), 0
    if not -x.ndim <= int(axis) < x.ndim:
        raise ValueError(f"{op} needs an axis in [-{x.ndim}, {x.ndim}); got axis {axis} for shape {x.shape}")
    axis = int(axis) % x.ndim
    if x.shape[axis] == 0:
        raise ValueError(f"{op} of an empty sequence has no answer; got size 0 on axis {axis} of shape {x.shape}")
    shape = x.shape[:axis] + x.shape[axis + 1:]
    out = emit(op, [x], {"axes": (axis,)}, shape, "int64")
    if keepdims:
        out = core.reshape(out, (1,) * ndim if flat else x.shape[:axis] + (1,) + x.shape[axis + 1:])
    return out


def logsumexp(x, axis=None, keepdims=False) -> Tensor:
    """``log(sum(exp(x)))`` over ``axis``, shifted by the max so large inputs do not overflow.

    A slice whose max is infinite (all -inf, or some +inf) is not shifted, as in SciPy: its result is
    -inf (or +inf) instead of the NaN that ``-inf - -inf`` would give."""
    x = core.asarray(x)
    x = core.astype(x, np.result_type(x.dtype, 1.0))
    axes = tuple(range(x.ndim)) if axis is None else tuple(int(a) % x.ndim for a in _tuple(axis))
    peak = core.max(x, axis=axes, keepdims=True)
    shift = core.where(core.abs(peak) < np.inf, peak, 0.0)
    out = core.log(core.sum(core.exp(x - shift), axis=axes, keepdims=True)) + shift
    return out if keepdims else core.squeeze(out, axis=axes)


def softmax(x, axis=-1) -> Tensor:
    """``exp(x) / sum(exp(x))`` along ``axis``, computed as exp(x - max) / sum(exp(x - max)) (no overflow)."""
    x = core.asarray(x)
    x = core.astype(x, np.result_type(x.dtype, 1.0))
    e = core.exp(x - core.max(x, axis=axis, keepdims=True))
    return e / core.sum(e, axis=axis, keepdims=True)


def _tuple(a):
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


# ---------------------------------------------------------------- kernels
@opdef.kernel(ARGMAX)
def argmax_kernel(xp, x, axes):
    return xp.argmax(x, axis=axes[0]).astype("int64", copy=False)


@opdef.kernel(ARGMIN)
def argmin_kernel(xp, x, axes):
    return xp.argmin(x, axis=axes[0]).astype("int64", copy=False)


@opdef.kernel(ARG_IN_BLOCK)
def arg_in_block(xp, x, shard, kind, axes):
    """Global position of the first max (or min) of ``x``, block ``shard`` of the split axis ``axes[0]``."""
    local = xp.argmax(x, axis=axes[0]) if kind == "max" else xp.argmin(x, axis=axes[0])
    return local.astype("int64", copy=False) + shard * x.shape[axes[0]]


@opdef.kernel(ARG_CANDIDATE)
def arg_candidate(xp, value, best, index):
    """``index`` where this block holds the best value, else the largest int64 (so a MIN ignores it)."""
    return xp.where(value == best, index, xp.asarray(_NO_INDEX, dtype="int64"))


# ---------------------------------------------------------------- propagation and partitioning
@opdef.propagation(ARGMAX, ARGMIN, level=BROADCAST_LEVEL)
def _arg_reduce_propagation():
    """Exactly a reduce over the same axis: kept dims keep their split, the searched one is dropped."""
    return reduce_propagation()


@opdef.partition(ARGMAX, ARGMIN)
def _partition_arg_reduce(ctx, node):
    """Local arg-reduction, or, along a split axis, value all-reduce then index all-reduce (module doc)."""
    kind, axes, target = _KIND[node.op], node.attrs["axes"], ctx.sharding(node.id)
    x = ctx.value(node.inputs[0])
    x = ctx.reshard(x, _operand_sharding(x.sharding, target, axes[0]))
    split = x.sharding.dims[axes[0]]
    if not split:
        return ctx.emit_like(node, node.op, [x], node.attrs, target)
    x = ctx.mask_padding(x, axes, reduce_identity(kind, x.dtype))
    per_shard = Sharding(target.dims, split, kind)
    value = ctx.emit("reduce", [x], {"kind": kind, "axes": axes}, per_shard, node.shape, x.dtype)
    best = ctx.reshard(value, Sharding(target.dims))  # planner: all-reduce max (min) over the split axes
    # the per-block index is only read locally, next line; labelled partial 'min' like the candidate
    candidates = Sharding(target.dims, split, "min")
    index = ctx.emit(ARG_IN_BLOCK, [x, ctx.shard_index(split)], {"kind": kind, "axes": axes}, candidates,
                     node.shape, "int64")
    # returned partial 'min': the driver's reshard to ``target`` is the all-reduce min over the split axes
    return ctx.emit(ARG_CANDIDATE, [value, best, index], {}, candidates, node.shape, "int64")


def _operand_sharding(x: Sharding, target: Sharding, axis: int) -> Sharding:
    """The operand's layout for a local search: kept dims as the result wants them, the searched dim keeps
    its split minus axes the result uses elsewhere (as the reduce rule)."""
    kept, dims = iter(target.dims), []
    for i, d in enumerate(x.dims):
        dims.append(tuple(a for a in d if a not in target.axes) if i == axis else next(kept))
    return Sharding(tuple(dims))


@opdef.vjp(ARGMAX, ARGMIN)
def _arg_reduce_vjp(node, g, ops, y):
    """An index result carries no gradient (it is piecewise constant in x)."""
    return [None]
