"""``jax.lax``'s names for what the project has under other names: ``import spmd_runtime.lax as lax``.

Thin aliases with JAX's signatures (arguments adapted where the project's function differs); every name
lowers onto an existing op family, so it partitions and differentiates like the function it calls.
Differences from JAX, stated where they apply: ``fori_loop`` needs static int bounds (use ``while_loop``
for traced ones); ``scan``'s ``unroll`` is accepted and ignored; ``reduce_window`` takes ``lax.add`` /
``lax.max`` / ``lax.min`` with their identity as ``init_value``; ``conv_general_dilated``'s
``dimension_numbers`` are the string form (('NHWC', 'HWIO', 'NHWC'), ...) or None (NCHW, OIHW, NCHW);
``precision`` / ``preferred_element_type`` are accepted, and a preferred type is the result's dtype.
The collectives (``psum``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``,
``axis_index``) run inside ``sr.shard_map`` regions, as in JAX.
"""
from __future__ import annotations

import string

import numpy as np

from . import nn
from .ops import core
from .ops.control import cond, scan as _scan, while_loop
from .ops.control import fori_loop as _fori_loop
from .ops.core import (abs, add, broadcast_in_dim, exp, log, maximum as max, minimum as min, multiply as mul,  # noqa: A004
                       negative as neg, sqrt, stop_gradient, subtract as sub, tanh, where as select)
from .ops.einsum import dot as core_dot, einsum
from .ops.indexing import argmax as core_argmax, argmin as core_argmin
from .ops.manual import all_gather, all_to_all, axis_index, pmax, pmin, ppermute, psum, psum_scatter
from .ops.slicing import concatenate as core_concatenate
from .ops.slicing import (broadcasted_iota, dynamic_slice, dynamic_update_slice, iota, lax_pad as pad,
                          lax_slice as slice, reverse, slice_in_dim)
from .ops.special import erf, erfc, erfinv as erf_inv
from .ops.top_k import top_k
from .ops.windows import conv, cumsum as _cumsum, reduce_window as _reduce_window

__all__ = ["abs", "add", "sub", "mul", "div", "neg", "max", "min", "pow", "integer_pow", "exp", "log", "tanh",
           "sqrt", "rsqrt", "square", "logistic", "erf", "erfc", "erf_inv", "eq", "ne", "lt", "le", "gt", "ge",
           "select", "clamp", "convert_element_type", "stop_gradient", "broadcast_in_dim", "broadcast",
           "reshape", "transpose", "squeeze", "expand_dims", "rev", "iota", "broadcasted_iota", "slice",
           "slice_in_dim", "dynamic_slice", "dynamic_slice_in_dim", "dynamic_update_slice",
           "dynamic_update_slice_in_dim", "pad", "concatenate", "dot", "dot_general", "conv_general_dilated",
           "reduce_window", "reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "cumsum", "top_k",
           "scan", "cond", "while_loop", "fori_loop", "psum", "pmax", "pmin", "all_gather", "psum_scatter",
           "all_to_all", "ppermute", "axis_index"]


# ================================================================ elementwise
def div(x, y): return core.divide(x, y)
def pow(x, y): return core.power(x, y)  # noqa: A001
def integer_pow(x, y: int): return core.power(x, int(y))
def rsqrt(x): return 1.0 / core.sqrt(x)
def square(x): return core.multiply(x, x)
def eq(x, y): return core.equal(x, y)
def ne(x, y): return core.not_equal(x, y)
def lt(x, y): return core.less(x, y)
def le(x, y): return core.less_equal(x, y)
def gt(x, y): return core.greater(x, y)
def ge(x, y): return core.greater_equal(x, y)


logistic = nn.sigmoid


def clamp(min, x, max):  # noqa: A002  (jax.lax.clamp's argument names and order)
    return core.minimum(core.maximum(x, min), max)


def convert_element_type(operand, new_dtype):
    return core.astype(operand, new_dtype)


# ================================================================ shapes
def broadcast(operand, sizes):
    """``operand`` with leading dims ``sizes`` added."""
    operand = core.asarray(operand)
    sizes = tuple(int(s) for s in sizes)
    return broadcast_in_dim(operand, sizes + operand.shape, tuple(range(len(sizes), len(sizes) + operand.ndim)))


def reshape(operand, new_sizes, dimensions=None):
    """``operand`` (transposed by ``dimensions`` first, when given) reshaped to ``new_sizes``."""
    operand = core.asarray(operand) if dimensions is None else core.transpose(operand, dimensions)
    return core.reshape(operand, tuple(new_sizes))


def transpose(operand, permutation):
    return core.transpose(operand, tuple(permutation))


def squeeze(array, dimensions):
    return core.squeeze(array, tuple(dimensions))


def expand_dims(array, dimensions):
    return core.expand_dims(array, tuple(dimensions))


def rev(operand, dimensions):
    return reverse(operand, tuple(dimensions))


def concatenate(operands, dimension):
    return core_concatenate(operands, axis=dimension)


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
    operand = core.asarray(operand)
    axis = core.normalize_axis(axis, operand.ndim)
    starts = [start_index if d == axis else 0 for d in range(operand.ndim)]
    return dynamic_slice(operand, starts, [slice_size if d == axis else n for d, n in enumerate(operand.shape)])


def dynamic_update_slice_in_dim(operand, update, start_index, axis):
    operand = core.asarray(operand)
    axis = core.normalize_axis(axis, operand.ndim)
    return dynamic_update_slice(operand, update, [start_index if d == axis else 0 for d in range(operand.ndim)])


