"""NumPy-named functions on traced tensors: ``import spmd_runtime.numpy as snp``.

The NumPy face of the op records: every name here is a traced function of one op family in
``spmd_runtime/ops/`` (which defines the op, its shape/dtype rule and kernel; the layers' rules for it
live in ``partition/rules/`` and ``autodiff/rules/``, one module per family). Binary ops broadcast
NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; dtypes promote by JAX's rules (the table in
``spmd_runtime/dtypes.py``: Python scalars weak, ``x * 2.0`` keeps x's dtype, float32 by default, float64 only
where asked for or with ``sr.config.update("enable_x64", True)``).
"""
import numpy as np

from . import dispatch
from .ops.core import (array, zeros, ones, full, add, subtract, multiply, divide, true_divide,
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
from .ops.special import conj, conjugate, erf, erfc, erfinv, imag, real
from .ops.top_k import top_k
from .ops.windows import conv, conv_general_dilated, cumsum, reduce_window

# ---- non-elementwise coverage (issue 28): creation, manipulation, sorting, reductions, linalg, constants
from . import numpy_fft as fft
from . import numpy_linalg as linalg
from .ops.creation import (asarray, empty, empty_like, eye, full_like, identity, linspace, logspace, meshgrid,
    ones_like, tri, tril, triu, zeros_like)
from .ops.linalg import (diagonal, inner, matrix_transpose, outer, tensordot, trace, vdot, vecdot)
from .ops.manipulation import (array_split, atleast_1d, atleast_2d, atleast_3d, broadcast_arrays, broadcast_shapes,
    column_stack, diff, dstack, hstack, permute_dims, ravel, repeat, split, tile, unstack, vstack)
from .ops.reductions import (all, any, average, count_nonzero, cumprod, cumulative_prod, cumulative_sum, nanmax,
    nanmean, nanmin, nanprod, nansum, prod, ptp, std)
from .ops.sorting import (argsort, argwhere, flatnonzero, nonzero, searchsorted, sort, take_along_axis, unique,
    unique_all, unique_counts, unique_inverse, unique_values)
from .dtypes import can_cast, isdtype, result_type
from .ops.core import check_device
from numpy import (bool_, complex64, complex128, dtype, e, finfo, float16, float32, float64, iinfo, inf, int8,
    int16, int32, int64, nan, newaxis, pi, uint8, uint16, uint32, uint64)

bool = bool_  # noqa: A001  (the Array API's name of the boolean dtype)
concat = concatenate  # the Array API's name


def from_dlpack(x, /, *, device=None, copy=None):
    """The Array API's ``from_dlpack``: another library's array (any that exports DLPack) as ``asarray`` makes it (a
    replicated DArray on the context mesh outside a trace, a constant inside); a DArray stays as it is."""
    check_device(device, "from_dlpack")
    if getattr(type(x), "__spmd_function__", None) is not None:  # a DArray (the eager protocol's type)
        return x
    return asarray(np.from_dlpack(x) if copy is None else np.from_dlpack(x, copy=copy))


__all__ = ["asarray", "array", "zeros", "ones", "full", "add", "subtract", "multiply", "divide", "true_divide",
           "power", "negative", "exp", "log", "tanh", "sqrt", "abs", "absolute", "square", "maximum",
           "minimum", "where", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
           "logical_and", "logical_or", "logical_not", "sum", "max", "min", "amax", "amin", "mean", "var",
           "reshape", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze", "broadcast_to", "matmul",
           "dot", "einsum", "astype", "static_slice", "slice_in_dim", "pad", "lax_pad", "concatenate", "stack",
           "reverse", "roll", "flip", "arange", "iota", "broadcasted_iota", "dynamic_slice", "dynamic_update_slice",
           "take", "scatter_add", "conv", "conv_general_dilated", "reduce_window", "cumsum", "argmax",
           "argmin", "logsumexp", "softmax", "top_k"] + \
    ["linalg", "empty", "empty_like", "eye", "full_like", "identity", "linspace", "logspace", "meshgrid",
    "ones_like", "tri", "tril", "triu", "zeros_like", "diagonal", "inner", "matrix_transpose", "outer",
    "tensordot", "trace", "vdot", "vecdot", "array_split", "atleast_1d", "atleast_2d", "atleast_3d",
    "broadcast_arrays", "broadcast_shapes", "column_stack", "diff", "dstack", "hstack", "permute_dims",
    "ravel", "repeat", "split", "tile", "unstack", "vstack", "all", "any", "average", "count_nonzero",
    "cumprod", "cumulative_prod", "cumulative_sum", "nanmax", "nanmean", "nanmin", "nanprod", "nansum",
    "prod", "ptp", "std", "argsort", "searchsorted", "sort", "take_along_axis", "nonzero", "flatnonzero",
    "argwhere", "unique", "bool_", "complex64",
    "complex128", "dtype", "e", "finfo", "float16", "float32", "float64", "iinfo", "inf", "int8", "int16",
    "int32", "int64", "nan", "newaxis", "pi", "uint8", "uint16", "uint32", "uint64", "bool", "concat", "can_cast",
    "isdtype", "result_type", "unique_all", "unique_counts", "unique_inverse", "unique_values", "from_dlpack", "fft"] + \
    ["sin", "cos", "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh", "arcsinh", "arccosh",
            "arctanh", "asin", "acos", "atan", "atan2", "asinh", "acosh", "atanh", "log1p", "expm1", "log2", "log10",
            "exp2", "logaddexp", "sigmoid", "reciprocal", "rsqrt", "cbrt", "floor", "ceil", "round", "around",
            "trunc", "fix", "rint", "sign", "signbit", "copysign", "hypot", "clip", "isfinite", "isnan", "isinf",
            "nan_to_num", "floor_divide", "remainder", "mod", "fmod", "divmod", "bitwise_and", "bitwise_or",
            "bitwise_xor", "bitwise_invert", "bitwise_not", "invert", "bitwise_left_shift", "bitwise_right_shift",
            "left_shift", "right_shift", "positive", "float_power", "pow", "logical_xor", "heaviside", "deg2rad",
            "rad2deg", "radians", "degrees", "fmax", "fmin",
            "erf", "erfc", "erfinv", "conj", "conjugate", "imag", "real"]


# snp calls on DArrays, or outside any trace, run eagerly (spmd_runtime/dispatch.py, eager.py)
dispatch.wrap_functions(globals(), __all__, keep=("broadcast_shapes", "can_cast", "isdtype", "result_type",
                                                  "from_dlpack"))
