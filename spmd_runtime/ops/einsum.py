"""Contractions: ``einsum`` (two operands per node) and ``matmul``, ONE record.

This file holds the record, the traced functions (the shape/dtype rules) and the kernel; the
propagation and partition rules are in ``spmd_runtime/partition/rules/einsum.py``, the VJP in
``spmd_runtime/autodiff/rules/einsum.py``.
"""
from __future__ import annotations

import builtins
import functools
import math
import string
import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import opdef
from ..dtypes import ACCUMULATE, is_low_precision
from ..opdef import define
from ..trace import Tensor, emit
from .core import asarray, astype, broadcast_to, reshape, sum, transpose

EINSUM = define("einsum", fresh=True)


# ================================================================ traced API
def einsum(spec: str, *operands) -> Tensor:
    """Einstein summation over letters; two-operand steps become ``einsum`` nodes."""
    spec = spec.replace(" ", "")
    ins, out = spec.split("->") if "->" in spec else (spec, None)
    terms = ins.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum needs one operand per input term; got {len(terms)} terms in {spec!r} and "
                         f"{len(operands)} operands")
    ops = [asarray(o) for o in operands]
    terms, out = _expand_ellipsis(terms, out, ops)
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
        acc, acc_term = _einsum2(acc, acc_term, ops[i], terms[i], rest, sizes, out if i == len(ops) - 1 else None)
    return _einsum1(acc, acc_term, out)


def _expand_ellipsis(terms, out, ops):
    """NumPy's ``...``: the dims a term leaves unnamed, given unused letters aligned from the right across the
    operands (an implicit output puts them first, as NumPy)."""
    if "..." not in "".join(terms) + (out or ""):
        return terms, out
    used = set("".join(terms) + (out or ""))
    free = [c for c in string.ascii_letters if c not in used]
    widths = [o.ndim - (len(t) - 3) if "..." in t else 0 for t, o in zip(terms, ops)]
    if builtins.any(w < 0 for w in widths) or max(widths) > len(free):
        raise ValueError(f"einsum's '...' stands for the dims a term leaves unnamed; got terms {terms} for shapes "
                         f"{[o.shape for o in ops]}")
    dims = "".join(free[:max(widths)])
    expanded = [t.replace("...", dims[len(dims) - w:]) for t, w in zip(terms, widths)]
    if out is None:
        named = "".join(t.replace("...", "") for t in terms)
        return expanded, dims + "".join(sorted(c for c in set(named) if named.count(c) == 1))
    return expanded, out.replace("...", dims)


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


def _einsum2(a, ta, b, tb, rest, sizes, final=None):
    """One pairwise step; ``final``: the einsum's output letters when this is its last step."""
    keep = lambda t, other: "".join(c for c in t if c in other or c in rest)
    a, ta = _einsum1(a, ta, keep(ta, tb)), keep(ta, tb)
    b, tb = _einsum1(b, tb, keep(tb, ta)), keep(tb, ta)
    out = _pair_out(ta, tb, rest)
    if final is not None and sorted(final) == sorted(out):
        out = final  # the kernel writes the einsum's own order (b's free letters first: as b @ a; attention's
        # (b, q, h, e) from per-(b, h) products: through the result's strides), no transpose after it
    shape = tuple(sizes[c] for c in out)
    return emit(EINSUM, [a, b], {"spec": f"{ta},{tb}->{out}"}, shape, a.dtype), out


def _pair_out(ta, tb, rest):
    """Result letters of one pairwise step: batch letters, then a's free, then b's free (each kept if needed);
    a step that sums nothing (a broadcast product) in the order the letters are wanted next, so no transpose
    follows it."""
    if all(c in rest for c in ta + tb):
        return "".join(c for c in dict.fromkeys(rest) if c in ta or c in tb)
    batch = [c for c in ta if c in tb and c in rest]
    free_a = [c for c in ta if c not in tb]
    free_b = [c for c in tb if c not in ta]
    return "".join(batch + free_a + free_b)


def _swapped_order(ta: str, tb: str, out: str) -> str:
    """The result order of the stacked matmul with the operands swapped: batch, b's free, a's free letters."""
    return "".join([c for c in ta if c in tb and c in out] + [c for c in tb if c not in ta] +
                   [c for c in ta if c not in tb])


