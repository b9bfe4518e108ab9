"""Local kernels: one function per graph op, written against an array module ``xp``
(NumPy or CuPy), shared by the reference evaluator and the SPMD interpreter.

Signature: ``kernel(xp, *operands, **attrs)``. Rank-dependent and collective ops
live in the interpreter; these are pure.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import ACCUMULATE, is_low_precision
from ..graph import BINARY_OPS, UNARY_OPS

_UNARY = {"neg": "negative", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "abs": "absolute",
          "not": "logical_not"}
_BINARY = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
           "maximum": "maximum", "minimum": "minimum", "eq": "equal", "ne": "not_equal", "lt": "less",
           "le": "less_equal", "gt": "greater", "ge": "greater_equal", "and": "logical_and", "or": "logical_or"}
assert set(_UNARY) == set(UNARY_OPS) and set(_BINARY) == set(BINARY_OPS)

KERNELS = {}
UFUNC_NAMES = {**_UNARY, **_BINARY}  # elementwise ops: the array-module ufunc, which takes out=


def kernel(*names):
    def register(fn):
        for n in names:
            KERNELS[n] = fn
        return fn
    return register


def _elementwise(np_name):
    return lambda xp, *args: getattr(xp, np_name)(*args)


for _op, _name in {**_UNARY, **_BINARY}.items():
    KERNELS[_op] = _elementwise(_name)


@kernel("select")
def select(xp, cond, a, b):
    return xp.where(cond, a, b)


@kernel("convert")
def convert(xp, x, dtype):
    return x.astype(dtype)


@kernel("constant")
def constant(xp, value):
    return xp.asarray(value)


@kernel("broadcast_in_dim")
def broadcast_in_dim(xp, x, shape, dims):
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = x.shape[i]
    return xp.broadcast_to(x.reshape(expanded), tuple(shape))


@kernel("reshape")
def reshape(xp, x, shape):
    return x.reshape(shape)


@kernel("transpose")
def transpose(xp, x, perm):
    return x.transpose(perm)


@kernel("reduce")
def reduce(xp, x, kind, axes):
    if kind == "sum" and is_low_precision(x.dtype):  # accumulate 16-bit sums in float32 (dtypes.py)
        return xp.sum(x, axis=tuple(axes), dtype=ACCUMULATE).astype(x.dtype)
    return getattr(xp, kind)(x, axis=tuple(axes))


@kernel("einsum")
def einsum(xp, a, b, spec):
    """Two-operand einsum as one batched matmul (BLAS), not np.einsum's loops."""
    (ta, tb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    batch = [c for c in ta if c in tb and c in out]
    contract = [c for c in ta if c in tb and c not in out]
    free_a = [c for c in ta if c not in tb]
    free_b = [c for c in tb if c not in ta]
    sizes = {**dict(zip(ta, a.shape)), **dict(zip(tb, b.shape))}
    prod = lambda cs: int(np.prod([sizes[c] for c in cs], dtype=np.int64))
    a3 = a.transpose([ta.index(c) for c in batch + free_a + contract]).reshape(
        prod(batch), prod(free_a), prod(contract))
    b3 = b.transpose([tb.index(c) for c in batch + contract + free_b]).reshape(
        prod(batch), prod(contract), prod(free_b))
    r = _matmul(xp, a3, b3).reshape([sizes[c] for c in batch + free_a + free_b])
    order = batch + free_a + free_b
    return r.transpose([order.index(c) for c in out])


def _matmul(xp, a, b):
    """16-bit operands are multiplied with float32 accumulation and rounded once (dtypes.py). NumPy has no
    16-bit BLAS (and returns float32 for bfloat16): it multiplies float32 copies; CuPy's float16 matmul is
    cuBLAS with float32 accumulation already."""
    if not is_low_precision(a.dtype) or xp is not np:
        return xp.matmul(a, b)
    return xp.matmul(a.astype(ACCUMULATE), b.astype(ACCUMULATE)).astype(a.dtype)


@kernel("resize")
def resize(xp, x, dim, size):
    """Trim ``dim`` to ``size``, or pad it with zeros up to ``size`` (uneven shards)."""
    n = x.shape[dim]
    if size <= n:
        return x[(slice(None),) * dim + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[dim] = (0, size - n)
    return xp.pad(x, pad)
