"""Core ops: leaves, elementwise, broadcast / reshape / transpose and reductions, each ONE record.

The traced functions here are the NumPy-named face ``spmd_runtime.numpy`` re-exports. Binary ops
broadcast NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; Python scalars are weakly
typed (NEP 50): ``x * 2.0`` keeps x's dtype. This file holds the records, the traced functions (the
shape/dtype rules), the kernels and the helpers they use (``reduce_identity`` also for the rules);
the layers own the other parts: the propagation and partition rules in
``spmd_runtime/partition/rules/core.py``, the VJPs in ``spmd_runtime/autodiff/rules/core.py``
(``spmd_runtime/opdef.py`` says what each part is).
"""
from __future__ import annotations

import builtins
import functools
import math

import numpy as np

from .. import opdef
from ..dtypes import ACCUMULATE, is_low_precision, result_type, sum_dtype
from ..graph import MESH_SPLIT, PARAMETER
from ..opdef import define
from ..trace import Tensor, current_graph, emit

REDUCE_KINDS = frozenset({"sum", "max", "min", "prod", "mean", "any", "all"})


def reduction(xp, kind: str):
    """The array module's reduction ``kind``, taken from an allow-list: ``kind`` may come from a program file."""
    if kind not in REDUCE_KINDS:
        raise ValueError(f"a reduction kind must be one of {sorted(REDUCE_KINDS)}; got {kind!r}")
    return getattr(xp, kind)


# ================================================================ records
CONSTANT = define("constant", read_only=True)  # the program's array
STOP_GRADIENT = define("stop_gradient")  # the value itself; no cotangent flows back through it
UNARY_UFUNCS = {"neg": "negative", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "abs": "absolute",
                "not": "logical_not"}
BINARY_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
                 "maximum": "maximum", "minimum": "minimum", "eq": "equal", "ne": "not_equal", "lt": "less",
                 "le": "less_equal", "gt": "greater", "ge": "greater_equal", "and": "logical_and",
                 "or": "logical_or"}
EXPENSIVE = ("exp", "log", "tanh", "sqrt", "div", "pow")  # transcendental or a division: never ``cheap``
ELEMENTWISE = {name: define(name, fresh=True, in_place=True, ufunc=ufunc, cheap=name not in EXPENSIVE)
               for name, ufunc in {**UNARY_UFUNCS, **BINARY_UFUNCS}.items()}
UNARY = tuple(ELEMENTWISE[n] for n in UNARY_UFUNCS)
BINARY = tuple(ELEMENTWISE[n] for n in BINARY_UFUNCS)
NEG, EXP, LOG, TANH, SQRT, ABS, NOT = UNARY  # by name, for the layers that key tables by record (code generators)
ADD, SUB, MUL, DIV, POW, MAXIMUM, MINIMUM, EQ, NE, LT, LE, GT, GE, AND, OR = BINARY
COMPARISONS = tuple(ELEMENTWISE[n] for n in ("eq", "ne", "lt", "le", "gt", "ge"))
SELECT = define("select", fresh=True, cheap=True)
CONVERT = define("convert", fresh=True, cheap=True)
ELEMENTWISE_LIKE = UNARY + BINARY + (SELECT, CONVERT)  # same shape in and out, computed pointwise
BROADCAST_IN_DIM = define("broadcast_in_dim")
RESHAPE = define("reshape")
TRANSPOSE = define("transpose")
REDUCE = define("reduce", fresh=True)


# ================================================================ traced API
# ---------------------------------------------------------------- constants
def asarray(x, dtype=None) -> Tensor:
    """A traced tensor for ``x``: tensors pass through, arrays and scalars become constants."""
    if isinstance(x, Tensor):
        return x if dtype is None else astype(x, dtype)
    value = np.asarray(x, dtype=dtype)
    return emit(CONSTANT, [], {"value": value}, value.shape, value.dtype)


array = asarray