def matmul(a, b) -> Tensor:
    a, b = asarray(a), asarray(b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul needs operands of rank >= 1; got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[0 if b.ndim == 1 else -2]:
        raise ValueError(f"matmul (@) needs the last dim of a equal to the {'only' if b.ndim == 1 else 'second-to-last'}"
                         f" dim of b; got shapes {a.shape} @ {b.shape}")
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


# ================================================================ kernel
@opdef.kernel(EINSUM)
def _einsum_kernel(xp, a, b, spec, into=None):
    """Two-operand einsum as one stacked matmul (BLAS), not np.einsum's loops. Given ``into`` (a buffer of the
    result's size, planned by exec/buffers.py) the result is that buffer, C-ordered in ``out``'s letters:
    BLAS writes there directly when its result order is ``out``'s, else (16-bit operands, a permuted output)
    the result is copied in, so a planned buffer always holds its value (a scan writes its stacked results
    through it, exec/loops.py). The index work is planned once per spec and shapes (``_plan``)."""
    low = is_low_precision(a.dtype)
    plan = _plan(spec, a.shape, b.shape, matmul_only=low)  # 16-bit: float32 accumulation in the matmul
    if plan.swapped:  # planned as b @ a: the result comes out in out's order, no transpose after it
        a, b = b, a
    if plan.kind == "product":
        return _broadcast_product(xp, a, b, plan, into)
    if plan.kind == "dot":
        return _batched_dot(xp, a, b, spec, plan.result, into)
    a3 = _blas_operand(xp, a.transpose(plan.perm_a).reshape(plan.stack_a))
    b3 = _blas_operand(xp, b.transpose(plan.perm_b).reshape(plan.stack_b))
    strided = None if plan.in_order or low or xp is not np else _strided_result(xp, plan, a.dtype, into)
    if strided is not None:  # BLAS writes each slice through the result's strides: no transpose copy after it
        xp.matmul(a3, b3, out=strided[1])
        return strided[0]
    direct = into is not None and not low and plan.in_order
    r = xp.matmul(a3, b3, out=into.reshape(plan.stack_r)) if direct else _matmul(xp, a3, b3)
    r = r.reshape(plan.ordered).transpose(plan.perm_r)
    if into is None or direct:
        return r
    result = into.reshape(r.shape)
    result[...] = r
    return result


def _strided_result(xp, plan, dtype, into):
    """(the result, C-ordered in out's letters, in ``into`` or fresh; a view of it as the stacked matmul's
    ``stack_r``) when that view needs no copy (each merged group of the matmul's dims is contiguous in out's
    order: attention's (b, h, q, e) into a (b, q, h, e) result, one strided BLAS call per (b, h)), else None."""
    strides = _stack_strides(plan)
    if strides is None:
        return None
    result = xp.empty(plan.result, dtype) if into is None else into.reshape(plan.result)
    return result, np.lib.stride_tricks.as_strided(result, plan.stack_r, tuple(k * result.itemsize for k in strides))


@functools.lru_cache(maxsize=4096)
def _stack_strides(plan) -> tuple | None:
    """The element strides of ``stack_r`` over a C-ordered result in out's letters, or None where a merged
    group is not contiguous there."""
    inverse = tuple(plan.perm_r.index(k) for k in range(len(plan.perm_r)))
    c_order = np.lib.stride_tricks.as_strided(np.empty(1, np.int8), plan.result,
                                              tuple(int(np.prod(plan.result[k + 1:])) for k in range(len(plan.result))))
    stacked = c_order.transpose(inverse).view()
    try:
        stacked.shape = plan.stack_r  # raises where the merge would need a copy
    except AttributeError:
        return None
    return stacked.strides


@dataclass(frozen=True)
class _Plan:
    """How ``_einsum_kernel`` lays out one einsum: ``kind`` "matmul" (operands transposed and reshaped to
    stacks ``stack_a`` @ ``stack_b`` -> ``stack_r``, result seen as ``ordered`` = batch + free_a + free_b
    letters and transposed by ``perm_r`` into ``out``; ``in_order`` when no transpose is needed), "product"
    (nothing summed: operands transposed by ``perm_a``/``perm_b`` and reshaped to ``stack_a``/``stack_b`` to
    broadcast into ``result``) or "dot" (one dot product per output element)."""
    kind: str
    result: tuple
    perm_a: tuple = ()
    stack_a: tuple = ()
    perm_b: tuple = ()
    stack_b: tuple = ()
    stack_r: tuple = ()
    ordered: tuple = ()
    perm_r: tuple = ()
    in_order: bool = False
    swapped: bool = False  # the plan is of the operands swapped (b's free letters lead the result)


@functools.lru_cache(maxsize=4096)
def _plan(spec: str, shape_a: tuple, shape_b: tuple, matmul_only: bool = False) -> _Plan:
    (ta, tb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    batch = [c for c in ta if c in tb and c in out]
    contract = [c for c in ta if c in tb and c not in out]
    free_a = [c for c in ta if c not in tb]
    free_b = [c for c in tb if c not in ta]
    sizes = {**dict(zip(ta, shape_a)), **dict(zip(tb, shape_b))}
    result = tuple(sizes[c] for c in out)
    if not contract and not matmul_only:
        def aligned(term):
            return (tuple(sorted(range(len(term)), key=lambda i: out.index(term[i]))),
                    tuple(sizes[c] if c in term else 1 for c in out))
        (perm_a, stack_a), (perm_b, stack_b) = aligned(ta), aligned(tb)
        return _Plan("product", result, perm_a, stack_a, perm_b, stack_b)
    if batch and not free_a and not free_b and not matmul_only:
        return _Plan("dot", result)
    if "".join(batch + free_a + free_b) != out and _swapped_order(ta, tb, out) == out:
        return dataclasses.replace(_plan(f"{tb},{ta}->{out}", shape_b, shape_a, matmul_only), swapped=True)
    prod = lambda cs: math.prod(sizes[c] for c in cs)
    # Batch dims stay separate dims of the stacked matmul: merging them would copy a transposed operand
    # (attention's bqhd as bhqd), where BLAS reads each (q, d) slice in place with its row stride.
    lead = tuple(sizes[c] for c in batch)
    order = batch + free_a + free_b
    return _Plan("matmul", result,
                 tuple(ta.index(c) for c in batch + free_a + contract), lead + (prod(free_a), prod(contract)),
                 tuple(tb.index(c) for c in batch + contract + free_b), lead + (prod(contract), prod(free_b)),
                 lead + (prod(free_a), prod(free_b)), tuple(sizes[c] for c in order),
                 tuple(order.index(c) for c in out), "".join(order) == out)


def _broadcast_product(xp, a, b, plan: _Plan, into):
    """An einsum that sums over nothing (a LayerNorm gain, a positional table over the batch) as one
    broadcasting multiply written in the output's order: the same products, one pass, where the batched
    matmul makes every output element a 1x1 product of its own (8x slower here)."""
    result = into.reshape(plan.result) if into is not None else xp.empty(plan.result, xp.result_type(a.dtype,
                                                                                                      b.dtype))
    return xp.multiply(a.transpose(plan.perm_a).reshape(plan.stack_a),
                       b.transpose(plan.perm_b).reshape(plan.stack_b), out=result)


def _blas_operand(xp, x):
    """``x`` as BLAS can read it: a broadcast operand (a zero stride: the ones of a bias's gradient) is copied,
    as NumPy's matmul would otherwise run its own loop instead of BLAS (4-10x slower on those sums)."""
    return xp.ascontiguousarray(x) if xp is np and 0 in x.strides and x.size > 1 else x


def _batched_dot(xp, a, b, spec, shape, into):
    """An einsum whose every output element is one dot product (a LayerNorm gain's gradient ``bsd,bsd->d``)
    through the library's einsum: its sum-of-products loop reads both operands once, where the stacked matmul
    makes one 1xK by Kx1 BLAS call per output element over strided rows (14x slower here)."""
    if into is None:
        return xp.einsum(spec, a, b)
    result = into.reshape(shape)
    if xp is np:
        return np.einsum(spec, a, b, out=result)
    result[...] = xp.einsum(spec, a, b)  # CuPy's einsum takes no ``out``
    return result


def _matmul(xp, a, b):
    """16-bit operands are multiplied with float32 accumulation and rounded once (dtypes.py). NumPy has no
    16-bit BLAS (and returns float32 for bfloat16): it multiplies float32 copies; CuPy's float16 matmul is
    cuBLAS with float32 accumulation already."""
    if not is_low_precision(a.dtype) or xp is not np:
        return xp.matmul(a, b)
    return xp.matmul(a.astype(ACCUMULATE), b.astype(ACCUMULATE)).astype(a.dtype)
