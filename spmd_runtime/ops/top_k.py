"""top_k: the k largest entries along the last axis and their positions (``jax.lax.top_k``).

``top_k(x, k) -> (values, indices)``: ``values[..., j]`` is the j-th largest entry of ``x[..., :]``
(descending), ``indices[..., j]`` its position (int32, as JAX); equal values are ordered by position,
the lower first. ``1 <= k <= x.shape[-1]``. NaN inputs are not supported.

A graph node has one result, so ``top_k`` emits two nodes of ONE op, ``top_k`` with
``output="values"`` or ``output="indices"``: one record, one kernel, one rule.

The rules live with the layers that own them: sharding propagation and partitioning (local top-k, gathered
candidates, merge) in ``partition/rules/top_k.py``, the VJP in ``autodiff/rules/top_k.py``.
"""
from __future__ import annotations

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

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
