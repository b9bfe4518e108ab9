"""NumPy-named functions on traced tensors: ``import spmd_runtime.numpy as snp``.

Binary ops broadcast NumPy-style by inserting explicit ``broadcast_in_dim``
nodes; Python scalars are weakly typed (NEP 50): ``x * 2.0`` keeps x's dtype.
"""
from __future__ import annotations

import builtins
import math
import string

import numpy as np

from .dtypes import result_type
from .trace import Tensor, current_graph, emit

__all__ = ["asarray", "array", "zeros", "ones", "full", "add", "subtract", "multiply", "divide", "true_divide",
           "power", "negative", "exp", "log", "tanh", "sqrt", "abs", "absolute", "square", "maximum", "minimum",
           "where", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and",
           "logical_or", "logical_not", "sum", "max", "min", "amax", "amin", "mean", "var", "reshape",
           "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze", "broadcast_to", "matmul", "dot",
           "einsum", "astype"]


# ---------------------------------------------------------------- constants
def asarray(x, dtype=None) -> Tensor:
    """A traced tensor for ``x``: tensors pass through, arrays and scalars become constants."""
    if isinstance(x, Tensor):
        return x if dtype is None else astype(x, dtype)
    value = np.asarray(x, dtype=dtype)
    return emit("constant", [], {"value": value}, value.shape, value.dtype)


array = asarray


def full(shape, fill_value, dtype="float64") -> Tensor:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return broadcast_to(asarray(np.asarray(fill_value, dtype=dtype)), shape)


def zeros(shape, dtype="float64") -> Tensor:
    return full(shape, 0, dtype)


def ones(shape, dtype="float64") -> Tensor:
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


def add(a, b): return _binary("add", a, b)
def subtract(a, b): return _binary("sub", a, b)
def multiply(a, b): return _binary("mul", a, b)
def divide(a, b): return _binary("div", _float(a), _float(b))
def power(a, b): return _binary("pow", a, b)
def maximum(a, b): return _binary("maximum", a, b)
def minimum(a, b): return _binary("minimum", a, b)
def equal(a, b): return _binary("eq", a, b, "bool")
def not_equal(a, b): return _binary("ne", a, b, "bool")
def less(a, b): return _binary("lt", a, b, "bool")
def less_equal(a, b): return _binary("le", a, b, "bool")
def greater(a, b): return _binary("gt", a, b, "bool")
def greater_equal(a, b): return _binary("ge", a, b, "bool")
def logical_and(a, b): return _binary("and", astype(a, "bool"), astype(b, "bool"))
def logical_or(a, b): return _binary("or", astype(a, "bool"), astype(b, "bool"))
def logical_not(x): return _unary("not", astype(x, "bool"))
def negative(x): return _unary("neg", x)
def exp(x): return _unary("exp", _float(x))
def log(x): return _unary("log", _float(x))
def tanh(x): return _unary("tanh", _float(x))
def sqrt(x): return _unary("sqrt", _float(x))
def absolute(x): return _unary("abs", x)
def square(x): return multiply(x, x)


true_divide, abs = divide, absolute


def where(cond, a, b) -> Tensor:
    """Select ``a`` where ``cond`` else ``b``, broadcasting all three."""
    (a, b), dtype, _ = _operands(a, b)
    cond = astype(asarray(cond), "bool")
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    cond, a, b = (broadcast_to(t, shape) for t in (cond, a, b))
    return emit("select", [cond, a, b], {}, shape, dtype)


def astype(x, dtype) -> Tensor:
    x, dtype = asarray(x), np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return emit("convert", [x], {"dtype": dtype.name}, x.shape, dtype)


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
    if x.node.op == "broadcast_in_dim":  # fold a chain of broadcasts into one
        inner = x.node
        x, dims = Tensor(x.graph, inner.inputs[0]), tuple(dims[d] for d in inner.attrs["dims"])
    return emit("broadcast_in_dim", [x], {"shape": shape, "dims": dims}, shape, x.dtype)


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
    return emit("reshape", [x], {"shape": shape}, shape, x.dtype)


