"""The VJP rules of the ``ops/core.py`` family (leaves, elementwise, broadcast / reshape / transpose and
reductions; the records and traced functions are there), written with those traced functions and
registered in ``table.py``."""
from __future__ import annotations

import numpy as np

from ...dtypes import is_floating
from ...ops.core import (ABS, ADD, AND, ARCCOS, ARCCOSH, ARCSIN, ARCSINH, ARCTAN, ARCTAN2, ARCTANH, BROADCAST_IN_DIM,
                         CBRT, COMPARISONS, CONSTANT, CONVERT, COPYSIGN, COS, COSH, DIV, EXP, EXP2, EXPM1, FMAX, FMIN,
                         FMOD, HYPOT, LOG, LOG1P, LOG2, LOG10, LOGADDEXP, LOGISTIC, MAXIMUM, MESH_SPLIT, MINIMUM, MUL,
                         NEG, NOT, OR, PARAMETER, PIECEWISE_CONSTANT, POW, RECIPROCAL, REDUCE, REMAINDER, RESHAPE,
                         RSQRT, SELECT, SIN, SINH, SQRT, STOP_GRADIENT, SUB, TAN, TANH, TRANSPOSE, WITH_GRADIENTS,
                         astype, broadcast_in_dim, cos, cosh, exp, floor, log, negative, power, reshape, signbit, sin,
                         sinh, sqrt, sum, transpose, trunc, where)
from ...ops.reductions import exclusive_cumprod
from ...trace import emit
from .table import vjp


# ================================================================ VJPs
@vjp(PARAMETER, CONSTANT)
def _leaf_vjp(node, g, ops, y):
    return []


@vjp(*COMPARISONS, AND, OR, NOT, *PIECEWISE_CONSTANT)
def _no_gradient(node, g, ops, y):
    return [None] * len(ops)


@vjp(NEG)
def _neg_vjp(node, g, ops, y):
    return [negative(g)]


@vjp(EXP)
def _exp_vjp(node, g, ops, y):
    return [g * y]


@vjp(LOG)
def _log_vjp(node, g, ops, y):
    return [g / ops[0]]


@vjp(TANH)
def _tanh_vjp(node, g, ops, y):
    return [g * (1.0 - y * y)]


@vjp(SQRT)
def _sqrt_vjp(node, g, ops, y):
    return [g / (2.0 * y)]


@vjp(ABS)
def _abs_vjp(node, g, ops, y):
    return [where(ops[0] >= 0.0, g, -g)]  # JAX: d|x|/dx = 1 at 0


@vjp(ADD, SUB)
def _add_sub_vjp(node, g, ops, y):
    return [g, (lambda: -g) if node.op == SUB.name else g]


@vjp(MUL)
def _mul_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g * b, lambda: g * a]


@vjp(DIV)
def _div_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g / b, lambda: -(g * y) / b]


@vjp(POW)
def _pow_vjp(node, g, ops, y):
    """d/da a^b = b a^(b-1) (0 where b == 0, even at a == 0); d/db a^b = log(a) a^b (0 where a == 0), as JAX."""
    a, b = ops
    da = lambda: g * b * power(a, where(b == 0.0, 1.0, b) - 1.0)
    db = lambda: g * y * log(where(a == 0.0, 1.0, a))
    return [da, db]


@vjp(MAXIMUM, MINIMUM, FMAX, FMIN)
def _max_min_vjp(node, g, ops, y):
    """The cotangent goes to the operand that was chosen; ties split it equally (JAX's balanced rule)."""
    a, b = ops
    pick = lambda this, other: where(this == y, where(other == y, g * 0.5, g), 0.0)
    return [lambda: pick(a, b), lambda: pick(b, a)]


# ---------------------------------------------------------------- elementwise math: d/dx as traced ops of x, y
LN2, LN10 = float(np.log(2.0)), float(np.log(10.0))
_UNARY_DERIVATIVES = {  # op record -> (x, y) -> dy/dx
    SIN: lambda x, y: cos(x),
    COS: lambda x, y: -sin(x),
    TAN: lambda x, y: 1.0 + y * y,
    ARCSIN: lambda x, y: 1.0 / sqrt(1.0 - x * x),
    ARCCOS: lambda x, y: -1.0 / sqrt(1.0 - x * x),
    ARCTAN: lambda x, y: 1.0 / (1.0 + x * x),
    SINH: lambda x, y: cosh(x),
    COSH: lambda x, y: sinh(x),
    ARCSINH: lambda x, y: 1.0 / sqrt(x * x + 1.0),
    ARCCOSH: lambda x, y: 1.0 / sqrt((x - 1.0) * (x + 1.0)),
    ARCTANH: lambda x, y: 1.0 / (1.0 - x * x),
    LOG1P: lambda x, y: 1.0 / (1.0 + x),
    EXPM1: lambda x, y: y + 1.0,
    LOG2: lambda x, y: 1.0 / (x * LN2),
    LOG10: lambda x, y: 1.0 / (x * LN10),
    EXP2: lambda x, y: y * LN2,
    CBRT: lambda x, y: 1.0 / (3.0 * y * y),
    RECIPROCAL: lambda x, y: -(y * y),
}
_BY_NAME = {op.name: derivative for op, derivative in _UNARY_DERIVATIVES.items()}