# ================================================================ contractions and windows
def dot(lhs, rhs, precision=None, preferred_element_type=None):
    return _preferred(core_dot(lhs, rhs), preferred_element_type)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """XLA's DotGeneral: ``dimension_numbers = ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``;
    the result's dims are the batch dims, then lhs's free dims, then rhs's (an einsum of letters)."""
    lhs, rhs = core.asarray(lhs), core.asarray(rhs)
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = ([core.normalize_axis(d, t.ndim) for d in ds] for ds, t in ((lc, lhs), (rc, rhs), (lb, lhs),
                                                                                 (rb, rhs)))
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dot_general pairs lhs and rhs dims: as many contracting and batch dims on each side; got "
                         f"dimension_numbers {dimension_numbers}")
    letters = iter(string.ascii_letters)
    left = [next(letters) for _ in range(lhs.ndim)]
    right = [next(letters) for _ in range(rhs.ndim)]
    for a, b in zip(lc + lb, rc + rb):
        right[b] = left[a]
    free_left = [left[d] for d in range(lhs.ndim) if d not in lc + lb]
    free_right = [right[d] for d in range(rhs.ndim) if d not in rc + rb]
    out = "".join([left[d] for d in lb] + free_left + free_right)
    return _preferred(einsum(f"{''.join(left)},{''.join(right)}->{out}", lhs, rhs), preferred_element_type)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """jax.lax.conv_general_dilated; ``dimension_numbers`` None (NCHW, OIHW, NCHW) or three layout strings
    such as ('NHWC', 'HWIO', 'NHWC'): the operands are transposed to the (N, C, *spatial) layout of
    ``snp.conv`` and the result back."""
    if batch_group_count != 1:
        raise NotImplementedError(f"conv_general_dilated supports batch_group_count=1; got {batch_group_count}")
    lhs, rhs = core.asarray(lhs), core.asarray(rhs)
    if dimension_numbers is not None:
        lhs_spec, rhs_spec, out_spec = dimension_numbers
        lhs = core.transpose(lhs, _layout(lhs_spec, "NC"))
        rhs = core.transpose(rhs, _layout(rhs_spec, "OI"))
    out = conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, feature_group_count)
    if dimension_numbers is not None:
        out = core.transpose(out, np.argsort(_layout(out_spec, "NC")).tolist())
    return _preferred(out, preferred_element_type)


def _layout(spec: str, leading: str) -> list[int]:
    """The permutation taking a layout string (e.g. 'NHWC') to (leading..., spatial dims in their order)."""
    if not isinstance(spec, str) or sorted(set(spec)) != sorted(spec) or not set(leading) <= set(spec):
        raise ValueError(f"conv_general_dilated's dimension_numbers are layout strings naming {leading[0]} and "
                         f"{leading[1]} once each (e.g. 'NHWC', 'HWIO'); got {spec!r}")
    return [spec.index(c) for c in leading] + [i for i, c in enumerate(spec) if c not in leading]


_REDUCERS = {add: ("sum", 0), max: ("max", -np.inf), min: ("min", np.inf)}


def reduce_window(operand, init_value, computation, window_dimensions, window_strides, padding,
                  base_dilation=None, window_dilation=None):
    """jax.lax.reduce_window for ``computation`` lax.add, lax.max or lax.min with its identity as
    ``init_value`` (0, -inf, inf; the dtype's min/max for integers); padding "VALID", "SAME" or pairs."""
    if any(d is not None and any(int(v) != 1 for v in d) for d in (base_dilation, window_dilation)):
        raise NotImplementedError("reduce_window supports base_dilation and window_dilation of 1; got "
                                  f"{base_dilation}, {window_dilation}")
    kind, identity = _REDUCERS.get(computation, (None, None))
    operand = core.asarray(operand)
    if kind is None or float(init_value) not in (identity, float(core.reduce_identity(kind, operand.dtype))):
        raise ValueError(f"reduce_window takes computation lax.add, lax.max or lax.min with its identity as "
                         f"init_value; got {computation!r} with init_value {init_value!r}")
    return _reduce_window(operand, kind, tuple(window_dimensions), tuple(window_strides), padding)


def reduce_sum(operand, axes): return core.sum(operand, axis=tuple(axes))
def reduce_max(operand, axes): return core.max(operand, axis=tuple(axes))
def reduce_min(operand, axes): return core.min(operand, axis=tuple(axes))


def argmax(operand, axis: int, index_dtype="int32"):
    return core.astype(core_argmax(operand, axis=axis), index_dtype)


def argmin(operand, axis: int, index_dtype="int32"):
    return core.astype(core_argmin(operand, axis=axis), index_dtype)


def cumsum(operand, axis: int = 0, reverse: bool = False):  # noqa: A002
    if not reverse:
        return _cumsum(operand, axis=axis, dtype=core.asarray(operand).dtype)
    return rev(_cumsum(rev(operand, (axis,)), axis=axis, dtype=core.asarray(operand).dtype), (axis,))


def _preferred(out, dtype):
    return out if dtype is None else core.astype(out, dtype)


# ================================================================ control flow
def scan(f, init, xs=None, length=None, reverse=False, unroll=1):
    """jax.lax.scan (``unroll`` is accepted and ignored: the loop runs as one scan op)."""
    return _scan(f, init, xs, length=length, reverse=reverse)


def fori_loop(lower, upper, body_fun, init_val, *, unroll=None):
    """jax.lax.fori_loop with static int bounds (traced bounds: ``while_loop``)."""
    return _fori_loop(lower, upper, body_fun, init_val)