def stop_gradient(x) -> Tensor:
    """``x`` for the forward computation, a constant for differentiation (JAX's ``lax.stop_gradient``): what a
    numerically safe softmax subtracts (its row max) moves no gradient, as in JAX's and PyTorch's softmax."""
    x = asarray(x)
    return emit(STOP_GRADIENT, [x], {}, x.shape, x.dtype)


def full(shape, fill_value, dtype="float32") -> Tensor:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return broadcast_to(asarray(np.asarray(fill_value, dtype=dtype)), shape)


def zeros(shape, dtype="float32") -> Tensor:
    return full(shape, 0, dtype)


def ones(shape, dtype="float32") -> Tensor:
    return full(shape, 1, dtype)


# ---------------------------------------------------------------- elementwise
def _operands(*xs):
    """Turn operands into tensors of one dtype and one broadcast shape; Python scalars are weak."""
    dtype = result_type(*xs)
    if not any(isinstance(x, Tensor) for x in xs):
        current_graph()
    ts = [astype(x, dtype) if isinstance(x, Tensor) else asarray(np.asarray(x, dtype=dtype)) for x in xs]
    shape = np.broadcast_shapes(*[t.shape for t in ts])
    return [broadcast_to(t, shape) for t in ts], dtype, shape


def _unary(op, x, dtype=None):
    (x,), xdtype, shape = _operands(x)
    return emit(op, [x], {}, shape, dtype or xdtype)


def _binary(op, a, b, out_dtype=None):
    (a, b), dtype, shape = _operands(a, b)
    return emit(op, [a, b], {}, shape, out_dtype or dtype)


def _float(x):
    return astype(x, result_type(x, 1.0)) if isinstance(x, Tensor) else x


def add(a, b): return _binary(ELEMENTWISE["add"], a, b)
def subtract(a, b): return _binary(ELEMENTWISE["sub"], a, b)
def multiply(a, b): return _binary(ELEMENTWISE["mul"], a, b)
def divide(a, b): return _binary(ELEMENTWISE["div"], _float(a), _float(b))
def power(a, b): return _binary(ELEMENTWISE["pow"], a, b)
def maximum(a, b): return _binary(ELEMENTWISE["maximum"], a, b)
def minimum(a, b): return _binary(ELEMENTWISE["minimum"], a, b)
def equal(a, b): return _binary(ELEMENTWISE["eq"], a, b, "bool")
def not_equal(a, b): return _binary(ELEMENTWISE["ne"], a, b, "bool")
def less(a, b): return _binary(ELEMENTWISE["lt"], a, b, "bool")
def less_equal(a, b): return _binary(ELEMENTWISE["le"], a, b, "bool")
def greater(a, b): return _binary(ELEMENTWISE["gt"], a, b, "bool")
def greater_equal(a, b): return _binary(ELEMENTWISE["ge"], a, b, "bool")
def logical_and(a, b): return _binary(ELEMENTWISE["and"], astype(a, "bool"), astype(b, "bool"))
def logical_or(a, b): return _binary(ELEMENTWISE["or"], astype(a, "bool"), astype(b, "bool"))
def logical_not(x): return _unary(ELEMENTWISE["not"], astype(x, "bool"))
def negative(x): return _unary(ELEMENTWISE["neg"], x)
def exp(x): return _unary(ELEMENTWISE["exp"], _float(x))
def log(x): return _unary(ELEMENTWISE["log"], _float(x))
def tanh(x): return _unary(ELEMENTWISE["tanh"], _float(x))
def sqrt(x): return _unary(ELEMENTWISE["sqrt"], _float(x))
def absolute(x): return _unary(ELEMENTWISE["abs"], x)
def square(x): return multiply(x, x)


true_divide, abs = divide, absolute