@vjp(*_UNARY_DERIVATIVES)
def _math_unary_vjp(node, g, ops, y):
    return [g * _BY_NAME[node.op](ops[0], y)]


@vjp(RSQRT)
def _rsqrt_vjp(node, g, ops, y):
    return [g * (-0.5 * y * y * y)]


@vjp(LOGISTIC)
def _logistic_vjp(node, g, ops, y):
    return [g * (y * (1.0 - y))]


@vjp(ARCTAN2)
def _arctan2_vjp(node, g, ops, y):
    a, b = ops
    denominator = lambda: a * a + b * b
    return [lambda: g * b / denominator(), lambda: -(g * a) / denominator()]


@vjp(HYPOT)
def _hypot_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g * a / y, lambda: g * b / y]


@vjp(LOGADDEXP)
def _logaddexp_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g * exp(a - y), lambda: g * exp(b - y)]


@vjp(COPYSIGN)
def _copysign_vjp(node, g, ops, y):
    """|a| with b's sign: d/da is +1 where a's sign is kept, -1 where it flips; nothing flows to b (JAX)."""
    a, b = ops
    return [lambda: where(signbit(a) == signbit(b), g, -g), None]


@vjp(REMAINDER, FMOD)
def _remainder_vjp(node, g, ops, y):
    """a - b * q with q = floor(a / b) (remainder) or trunc(a / b) (fmod), q piecewise constant."""
    a, b = ops
    quotient = floor if node.op == REMAINDER.name else trunc
    return [g, lambda: -(g * quotient(a / b))]


@vjp(SELECT)
def _select_vjp(node, g, ops, y):
    cond = ops[0]
    return [None, lambda: where(cond, g, 0.0), lambda: where(cond, 0.0, g)]


@vjp(CONVERT)
def _convert_vjp(node, g, ops, y):
    return [astype(g, ops[0].dtype) if is_floating(ops[0].dtype) else None]


@vjp(STOP_GRADIENT)
def _stop_gradient_vjp(node, g, ops, y):
    return [None]


@vjp(WITH_GRADIENTS)
def _with_gradients_vjp(node, g, ops, y):
    """The value's cotangent to the value; each ``wrt[i]`` the cotangent times ``grads[i]`` (in its own dtype);
    the gradients nothing."""
    count = node.attrs["count"]
    given = lambda p, grad: lambda: astype(g * grad, p.dtype)
    return [g] + [given(p, grad) for p, grad in zip(ops[1:1 + count], ops[1 + count:])] + [None] * count


@vjp(MESH_SPLIT)
def _mesh_split_vjp(node, g, ops, y):
    """The cotangent of an annotated value carries the same annotation, or the ``grad_sharding`` asked for: a
    target the cotangent is resharded to, not a layout offered to the ops computing it (``reshard_only``)."""
    attrs = dict(node.attrs)
    if "grad_sharding" in attrs:
        attrs = {"sharding": attrs.pop("grad_sharding"), "mesh": attrs["mesh"], "reshard_only": True}
    return [emit(MESH_SPLIT, [g], attrs, g.shape, g.dtype)]


@vjp(BROADCAST_IN_DIM)
def _broadcast_vjp(node, g, ops, y):
    """Sum over the new dims and the dims expanded from size 1, then restore the operand's shape."""
    x, dims = ops[0], node.attrs["dims"]
    expanded = {d for i, d in enumerate(dims) if x.shape[i] != node.shape[d]}
    summed = tuple(d for d in range(len(node.shape)) if d not in dims or d in expanded)
    return [reshape(sum(g, axis=summed), x.shape)]


@vjp(RESHAPE)
def _reshape_vjp(node, g, ops, y):
    return [reshape(g, ops[0].shape)]


@vjp(TRANSPOSE)
def _transpose_vjp(node, g, ops, y):
    return [transpose(g, tuple(np.argsort(node.attrs["perm"])))]


@vjp(REDUCE)
def _reduce_vjp(node, g, ops, y):
    x, axes = ops[0], node.attrs["axes"]
    kept = tuple(i for i in range(x.ndim) if i not in axes)
    back = lambda t: broadcast_in_dim(t, x.shape, kept)
    if node.attrs["kind"] == "sum":
        return [back(g)]
    if node.attrs["kind"] == "prod":
        return [lambda: back(g) * _others_product(x, axes)]
    # max / min: the cotangent goes to the positions holding the result, split equally among ties
    hit = x == back(y)
    count = sum(astype(hit, x.dtype), axis=axes)
    return [where(hit, back(g / count), 0.0)]


def _others_product(x, axes):
    """Per entry, the product of the other entries of its reduced group (d prod / d x_i), without dividing by
    x_i (exact at zeros): the reduced dims moved last and flattened, exclusive products from both ends."""
    kept = [i for i in range(x.ndim) if i not in axes]
    perm = kept + list(axes)
    flat = reshape(transpose(x, perm), tuple(x.shape[i] for i in kept) + (-1,))
    last = flat.ndim - 1
    others = exclusive_cumprod(flat, last) * exclusive_cumprod(flat, last, reverse=True)
    return transpose(reshape(others, tuple(x.shape[i] for i in perm)), tuple(np.argsort(perm)))
