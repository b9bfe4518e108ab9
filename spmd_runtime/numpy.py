"""NumPy-named functions on traced tensors: ``import spmd_runtime.numpy as snp``.

The NumPy face of the op records: every name here is a traced function of one op family in
``spmd_runtime/ops/`` (which defines the op, its shape/dtype rule and kernel; the layers' rules for it
live in ``partition/rules/`` and ``autodiff/rules/``, one module per family). Binary ops broadcast
NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; dtypes promote by JAX's rules (the table in
``spmd_runtime/dtypes.py``: Python scalars weak, ``x * 2.0`` keeps x's dtype, float32 by default, float64 only
where asked for or with ``sr.config.update("enable_x64", True)``).
"""
from .ops.core import (asarray, array, zeros, ones, full, add, subtract, multiply, divide, true_divide,
    power, negative, exp, log, tanh, sqrt, abs, absolute, square, maximum, minimum, where, equal, not_equal,
    less, less_equal, greater, greater_equal, logical_and, logical_or, logical_not, sum, max, min, amax,
    amin, mean, var, reshape, transpose, swapaxes, moveaxis, expand_dims, squeeze, broadcast_to, astype,
    broadcast_in_dim)
from .ops.core import (sin, cos, tan, arcsin, arccos, arctan, arctan2, sinh, cosh, arcsinh, arccosh, arctanh,
    asin, acos, atan, atan2, asinh, acosh, atanh, log1p, expm1, log2, log10, exp2, logaddexp, sigmoid, reciprocal,
    rsqrt, cbrt, floor, ceil, round, around, trunc, fix, rint, sign, signbit, copysign, hypot, clip, isfinite,
    isnan, isinf, nan_to_num, floor_divide, remainder, mod, fmod, divmod, bitwise_and, bitwise_or, bitwise_xor,
    bitwise_invert, bitwise_not, invert, bitwise_left_shift, bitwise_right_shift, left_shift, right_shift,
    positive, float_power, pow, logical_xor, heaviside, deg2rad, rad2deg, radians, degrees, fmax, fmin)
from .ops.einsum import dot, einsum, matmul
from .ops.gather import scatter_add, take
from .ops.indexing import argmax, argmin, logsumexp, softmax
from .ops.slicing import (arange, broadcasted_iota, concatenate, dynamic_slice, dynamic_update_slice, flip,
    iota, lax_pad, pad, reverse, roll, slice_in_dim, stack, static_slice)
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
           "argmin", "logsumexp", "softmax", "top_k"]
__all__ = __all__ + ["sin", "cos", "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh", "arcsinh", "arccosh",
            "arctanh", "asin", "acos", "atan", "atan2", "asinh", "acosh", "atanh", "log1p", "expm1", "log2", "log10",
            "exp2", "logaddexp", "sigmoid", "reciprocal", "rsqrt", "cbrt", "floor", "ceil", "round", "around",
            "trunc", "fix", "rint", "sign", "signbit", "copysign", "hypot", "clip", "isfinite", "isnan", "isinf",
            "nan_to_num", "floor_divide", "remainder", "mod", "fmod", "divmod", "bitwise_and", "bitwise_or",
            "bitwise_xor", "bitwise_invert", "bitwise_not", "invert", "bitwise_left_shift", "bitwise_right_shift",
            "left_shift", "right_shift", "positive", "float_power", "pow", "logical_xor", "heaviside", "deg2rad",
            "rad2deg", "radians", "degrees", "fmax", "fmin"]