def where(cond, a, b) -> Tensor:
    """Select ``a`` where ``cond`` else ``b``, broadcasting all three."""
    (a, b), dtype, _ = _operands(a, b)
    cond = astype(asarray(cond), "bool")
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    cond, a, b = (broadcast_to(t, shape) for t in (cond, a, b))
    return emit(SELECT, [cond, a, b], {}, shape, dtype)


def astype(x, dtype) -> Tensor:
    x, dtype = asarray(x), np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return emit(CONVERT, [x], {"dtype": dtype.name}, x.shape, dtype)


# ---------------------------------------------------------------- shapes
def broadcast_to(x, shape) -> Tensor:
    x, shape = asarray(x), tuple(shape)
    if x.shape == shape:
        return x
    if np.broadcast_shapes(x.shape, shape) != shape:
        raise ValueError(f"broadcast_to needs a shape that {x.shape} broadcasts to; got {shape}")
    dims = tuple(range(len(shape) - x.ndim, len(shape)))
    return broadcast_in_dim(x, shape, dims)


def broadcast_in_dim(x, shape, dims) -> Tensor:
    """XLA's BroadcastInDim: operand dim i becomes result dim dims[i] (size equal, or 1)."""
    x, shape, dims = asarray(x), tuple(int(s) for s in shape), tuple(int(d) for d in dims)
    ok = len(dims) == x.ndim and list(dims) == sorted(set(dims)) and all(
        x.shape[i] in (1, shape[d]) for i, d in enumerate(dims))
    if not ok:
        raise ValueError(f"broadcast_in_dim maps each operand dim to an increasing result dim of equal size or "
                         f"from size 1; got operand {x.shape}, shape {shape}, dims {dims}")
    if x.node.op == BROADCAST_IN_DIM.name:  # fold a chain of broadcasts into one
        inner = x.node
        x, dims = Tensor(x.graph, inner.inputs[0]), tuple(dims[d] for d in inner.attrs["dims"])
    return emit(BROADCAST_IN_DIM, [x], {"shape": shape, "dims": dims}, shape, x.dtype)


def reshape(x, *shape) -> Tensor:
    x = asarray(x)
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"reshape keeps the number of elements; got {x.shape} ({x.size}) to {shape}")
    if shape == x.shape:
        return x
    return emit(RESHAPE, [x], {"shape": shape}, shape, x.dtype)