def transpose(x, axes=None, *more) -> Tensor:
    x = asarray(x)
    if more:
        axes = (axes,) + more
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(_axis(a, x.ndim) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose needs a permutation of 0..{x.ndim - 1}; got {axes}")
    if perm == tuple(range(x.ndim)):
        return x
    return emit("transpose", [x], {"perm": perm}, tuple(x.shape[p] for p in perm), x.dtype)


def swapaxes(x, a, b) -> Tensor:
    perm = list(range(x.ndim))
    a, b = _axis(a, x.ndim), _axis(b, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def moveaxis(x, source, destination) -> Tensor:
    perm = [i for i in range(x.ndim) if i != _axis(source, x.ndim)]
    perm.insert(_axis(destination, x.ndim), _axis(source, x.ndim))
    return transpose(x, perm)


def expand_dims(x, axis) -> Tensor:
    x = asarray(x)
    axes = sorted(_axis(a, x.ndim + len(_tuple(axis))) for a in _tuple(axis))
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return broadcast_in_dim(x, shape, [i for i in range(len(shape)) if i not in axes])


def squeeze(x, axis=None) -> Tensor:
    x = asarray(x)
    axes = [i for i, s in enumerate(x.shape) if s == 1] if axis is None else [_axis(a, x.ndim) for a in _tuple(axis)]
    return reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


# ---------------------------------------------------------------- reductions
def _reduce(kind, x, axis, keepdims, dtype=None):
    x = asarray(x) if dtype is None else astype(x, dtype)
    axes = tuple(range(x.ndim)) if axis is None else tuple(sorted({_axis(a, x.ndim) for a in _tuple(axis)}))
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    out = emit("reduce", [x], {"kind": kind, "axes": axes}, shape, x.dtype) if axes else x
    if keepdims:
        kept = [i for i in range(x.ndim) if i not in axes]
        out = broadcast_in_dim(out, tuple(1 if i in axes else s for i, s in enumerate(x.shape)), kept)
    return out


def sum(x, axis=None, keepdims=False, dtype=None): return _reduce("sum", x, axis, keepdims, dtype)
def max(x, axis=None, keepdims=False): return _reduce("max", x, axis, keepdims)
def min(x, axis=None, keepdims=False): return _reduce("min", x, axis, keepdims)


amax, amin = max, min


def mean(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    x = _float(asarray(x if dtype is None else astype(x, dtype)))
    axes = range(x.ndim) if axis is None else _tuple(axis)
    count = math.prod(x.shape[_axis(a, x.ndim)] for a in axes)
    return multiply(sum(x, axis, keepdims), 1.0 / count)


def var(x, axis=None, keepdims=False) -> Tensor:
    centred = subtract(x, mean(x, axis, keepdims=True))
    return mean(multiply(centred, centred), axis, keepdims)


# ---------------------------------------------------------------- contractions
def einsum(spec: str, *operands) -> Tensor:
    """Einstein summation over letters; two-operand steps become ``einsum`` nodes."""
    spec = spec.replace(" ", "")
    ins, out = spec.split("->") if "->" in spec else (spec, None)
    terms = ins.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum needs one operand per input term; got {len(terms)} terms in {spec!r} and "
                         f"{len(operands)} operands")
    ops = [asarray(o) for o in operands]
    for t, o in zip(terms, ops):
        if len(t) != o.ndim or not builtins.all(c in string.ascii_letters for c in t):
            raise ValueError(f"einsum terms name each operand dim with one letter; got term {t!r} for shape {o.shape}")
    if out is None:
        letters = "".join(terms)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    dtype = np.result_type(*[o.dtype for o in ops])
    ops = [astype(o, dtype) for o in ops]
    sizes = _letter_sizes(terms, ops)
    acc, acc_term = ops[0], terms[0]
    for i in range(1, len(ops)):
        rest = "".join(terms[i + 1:]) + out
        acc, acc_term = _einsum2(acc, acc_term, ops[i], terms[i], rest, sizes)
    return _einsum1(acc, acc_term, out)


def _letter_sizes(terms, ops) -> dict:
    sizes = {}
    for t, o in zip(terms, ops):
        for c, n in zip(t, o.shape):
            if sizes.setdefault(c, n) != n:
                raise ValueError(f"einsum letter {c!r} must have one size; got {sizes[c]} and {n}")
    return sizes


def _einsum1(x, term, out):
    """Sum letters not in ``out``, take diagonals never, transpose to ``out``."""
    if len(set(term)) != len(term):
        raise ValueError(f"einsum with a repeated letter in one term (a diagonal) is not supported; got {term!r}")
    missing = [c for c in out if c not in term]
    if missing:
        raise ValueError(f"einsum output letters must appear in an input; got {missing}")
    drop = tuple(i for i, c in enumerate(term) if c not in out)
    if drop:
        x = sum(x, drop)
        term = "".join(c for c in term if c in out)
    return transpose(x, [term.index(c) for c in out])


def _einsum2(a, ta, b, tb, rest, sizes):
    keep = lambda t, other: "".join(c for c in t if c in other or c in rest)
    a, ta = _einsum1(a, ta, keep(ta, tb)), keep(ta, tb)
    b, tb = _einsum1(b, tb, keep(tb, ta)), keep(tb, ta)
    out = _pair_out(ta, tb, rest)
    shape = tuple(sizes[c] for c in out)
    return emit("einsum", [a, b], {"spec": f"{ta},{tb}->{out}"}, shape, a.dtype), out


def _pair_out(ta, tb, rest):
    """Result letters of one pairwise step: batch letters, then a's free, then b's free (each kept if needed)."""
    batch = [c for c in ta if c in tb and c in rest]
    free_a = [c for c in ta if c not in tb]
    free_b = [c for c in tb if c not in ta]
    return "".join(batch + free_a + free_b)


def matmul(a, b) -> Tensor:
    a, b = asarray(a), asarray(b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul needs operands of rank >= 1; got shapes {a.shape} and {b.shape}")
    va, vb = a.ndim == 1, b.ndim == 1
    if va:
        a = reshape(a, (1,) + a.shape)
    if vb:
        b = reshape(b, b.shape + (1,))
    if b.ndim == 2 or a.ndim == 2:  # a stack times one matrix: contract directly, never broadcast the matrix
        letters = string.ascii_letters[:builtins.max(a.ndim, b.ndim) - 2]
        ta = (letters if a.ndim > 2 else "") + "XY"
        tb = (letters if b.ndim > 2 else "") + "YZ"
        out = einsum(f"{ta},{tb}->{letters}XZ", a, b)
    else:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a = broadcast_to(a, batch + a.shape[-2:])
        b = broadcast_to(b, batch + b.shape[-2:])
        letters = string.ascii_letters[:len(batch)]
        out = einsum(f"{letters}XY,{letters}YZ->{letters}XZ", a, b)
    if va:
        out = reshape(out, out.shape[:-2] + out.shape[-1:])
    if vb:
        out = reshape(out, out.shape[:-1])
    return out


dot = matmul


# ---------------------------------------------------------------- helpers
def _axis(a, ndim) -> int:
    a = int(a)
    if not -ndim <= a < ndim:
        raise ValueError(f"axis must be in [-{ndim}, {ndim}); got {a}")
    return a % ndim


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# ---------------------------------------------------------------- Tensor operators
def _bind_operators():
    ops = {"__add__": add, "__sub__": subtract, "__mul__": multiply, "__truediv__": divide, "__pow__": power,
           "__matmul__": matmul, "__eq__": equal, "__ne__": not_equal, "__lt__": less, "__le__": less_equal,
           "__gt__": greater, "__ge__": greater_equal, "__and__": logical_and, "__or__": logical_or}
    for name, fn in ops.items():
        setattr(Tensor, name, fn)
    for name, fn in {"__radd__": add, "__rsub__": subtract, "__rmul__": multiply, "__rtruediv__": divide,
                     "__rpow__": power, "__rmatmul__": matmul}.items():
        setattr(Tensor, name, lambda self, other, fn=fn: fn(other, self))
    Tensor.__neg__ = negative
    Tensor.__invert__ = logical_not
    Tensor.__hash__ = object.__hash__
    Tensor.T = property(lambda self: transpose(self))
    for name, fn in {"reshape": reshape, "transpose": transpose, "sum": sum, "max": max, "min": min,
                     "mean": mean, "var": var, "astype": astype, "swapaxes": swapaxes, "squeeze": squeeze}.items():
        setattr(Tensor, name, fn)


_bind_operators()


# ---------------------------------------------------------------- op families (spmd_runtime/ops)
from .ops import *  # noqa: E402,F401,F403  (slicing, gather/scatter, windows, indexing)
from .ops import __all__ as _family_names  # noqa: E402

__all__ += _family_names
