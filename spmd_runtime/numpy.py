"""NumPy-named functions on traced tensors: ``import spmd_runtime.numpy as snp``.

The NumPy face of the op records: every name here is a traced function of one op family in
``spmd_runtime/ops/`` (which defines the op, its shape/dtype rule and kernel; the layers' rules for it
live in ``partition/rules/`` and ``autodiff/rules/``, one module per family). Binary ops broadcast
NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; Python scalars are weakly typed
(NEP 50): ``x * 2.0`` keeps x's dtype.
"""
import functools

from .trace import trace_state
from .ops.core import (asarray, array, zeros, ones, full, add, subtract, multiply, divide, true_divide,
    power, negative, exp, log, tanh, sqrt, abs, absolute, square, maximum, minimum, where, equal, not_equal,
    less, less_equal, greater, greater_equal, logical_and, logical_or, logical_not, sum, max, min, amax,
    amin, mean, var, reshape, transpose, swapaxes, moveaxis, expand_dims, squeeze, broadcast_to, astype,
    broadcast_in_dim)
from .ops.einsum import dot, einsum, matmul
from .ops.gather import scatter_add, take
from .ops.indexing import argmax, argmin, logsumexp, softmax
from .ops.slicing import (arange, broadcasted_iota, concatenate, dynamic_slice, dynamic_update_slice, flip,
    iota, lax_pad, pad, reverse, roll, slice_in_dim, stack, static_slice)
from .ops.special import erf, erfc, erfinv
from .ops.top_k import top_k
from .ops.windows import conv, conv_general_dilated, cumsum, reduce_window

__all__ = ["asarray", "array", "zeros", "ones", "full", "add", "subtract", "multiply", "divide", "true_divide",
           "power", "negative", "exp", "log", "tanh", "sqrt", "abs", "absolute", "square", "maximum",
           "minimum", "where", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
           "logical_and", "logical_or", "logical_not", "sum", "max", "min", "amax", "amin", "mean", "var",
           "reshape", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze", "broadcast_to", "matmul",
           "dot", "einsum", "astype", "static_slice", "slice_in_dim", "pad", "lax_pad", "concatenate", "stack",
           "reverse", "roll", "flip", "arange", "iota", "broadcasted_iota", "dynamic_slice", "dynamic_update_slice",
           "take", "scatter_add", "conv", "conv_general_dilated", "reduce_window", "cumsum", "argmax",
           "argmin", "logsumexp", "softmax", "top_k",
           "erf", "erfc", "erfinv"]


outside_trace = None  # a call made outside any trace goes here: spmd_runtime/eager.py sets it (None: no eager mode)


def _dispatching(fn):
    """``fn``, handing a call with an operand that speaks the ``__spmd_function__`` protocol (a DArray outside
    ``jit``: ``spmd_runtime/eager.py``) to that operand's type, and a call outside any trace to
    ``outside_trace``; traced calls go straight to ``fn``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        handler = _handler(args) or _handler(kwargs.values())
        if handler is None and getattr(trace_state, "graph", None) is None:
            handler = outside_trace
        if handler is not None:
            return handler(fn, args, kwargs)
        return fn(*args, **kwargs)
    return call


def _handler(values):
    """The protocol's handler of the first operand that has one (one level into lists and tuples: concatenate's
    and stack's operands)."""
    for x in values:
        for y in (x if isinstance(x, (list, tuple)) else (x,)):
            handler = getattr(type(y), "__spmd_function__", None)
            if handler is not None:
                return handler
    return None


globals().update({_name: _dispatching(globals()[_name]) for _name in __all__})