def transpose(x, axes=None, *more) -> Tensor:
    x = asarray(x)
    if more:
        axes = (axes,) + more
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(normalize_axis(a, x.ndim) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose needs a permutation of 0..{x.ndim - 1}; got {axes}")
    if perm == tuple(range(x.ndim)):
        return x
    return emit(TRANSPOSE, [x], {"perm": perm}, tuple(x.shape[p] for p in perm), x.dtype)


def swapaxes(x, a, b) -> Tensor:
    perm = list(range(x.ndim))
    a, b = normalize_axis(a, x.ndim), normalize_axis(b, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def moveaxis(x, source, destination) -> Tensor:
    perm = [i for i in range(x.ndim) if i != normalize_axis(source, x.ndim)]
    perm.insert(normalize_axis(destination, x.ndim), normalize_axis(source, x.ndim))
    return transpose(x, perm)


def expand_dims(x, axis) -> Tensor:
    x = asarray(x)
    axes = sorted(normalize_axis(a, x.ndim + len(as_tuple(axis))) for a in as_tuple(axis))
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return broadcast_in_dim(x, shape, [i for i in range(len(shape)) if i not in axes])


def squeeze(x, axis=None) -> Tensor:
    x = asarray(x)
    axes = [i for i, s in enumerate(x.shape) if s == 1] if axis is None else [normalize_axis(a, x.ndim) for a in as_tuple(axis)]
    return reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


# ---------------------------------------------------------------- reductions
def _reduce(kind, x, axis, keepdims, dtype=None):
    x = asarray(x) if dtype is None else astype(x, dtype)
    axes = tuple(range(x.ndim)) if axis is None else tuple(sorted({normalize_axis(a, x.ndim) for a in as_tuple(axis)}))
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    out = emit(REDUCE, [x], {"kind": kind, "axes": axes}, shape, x.dtype) if axes else x
    if keepdims:
        kept = [i for i in range(x.ndim) if i not in axes]
        out = broadcast_in_dim(out, tuple(1 if i in axes else s for i, s in enumerate(x.shape)), kept)
    return out


def sum(x, axis=None, keepdims=False, dtype=None):
    """NumPy's sum: bools and narrow integers are summed in the platform integer (``dtypes.sum_dtype``), so a
    partitioned sum's partial sums and their all-reduce have the dtype NumPy's sum has."""
    x = asarray(x)
    if dtype is None and sum_dtype(x.dtype) != x.dtype:
        dtype = sum_dtype(x.dtype)
    return _reduce("sum", x, axis, keepdims, dtype)


def max(x, axis=None, keepdims=False): return _reduce("max", x, axis, keepdims)
def min(x, axis=None, keepdims=False): return _reduce("min", x, axis, keepdims)


amax, amin = max, min


def prod(x, axis=None, keepdims=False, dtype=None):
    """NumPy's prod: bools and narrow integers multiply in the platform integer, as ``sum``; a partitioned
    product's partial products combine by a product all-reduce (MPI.PROD)."""
    x = asarray(x)
    if dtype is None and sum_dtype(x.dtype) != x.dtype:
        dtype = sum_dtype(x.dtype)
    return _reduce("prod", x, axis, keepdims, dtype)


def mean(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    x = _float(asarray(x if dtype is None else astype(x, dtype)))
    axes = range(x.ndim) if axis is None else as_tuple(axis)
    count = math.prod(x.shape[normalize_axis(a, x.ndim)] for a in axes)
    return multiply(sum(x, axis, keepdims), 1.0 / count)


def var(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, correction=None) -> Tensor:
    """The mean squared deviation over ``count - correction`` (Array API ``correction``, NumPy's ``ddof``)."""
    if out is not None:
        raise ValueError(f"var returns a new traced tensor (no out= buffers); got out={out!r}")
    if correction is not None and ddof:
        raise ValueError(f"var takes ddof or correction, not both; got ddof={ddof!r}, correction={correction!r}")
    x = _float(asarray(x if dtype is None else astype(x, dtype)))
    centred = subtract(x, mean(x, axis, keepdims=True))
    axes = range(x.ndim) if axis is None else as_tuple(axis)
    count = math.prod(x.shape[normalize_axis(a, x.ndim)] for a in axes)
    correction = ddof if correction is None else correction
    return multiply(sum(multiply(centred, centred), axis, keepdims), 1.0 / builtins.max(count - correction, 0))


# ---------------------------------------------------------------- helpers
def normalize_axis(a, ndim) -> int:
    a = int(a)
    if not -ndim <= a < ndim:
        raise ValueError(f"axis must be in [-{ndim}, {ndim}); got {a}")
    return a % ndim


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def reduce_identity(kind: str, dtype):
    """The value padding must hold so a ``kind`` reduction ignores it."""
    dtype = np.dtype(dtype)
    if kind == "sum":
        return 0
    if kind == "prod":
        return 1
    if dtype == np.bool_:
        return kind == "min"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(info.min if kind == "max" else info.max)
    return float("-inf") if kind == "max" else float("inf")


# ================================================================ kernels
def _ufunc_kernel(name):
    return lambda xp, *args: getattr(xp, name)(*args)


for _op in ELEMENTWISE.values():
    _op.kernel = _ufunc_kernel(_op.ufunc)


@opdef.kernel(PARAMETER)
def _parameter_kernel(xp, *, index, name=None):
    raise RuntimeError(f"a parameter's value is the caller's input {index}: evaluate and the interpreter bind "
                       f"it directly; got a call of its kernel")


@opdef.kernel(STOP_GRADIENT)
def _stop_gradient_kernel(xp, x):
    return x  # the same value: only differentiation treats it as a constant


@opdef.kernel(MESH_SPLIT)
def _mesh_split_kernel(xp, x, sharding=None, mesh=None, unconstrained=(), name=None, grad_sharding=None):
    return x  # an annotation: the same global value


@opdef.kernel(SELECT)
def _select_kernel(xp, cond, a, b, into=None):
    """``into``: a buffer planned for the result (exec/buffers.py), no operand's."""
    if into is None:
        return xp.where(cond, a, b)
    xp.copyto(into, b)
    xp.copyto(into, a, where=cond)
    return into


@opdef.kernel(CONVERT)
def _convert_kernel(xp, x, dtype, into=None):
    if into is None:
        return x.astype(dtype)
    xp.copyto(into, x, casting="unsafe")
    return into


@opdef.kernel(CONSTANT)
def _constant_kernel(xp, value):
    return xp.asarray(value)


@opdef.kernel(BROADCAST_IN_DIM)
def _broadcast_in_dim_kernel(xp, x, shape, dims):
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = x.shape[i]
    return xp.broadcast_to(x.reshape(expanded), tuple(shape))


@opdef.kernel(RESHAPE)
def _reshape_kernel(xp, x, shape):
    return x.reshape(shape)


@opdef.kernel(TRANSPOSE)
def _transpose_kernel(xp, x, perm):
    return x.transpose(perm)


@opdef.kernel(REDUCE)
def _reduce_kernel(xp, x, kind, axes, into=None):
    if kind == "sum" and is_low_precision(x.dtype):  # accumulate 16-bit sums in float32 (dtypes.py)
        total = xp.sum(x, axis=tuple(axes), dtype=ACCUMULATE)
        if into is None:
            return total.astype(x.dtype)
        into[...] = total  # rounded once, as astype does: a planned buffer holds its value
        return into
    if kind == "sum" and _rows_summed_by_blas(xp, x, axes):
        return _row_sums(x, len(axes), into)
    if kind == "sum" and sum_dtype(x.dtype) != x.dtype:  # a sum in bool (logical or) or a narrow integer:
        return xp.sum(x, axis=tuple(axes), dtype=x.dtype, out=into)  # its declared dtype, not NumPy's wider one
    if into is not None:  # a buffer planned for the result (exec/buffers.py)
        return reduction(xp, kind)(x, axis=tuple(axes), out=into)
    return reduction(xp, kind)(x, axis=tuple(axes))  # kind comes from a program: allow-listed


MAX_BLAS_ROW = 4096  # longer rows keep NumPy's pairwise sum (its error grows as log n, a dot product's as n)


def _rows_summed_by_blas(xp, x, axes) -> bool:
    """A float32/64 NumPy sum over the trailing dims of a C-ordered array: rows of contiguous elements."""
    return (xp is np and x.dtype in (np.float32, np.float64) and x.flags.c_contiguous and x.ndim > len(axes)
            and sorted(axes) == list(range(x.ndim - len(axes), x.ndim)) and x.size > 0
            and math.prod(x.shape[x.ndim - len(axes):]) <= MAX_BLAS_ROW)


def _row_sums(x, trailing: int, into=None):
    """Sums of the rows of ``x`` (its ``trailing`` last dims) as one BLAS matrix-vector product with ones:
    NumPy's own reduction pays per row (3.5x slower on attention's 128-long softmax rows, 4x8x128x128).
    Another summation order than NumPy's pairwise one: float rounding differs, within its error bound."""
    shape = x.shape[:x.ndim - trailing]
    rows = x.reshape(math.prod(shape), -1)
    out = into.reshape(rows.shape[0]) if into is not None else None
    return np.matmul(rows, _ones(rows.shape[1], x.dtype.str), out=out).reshape(shape)


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: str):
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones
