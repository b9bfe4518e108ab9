"""Core ops: leaves, elementwise, broadcast / reshape / transpose and reductions, each ONE record.

The traced functions here are the NumPy-named face ``spmd_runtime.numpy`` re-exports. Binary ops
broadcast NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; dtypes promote by JAX's rules
(``dtypes.result_type``: Python scalars weak, ``x * 2.0`` keeps x's dtype, float32 by default). This file holds the records, the traced functions (the
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
from ..dtypes import ACCUMULATE, default_float, finfo, is_floating, is_low_precision, result_type, sum_dtype
from ..graph import MESH_SPLIT, PARAMETER
from ..mesh import Mesh
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
WITH_GRADIENTS = define("with_gradients")  # its first operand's value, with the derivatives it is given
UNARY_UFUNCS = {"neg": "negative", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "abs": "absolute",
                "not": "logical_not"}
BINARY_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
                 "maximum": "maximum", "minimum": "minimum", "eq": "equal", "ne": "not_equal", "lt": "less",
                 "le": "less_equal", "gt": "greater", "ge": "greater_equal", "and": "logical_and",
                 "or": "logical_or"}
# The elementwise math of jax.numpy / the Array API, each the array module's ufunc of the same name (NumPy's
# semantics: float32 in, float32 out; integer floor_divide / remainder by 0 give 0, as NumPy's do).
MATH_UNARY = ("sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "arcsinh", "arccosh", "arctanh",
              "log1p", "expm1", "log2", "log10", "exp2", "cbrt", "reciprocal", "floor", "ceil", "trunc", "rint",
              "sign", "signbit", "isfinite", "isnan", "isinf", "invert")
MATH_BINARY = ("arctan2", "logaddexp", "copysign", "hypot", "floor_divide", "remainder", "fmod", "bitwise_and",
               "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "fmax", "fmin", "heaviside")
UNARY_UFUNCS.update({name: name for name in MATH_UNARY})
BINARY_UFUNCS.update({name: name for name in MATH_BINARY})
EXPENSIVE = ("exp", "log", "tanh", "sqrt", "div", "pow", "sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh",
             "cosh", "arcsinh", "arccosh", "arctanh", "log1p", "expm1", "log2", "log10", "exp2", "cbrt",
             "reciprocal", "arctan2", "logaddexp", "hypot", "floor_divide", "remainder", "fmod")  # never ``cheap``
ELEMENTWISE = {name: define(name, fresh=True, in_place=True, ufunc=ufunc, cheap=name not in EXPENSIVE)
               for name, ufunc in {**UNARY_UFUNCS, **BINARY_UFUNCS}.items()}
UNARY = tuple(ELEMENTWISE[n] for n in UNARY_UFUNCS)
BINARY = tuple(ELEMENTWISE[n] for n in BINARY_UFUNCS)
NEG, EXP, LOG, TANH, SQRT, ABS, NOT = UNARY[:7]  # by name, for the layers that key tables by record (code generators)
ADD, SUB, MUL, DIV, POW, MAXIMUM, MINIMUM, EQ, NE, LT, LE, GT, GE, AND, OR = BINARY[:15]
(SIN, COS, TAN, ARCSIN, ARCCOS, ARCTAN, SINH, COSH, ARCSINH, ARCCOSH, ARCTANH, LOG1P, EXPM1, LOG2, LOG10, EXP2, CBRT,
 RECIPROCAL, FLOOR, CEIL, TRUNC, RINT, SIGN, SIGNBIT, ISFINITE, ISNAN, ISINF, INVERT) = UNARY[7:]
(ARCTAN2, LOGADDEXP, COPYSIGN, HYPOT, FLOOR_DIVIDE, REMAINDER, FMOD, BITWISE_AND, BITWISE_OR, BITWISE_XOR, LEFT_SHIFT,
 RIGHT_SHIFT, FMAX, FMIN, HEAVISIDE) = BINARY[15:]
COMPARISONS = tuple(ELEMENTWISE[n] for n in ("eq", "ne", "lt", "le", "gt", "ge"))
# Zero almost everywhere or not differentiable: no cotangent flows back (JAX's gradient of floor, sign, ... is 0).
PIECEWISE_CONSTANT = (FLOOR, CEIL, TRUNC, RINT, SIGN, SIGNBIT, ISFINITE, ISNAN, ISINF, INVERT, FLOOR_DIVIDE,
                      BITWISE_AND, BITWISE_OR, BITWISE_XOR, LEFT_SHIFT, RIGHT_SHIFT, HEAVISIDE)
# Elementwise ops without a ufunc of their own (a kernel of a few ufuncs): never fused, never in place.
RSQRT = define("rsqrt", fresh=True)
LOGISTIC = define("logistic", fresh=True)  # jax.lax.logistic: the sigmoid
SELECT = define("select", fresh=True, cheap=True)
CONVERT = define("convert", fresh=True, cheap=True)
ELEMENTWISE_LIKE = UNARY + BINARY + (RSQRT, LOGISTIC, SELECT, CONVERT)  # same shape in and out, computed pointwise
BROADCAST_IN_DIM = define("broadcast_in_dim")
RESHAPE = define("reshape")
TRANSPOSE = define("transpose")
REDUCE = define("reduce", fresh=True)


# ================================================================ traced API
# ---------------------------------------------------------------- constants
def asarray(x, dtype=None) -> Tensor:
    """A traced tensor for ``x``: tensors pass through, arrays and scalars become constants. A NumPy array keeps
    its dtype; a Python scalar or list takes JAX's default (``snp.asarray(1.0)`` is float32 without x64). As an
    operand of an op (``x * np.float64(2)``) a NumPy value promotes as its 32-bit twin instead (``dtypes.py``)."""
    if isinstance(x, Tensor):
        return x if dtype is None else astype(x, dtype)
    if dtype is None:  # a NumPy array or scalar keeps its dtype (converting it asks for it); Python values and
        dtype = x.dtype if isinstance(x, (np.ndarray, np.generic)) else result_type(x)  # lists: JAX's default
    value = np.asarray(x, dtype=dtype)
    return emit(CONSTANT, [], {"value": value}, value.shape, value.dtype)


array = asarray


def stop_gradient(x) -> Tensor:
    """``x`` for the forward computation, a constant for differentiation (JAX's ``lax.stop_gradient``): what a
    numerically safe softmax subtracts (its row max) moves no gradient, as in JAX's and PyTorch's softmax."""
    x = asarray(x)
    return emit(STOP_GRADIENT, [x], {}, x.shape, x.dtype)


def with_gradients(value, wrt, grads) -> Tensor:
    """``value``, whose derivative in each array of ``wrt`` is, beside value's own, the matching array of ``grads``
    (those get none): what a loop that computes its own gradients returns (``autodiff/scheduled.py``'s pipeline
    schedules). ``value + sum((p - stop_gradient(p)) * stop_gradient(g))`` has the same derivatives but computes
    its zero at run time, a pass over every parameter and its gradient; this op is its first operand (the
    partitioner emits nothing for it) and its VJP gives each ``p`` the cotangent times ``g``."""
    value, wrt, grads = asarray(value), [asarray(p) for p in wrt], [asarray(g) for g in grads]
    if value.ndim != 0:
        raise ValueError(f"with_gradients gives derivatives of a scalar; got a value of shape {value.shape}")
    if len(wrt) != len(grads) or any(p.shape != g.shape for p, g in zip(wrt, grads)):
        raise ValueError(f"with_gradients needs one gradient of each array's shape; got arrays of shapes "
                         f"{[p.shape for p in wrt]} and gradients of shapes {[g.shape for g in grads]}")
    return emit(WITH_GRADIENTS, [value, *wrt, *grads], {"count": len(wrt)}, value.shape, value.dtype)


def full(shape, fill_value, dtype=None, *, device=None) -> Tensor:
    """``fill_value`` everywhere; its own dtype when ``dtype`` is None (JAX's: a Python float is the default float
    type, a Python int the default int). ``device``: the Array API's, see ``check_device``."""
    check_device(device, "full")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    return broadcast_to(asarray(fill_value, dtype=dtype), shape)


def zeros(shape, dtype=None, *, device=None) -> Tensor:
    """Zeros of ``dtype`` (default: float32, float64 with x64, as jax.numpy's)."""
    return full(shape, 0, default_float() if dtype is None else dtype, device=device)


def ones(shape, dtype=None, *, device=None) -> Tensor:
    return full(shape, 1, default_float() if dtype is None else dtype, device=device)


def check_device(device, what: str) -> None:
    """The Array API's ``device=``: a traced tensor has no device of its own (its placement is the partitioner's),
    so only None, "cpu" or a mesh (an eager DArray's ``.device``) are taken."""
    if device is not None and not isinstance(device, Mesh) and device != "cpu":
        raise ValueError(f"{what}: a traced tensor's placement is the partitioner's (shard it with mesh_split or "
                         f"in_specs); device= must be None, 'cpu' or a mesh; got device={device!r}")


# ---------------------------------------------------------------- elementwise
def _operands(*xs):
    """Turn operands into tensors of one dtype and one broadcast shape; Python scalars are weak."""
    dtype = result_type(*xs)
    if not any(isinstance(x, Tensor) for x in xs):
        current_graph()
    ts = [astype(x, dtype) if isinstance(x, Tensor) else asarray(x, dtype=dtype) for x in xs]
    shape = np.broadcast_shapes(*[t.shape for t in ts])
    return [broadcast_to(t, shape) for t in ts], dtype, shape


def _unary(op, x, dtype=None):
    (x,), xdtype, shape = _operands(x)
    return emit(op, [x], {}, shape, dtype or xdtype)


def _binary(op, a, b, out_dtype=None):
    (a, b), dtype, shape = _operands(a, b)
    return emit(op, [a, b], {}, shape, out_dtype or dtype)


def _float(x):
    """``x`` as a floating (or complex) tensor: integers and bools in the default float dtype (JAX's inexact
    promotion: float32, float64 with x64), floats as they are."""
    if type(x) in (bool, int, float):
        return float(x)  # stays weak: ``bf16 / 3`` is bfloat16
    x = asarray(x)
    return astype(x, result_type(x, 1.0))


def _integral(x, what: str):
    """``x`` as a tensor of integers or bools, else a TypeError naming ``what``."""
    x = asarray(x)
    if x.dtype.kind not in "biu":
        raise TypeError(f"{what} takes integers or bools (NumPy's and JAX's rule); got {x.dtype}: cast with "
                        f".astype('int32') first")
    return x


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


# ---------------------------------------------------------------- elementwise math (jax.numpy / Array API)
def _inexact_unary(name):
    """The traced function of ufunc op ``name``: integers and bools computed in the default float dtype."""
    def fn(x):
        return _unary(ELEMENTWISE[name], _float(x))
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"NumPy's ``{name}``, elementwise; integers and bools are computed in the default float dtype."
    return fn


(sin, cos, tan, arcsin, arccos, arctan, sinh, cosh, arcsinh, arccosh, arctanh, log1p, expm1, log2, log10, exp2,
 cbrt, reciprocal) = (_inexact_unary(n) for n in MATH_UNARY[:18])


def _inexact_binary(name):
    def fn(a, b):
        (a, b), _, _ = _operands(a, b)
        return _binary(ELEMENTWISE[name], _float(a), _float(b))
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"NumPy's ``{name}``, elementwise; integers and bools are computed in the default float dtype."
    return fn


arctan2, logaddexp, copysign, hypot, heaviside = (
    _inexact_binary(n) for n in ("arctan2", "logaddexp", "copysign", "hypot", "heaviside"))


def rsqrt(x):
    """``1 / sqrt(x)`` (jax.lax.rsqrt), one op."""
    x = asarray(_float(x))
    return emit(RSQRT, [x], {}, x.shape, x.dtype)


def sigmoid(x):
    """The logistic function ``1 / (1 + exp(-x))`` (jax.nn.sigmoid, jax.lax.logistic), without overflow."""
    x = asarray(_float(x))
    return emit(LOGISTIC, [x], {}, x.shape, x.dtype)


def _integral_kept(name):
    """Op ``name`` on floats; integers and bools are their own value (JAX's and the Array API's floor, ceil, ...)."""
    def fn(x):
        x = asarray(x)
        return x if x.dtype.kind in "biu" else _unary(ELEMENTWISE[name], x)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"NumPy's ``{name}`` on floats; an integer or bool tensor is returned as it is (its own {name})."
    return fn


floor, ceil, trunc, rint = (_integral_kept(n) for n in ("floor", "ceil", "trunc", "rint"))
fix = trunc


def round(x, decimals: int = 0):
    """NumPy's ``round``: half to even, at ``decimals`` digits (``rint(x * 10**d) / 10**d``, as NumPy computes it;
    negative ``decimals`` round to tens, hundreds, ...). Integers are returned as they are for ``decimals >= 0``."""
    x, decimals = asarray(x), int(decimals)
    if x.dtype.kind in "biu":
        if decimals < 0:
            raise ValueError(f"round of integers takes decimals >= 0 here; got decimals={decimals} for {x.dtype}: "
                             f"round x.astype('float32') instead")
        return x
    if decimals == 0:
        return rint(x)
    if decimals > 0:
        return divide(rint(multiply(x, 10.0 ** decimals)), 10.0 ** decimals)
    return multiply(rint(divide(x, 10.0 ** -decimals)), 10.0 ** -decimals)


around = round


def sign(x):
    """NumPy's ``sign``: -1, 0 or 1 (nan for nan) in x's dtype."""
    return _unary(ELEMENTWISE["sign"], x)


def signbit(x): return _unary(ELEMENTWISE["signbit"], x, "bool")
def isfinite(x): return _unary(ELEMENTWISE["isfinite"], x, "bool")
def isnan(x): return _unary(ELEMENTWISE["isnan"], x, "bool")
def isinf(x): return _unary(ELEMENTWISE["isinf"], x, "bool")


def positive(x):
    """``+x``: the value itself."""
    return asarray(x)


def floor_divide(a, b):
    """NumPy's ``//``: rounds toward -inf (``-7 // 2 == -4``); an integer divided by 0 gives 0, as NumPy's."""
    return _binary(ELEMENTWISE["floor_divide"], a, b)


def remainder(a, b):
    """NumPy's ``%``: the sign of the divisor (``-7 % 2 == 1``); an integer modulo 0 gives 0, as NumPy's."""
    return _binary(ELEMENTWISE["remainder"], a, b)


def fmod(a, b):
    """C's ``fmod``: the sign of the dividend (``fmod(-7, 2) == -1``); an integer modulo 0 gives 0, as NumPy's."""
    return _binary(ELEMENTWISE["fmod"], a, b)


mod = remainder


def divmod(a, b):
    """``(a // b, a % b)``."""
    return floor_divide(a, b), remainder(a, b)


def fmax(a, b):
    """The larger of a and b, ignoring a nan on one side (NumPy's ``fmax``)."""
    return _binary(ELEMENTWISE["fmax"], a, b)


def fmin(a, b):
    """The smaller of a and b, ignoring a nan on one side (NumPy's ``fmin``)."""
    return _binary(ELEMENTWISE["fmin"], a, b)


def _bitwise(name, what):
    logical = {"bitwise_and": AND, "bitwise_or": OR, "bitwise_xor": NE}[name]

    def fn(a, b):
        (a, b), dtype, _ = _operands(a, b)
        if dtype == np.bool_:  # the same values as the logical ops, which the compiled loops know
            return _binary(logical, a, b)
        return _binary(ELEMENTWISE[name], _integral(a, what), _integral(b, what))
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"NumPy's ``{name}`` of integers or bools (logical on bools)."
    return fn


bitwise_and = _bitwise("bitwise_and", "bitwise_and (&)")
bitwise_or = _bitwise("bitwise_or", "bitwise_or (|)")
bitwise_xor = _bitwise("bitwise_xor", "bitwise_xor (^)")


def _shift(name, what):
    def fn(a, b):
        (a, b), _, _ = _operands(a, b)
        if a.dtype == np.bool_:
            raise TypeError(f"{what} takes integers (the Array API's rule); got bool: cast with .astype('int32')")
        return _binary(ELEMENTWISE[name], _integral(a, what), _integral(b, what))
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"NumPy's ``{name}`` of integers (a shift by the bit width or more gives 0, or -1 for negatives)."
    return fn


left_shift = bitwise_left_shift = _shift("left_shift", "left_shift (<<)")
right_shift = bitwise_right_shift = _shift("right_shift", "right_shift (>>)")


def invert(x):
    """NumPy's ``~``: bitwise not of integers, logical not of bools."""
    x = _integral(x, "invert (~)")
    return _unary(NOT if x.dtype == np.bool_ else ELEMENTWISE["invert"], x)


bitwise_invert = bitwise_not = invert


def logical_xor(a, b):
    return not_equal(astype(a, "bool"), astype(b, "bool"))


def float_power(a, b):
    """``a ** b`` in a floating dtype (JAX's ``float_power``: the inputs' inexact promotion, not NumPy's float64)."""
    (a, b), _, _ = _operands(a, b)
    return power(_float(a), _float(b))


def deg2rad(x): return multiply(_float(x), math.pi / 180.0)
def rad2deg(x): return multiply(_float(x), 180.0 / math.pi)


radians, degrees = deg2rad, rad2deg
asin, acos, atan, atan2, asinh, acosh, atanh = arcsin, arccos, arctan, arctan2, arcsinh, arccosh, arctanh
pow = power


def clip(x, min=None, max=None):
    """``x`` limited to [min, max] (the Array API's ``clip``: either bound may be None; NumPy's rule
    ``minimum(maximum(x, min), max)``, so min > max gives max)."""
    x = asarray(x)
    if min is not None:
        x = maximum(x, min)
    if max is not None:
        x = minimum(x, max)
    return x


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    """NumPy's ``nan_to_num``: nan -> ``nan``, +inf -> ``posinf`` (default: the dtype's largest), -inf ->
    ``neginf`` (its most negative); integers and bools unchanged."""
    x = asarray(x)
    if not is_floating(x.dtype):
        return x
    info = finfo(x.dtype)
    posinf = float(info.max) if posinf is None else posinf
    neginf = float(info.min) if neginf is None else neginf
    out = where(isnan(x), nan, x)
    out = where(equal(x, float("inf")), posinf, out)
    return where(equal(x, float("-inf")), neginf, out)


def where(cond, a, b) -> Tensor:
    """Select ``a`` where ``cond`` else ``b``, broadcasting all three."""
    (a, b), dtype, _ = _operands(a, b)
    cond = astype(asarray(cond), "bool")
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    cond, a, b = (broadcast_to(t, shape) for t in (cond, a, b))
    return emit(SELECT, [cond, a, b], {}, shape, dtype)


def astype(x, dtype, /, *, copy=True, device=None) -> Tensor:
    """``x`` as ``dtype`` (``copy`` is moot: tensors are immutable, the result is the same value either way)."""
    check_device(device, "astype")
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


def reshape(x, /, shape, *more, copy=None) -> Tensor:
    """``x`` in ``shape`` (one -1 inferred); ``x.reshape(2, 3)`` also takes the sizes one by one. ``copy`` is moot
    (tensors are immutable)."""
    x = asarray(x)
    shape = (shape,) + more if more or isinstance(shape, (int, np.integer)) else tuple(shape)
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
    """JAX's sum: bools and narrow integers are summed in the default integer (``dtypes.sum_dtype``: int32, int64
    with x64; unsigned ones in uint32 / uint64), so a partitioned sum's partial sums and their all-reduce have
    the dtype the sum declares; ``dtype=`` sums in that dtype."""
    x = asarray(x)
    if dtype is None and sum_dtype(x.dtype) != x.dtype:
        dtype = sum_dtype(x.dtype)
    return _reduce("sum", x, axis, keepdims, dtype)


def max(x, axis=None, keepdims=False): return _reduce("max", _nonempty(x, axis, "max"), axis, keepdims)
def min(x, axis=None, keepdims=False): return _reduce("min", _nonempty(x, axis, "min"), axis, keepdims)


def reduce(kind: str, x, axis=None, keepdims=False) -> Tensor:
    """The ``kind`` reduction (one of REDUCE_KINDS) with no check: the max / min of an empty extent is the
    identity (``reduce_identity``), as ``any`` / ``all`` of bools want (False / True)."""
    return _reduce(kind, x, axis, keepdims)


def _nonempty(x, axis, kind: str) -> Tensor:
    """``x``, refused where a reduced dim has size 0 (NumPy's error: max / min of nothing has no value; the local
    kernel of a rank with an empty block takes the identity instead, so the global reduction is decided here)."""
    x = asarray(x)
    axes = range(x.ndim) if axis is None else [normalize_axis(a, x.ndim) for a in as_tuple(axis)]
    if any(x.shape[a] == 0 for a in axes):
        raise ValueError(f"{kind} of a zero-size array has no identity: it needs at least one element along each "
                         f"reduced axis; got shape {list(x.shape)}, axis {axis!r}")
    return x


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
    return multiply(sum(x, axis, keepdims), 1.0 / count if count else float("nan"))  # empty: nan, as NumPy


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


@opdef.kernel(RSQRT)
def _rsqrt_kernel(xp, x):
    return xp.reciprocal(xp.sqrt(x))


@opdef.kernel(LOGISTIC)
def _logistic_kernel(xp, x):
    """exp of -|x| only (no overflow): 1 / (1 + e) for x >= 0, e / (1 + e) below, each to a few ulp."""
    e = xp.exp(-xp.abs(x))
    r = xp.reciprocal(e + 1)
    return xp.where(x >= 0, r, e * r)


@opdef.kernel(PARAMETER)
def _parameter_kernel(xp, *, index, name=None):
    raise RuntimeError(f"a parameter's value is the caller's input {index}: evaluate and the interpreter bind "
                       f"it directly; got a call of its kernel")


@opdef.kernel(STOP_GRADIENT)
def _stop_gradient_kernel(xp, x):
    return x  # the same value: only differentiation treats it as a constant


@opdef.kernel(WITH_GRADIENTS)
def _with_gradients_kernel(xp, value, *wrt_and_grads, count):
    return value  # the derivatives are differentiation's business


@opdef.kernel(MESH_SPLIT)
def _mesh_split_kernel(xp, x, sharding=None, mesh=None, unconstrained=(), name=None, grad_sharding=None,
                       reshard_only=False):
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
    if kind == "sum" and _outer_rows_summed_by_blas(xp, x, axes):
        return _outer_row_sums(x, _leading(axes), len(axes) - _leading(axes), into)
    if kind == "sum" and x.dtype.kind in "biu":  # a sum in bool (logical or) or an integer: in its declared
        return xp.sum(x, axis=tuple(axes), dtype=x.dtype, out=into)  # dtype, never NumPy's wider one
    if kind in ("max", "min") and any(x.shape[a] == 0 for a in axes):  # a rank's empty block of an uneven split:
        return reduction(xp, kind)(x, axis=tuple(axes), out=into,  # the identity, which the cross-rank max / min
                                   initial=reduce_identity(kind, x.dtype))  # ignores (the front end refuses all-empty)
    if into is not None:  # a buffer planned for the result (exec/buffers.py)
        return reduction(xp, kind)(x, axis=tuple(axes), out=into)
    return reduction(xp, kind)(x, axis=tuple(axes))  # kind comes from a program: allow-listed


MAX_BLAS_ROW = 4096  # longer rows keep NumPy's pairwise sum (its error grows as log n, a dot product's as n)


def _rows_summed_by_blas(xp, x, axes) -> bool:
    """A float32/64 NumPy sum over the trailing dims of a C-ordered array: rows of contiguous elements."""
    return (xp is np and x.dtype in (np.float32, np.float64) and x.flags.c_contiguous and x.ndim > len(axes)
            and sorted(axes) == list(range(x.ndim - len(axes), x.ndim)) and x.size > 0
            and math.prod(x.shape[x.ndim - len(axes):]) <= MAX_BLAS_ROW)


def _leading(axes) -> int:
    """How many of ``axes`` are the leading dims 0, 1, ...: a sum over (0, 2, 3) of NCHW has one."""
    ordered = sorted(axes)
    return next((k for k, a in enumerate(ordered) if a != k), len(ordered))


def _outer_rows_summed_by_blas(xp, x, axes) -> bool:
    """A float32/64 NumPy sum over leading and trailing dims of a C-ordered array, keeping the middle ones (batch
    norm's statistics: (0, 2, 3) of NCHW): the rows' sums by BLAS, then the leading dims' by a second product."""
    lead = _leading(axes)
    return (xp is np and x.dtype in (np.float32, np.float64) and x.flags.c_contiguous and 0 < lead < len(axes)
            and sorted(axes)[lead:] == list(range(x.ndim - len(axes) + lead, x.ndim)) and x.size > 0
            and math.prod(x.shape[x.ndim - len(axes) + lead:]) <= MAX_BLAS_ROW
            and math.prod(x.shape[:lead]) <= MAX_BLAS_ROW)


def _outer_row_sums(x, lead: int, trailing: int, into=None):
    """Sums over the ``lead`` first and the ``trailing`` last dims of ``x``: (outer, kept, row) -> (outer, kept)
    by one matrix-vector product with ones, then -> (kept) by another (NumPy's reduction over (0, 2, 3) of NCHW
    walks the outer dim per kept element; two BLAS products read x once). Another summation order than NumPy's
    pairwise one: float rounding differs, within its error bound."""
    kept = x.shape[lead:x.ndim - trailing]
    outer = math.prod(x.shape[:lead])
    per_outer = np.matmul(x.reshape(outer * math.prod(kept), -1), _ones(math.prod(x.shape[x.ndim - trailing:]),
                                                                         x.dtype.str))
    out = into.reshape(math.prod(kept)) if into is not None else None
    return np.matmul(_ones(outer, x.dtype.str), per_outer.reshape(outer, -1), out=out).reshape(kept)


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
