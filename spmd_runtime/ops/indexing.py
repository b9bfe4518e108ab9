"""Index reductions (argmax, argmin) and the max-shifted reductions built on them (logsumexp, softmax).

``argmax`` / ``argmin`` follow NumPy: the FIRST position of the extreme value, an int64
result; ``axis=None`` searches the flattened array. NaN inputs are not supported on a
split axis (MPI max/min do not order NaN like ``np.argmax``).

This file holds the records (``arg_in_block`` and ``arg_candidate`` are the two program ops a
split search emits), the traced functions (the shape/dtype rules) and the kernels; how a split
axis is searched is the partition rule's, in ``spmd_runtime/partition/rules/indexing.py`` (with the
propagation rule), and the VJP is in ``spmd_runtime/autodiff/rules/indexing.py``.
"""
from __future__ import annotations

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

__all__ = ["argmax", "argmin", "logsumexp", "softmax"]

ARGMAX = define("argmax")
ARGMIN = define("argmin")
ARG_IN_BLOCK = define("arg_in_block", "program")  # global position of a block's first extreme
ARG_CANDIDATE = define("arg_candidate", "program")  # a block's index where it holds the best value

_NO_INDEX = np.iinfo(np.int64).max  # loses every MIN against a real index


# ---------------------------------------------------------------- traced API
def argmax(x, axis=None, keepdims=False) -> Tensor:
    """``np.argmax``: int64 positions of the first maximum along ``axis`` (None: of the flattened array)."""
    return _arg_reduce(ARGMAX, x, axis, keepdims)


def argmin(x, axis=None, keepdims=False) -> Tensor:
    """``np.argmin``: int64 positions of the first minimum along ``axis`` (None: of the flattened array)."""
    return _arg_reduce(ARGMIN, x, axis, keepdims)


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
