"""Core ops: leaves, elementwise, broadcast / reshape / transpose and reductions, each ONE record.

The traced functions here are the NumPy-named face ``spmd_runtime.numpy`` re-exports. Binary ops
broadcast NumPy-style by inserting explicit ``broadcast_in_dim`` nodes; Python scalars are weakly
typed (NEP 50): ``x * 2.0`` keeps x's dtype. Each record below gets its kernel, propagation rule,
partition rule and VJP in this file (``spmd_runtime/opdef.py`` says what each part is).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import opdef
from ..dtypes import ACCUMULATE, is_floating, is_low_precision, result_type
from ..opdef import BROADCAST_LEVEL, ELEMENTWISE_LEVEL, define
from ..partition.pending_sums import sum_carriers
from ..partition.propagation import combine
from ..partition.reshape_map import map_reshape_sharding, unaligned_group
from ..partition.resharding import plan_cost, window_exchange
from ..partition.strategy import Strategy, choose
from ..program_check import reduction
from ..sharding import Sharding
from ..trace import Tensor, current_graph, emit

# ================================================================ records
PARAMETER = define("parameter", read_only=True)  # the caller's array
CONSTANT = define("constant", read_only=True)  # the program's array
MESH_SPLIT = define("mesh_split")
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


def sum(x, axis=None, keepdims=False, dtype=None): return _reduce("sum", x, axis, keepdims, dtype)
def max(x, axis=None, keepdims=False): return _reduce("max", x, axis, keepdims)
def min(x, axis=None, keepdims=False): return _reduce("min", x, axis, keepdims)


amax, amin = max, min


def mean(x, axis=None, keepdims=False, dtype=None) -> Tensor:
    x = _float(asarray(x if dtype is None else astype(x, dtype)))
    axes = range(x.ndim) if axis is None else as_tuple(axis)
    count = math.prod(x.shape[normalize_axis(a, x.ndim)] for a in axes)
    return multiply(sum(x, axis, keepdims), 1.0 / count)


def var(x, axis=None, keepdims=False) -> Tensor:
    centred = subtract(x, mean(x, axis, keepdims=True))
    return mean(multiply(centred, centred), axis, keepdims)


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


# ================================================================ sharding propagation
@opdef.propagation(*ELEMENTWISE_LIKE, level=ELEMENTWISE_LEVEL)
def _elementwise_propagation():
    fwd = lambda node, ins, g, mesh: combine(ins)
    bwd = lambda node, out, ins, g, mesh: [out] * len(ins)
    return fwd, bwd


@opdef.propagation(MESH_SPLIT, STOP_GRADIENT, level=ELEMENTWISE_LEVEL)
def _mesh_split_propagation():
    """The value keeps its operand's layout and offers the operand its own. For a mesh_split the annotation is
    the value's sharding (pinned); dims it leaves UNCONSTRAINED are refined from the operand like an
    elementwise op's (``propagation.refine_free``)."""
    fwd = lambda node, ins, g, mesh: ins[0]
    bwd = lambda node, out, ins, g, mesh: [out]
    return fwd, bwd


@opdef.propagation(PARAMETER, CONSTANT, level=ELEMENTWISE_LEVEL)
def _leaf_propagation():
    return (lambda *a: None), (lambda *a: [])


@opdef.propagation(TRANSPOSE, level=ELEMENTWISE_LEVEL)
def _transpose_propagation():
    def fwd(node, ins, g, mesh):
        return None if ins[0] is None else Sharding(tuple(ins[0].dims[p] for p in node.attrs["perm"]))

    def bwd(node, out, ins, g, mesh):
        return [_untransposed(out, node.attrs["perm"])]
    return fwd, bwd


def _untransposed(result: Sharding, perm) -> Sharding:
    """The operand sharding that ``transpose(perm)`` turns into ``result``."""
    dims = [()] * len(perm)
    for i, p in enumerate(perm):
        dims[p] = result.dims[i]
    return Sharding(tuple(dims))


@opdef.propagation(RESHAPE, level=ELEMENTWISE_LEVEL)
def _reshape_propagation():
    def fwd(node, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return None if ins[0] is None else map_reshape_sharding(ins[0], src, node.shape, mesh, exact=False)

    def bwd(node, out, ins, g, mesh):
        src = g.nodes[node.inputs[0]].shape
        return [map_reshape_sharding(out, node.shape, src, mesh, exact=False)]
    return fwd, bwd


@opdef.propagation(BROADCAST_IN_DIM, level=BROADCAST_LEVEL)
def _broadcast_propagation():
    def fwd(node, ins, g, mesh):
        if ins[0] is None:
            return None
        src, dims = g.nodes[node.inputs[0]].shape, node.attrs["dims"]
        out = [()] * len(node.shape)
        for i, d in enumerate(dims):
            out[d] = ins[0].dims[i] if src[i] == node.shape[d] else ()
        return Sharding(tuple(out))

    def bwd(node, out, ins, g, mesh):
        return [_broadcast_operand(out, g.nodes[node.inputs[0]].shape, node)]
    return fwd, bwd


def _broadcast_operand(result: Sharding, src, node) -> Sharding:
    """The operand dims keep the result's split where they are not expanded from size 1."""
    dims = node.attrs["dims"]
    return Sharding(tuple(result.dims[d] if src[i] == node.shape[d] else () for i, d in enumerate(dims)))


@opdef.propagation(REDUCE, level=BROADCAST_LEVEL)
def reduce_propagation():
    """Kept dims keep their split, reduced ones are dropped (also the rule of arg-reductions)."""
    def fwd(node, ins, g, mesh):
        axes = node.attrs["axes"]
        return None if ins[0] is None else Sharding(tuple(d for i, d in enumerate(ins[0].dims) if i not in axes))

    def bwd(node, out, ins, g, mesh):
        kept = iter(out.dims)
        return [Sharding(tuple(() if i in node.attrs["axes"] else next(kept)
                               for i in range(len(g.nodes[node.inputs[0]].shape))))]
    return fwd, bwd


# ================================================================ partition rules
@opdef.partition(PARAMETER)
def _parameter_partition(ctx, node):
    return ctx.emit_like(node, PARAMETER.name, [], {"index": node.attrs["index"]}, ctx.sharding(node.id))


@opdef.partition(CONSTANT)
def _constant_partition(ctx, node):
    return ctx.emit_like(node, CONSTANT.name, [], node.attrs, Sharding.replicated(len(node.shape)))


@opdef.partition(MESH_SPLIT, STOP_GRADIENT)
def _mesh_split_partition(ctx, node):
    """No instruction of its own: the operand's value, laid out as wanted (UNCONSTRAINED dims: as propagated)."""
    return ctx.reshard(ctx.value(node.inputs[0]), ctx.sharding(node.id))


@opdef.partition(*ELEMENTWISE_LIKE)
def _elementwise_partition(ctx, node):
    target = ctx.sharding(node.id)
    operands = _pending_sum_operands(ctx, node, target) or [target] * len(node.inputs)
    args = [ctx.reshard(ctx.value(i), s) for i, s in zip(node.inputs, operands)]
    return ctx.emit_like(node, node.op, args, node.attrs, target)


def _pending_sum_operands(ctx, node, target: Sharding):
    """Where the wanted result is a pending sum and the op is linear in its partial operands: the operand
    layouts that keep the sum pending, so no collective runs here. None otherwise (operands are completed)."""
    if not target.partial or target.reduce_op != "sum":
        return None
    pending = [ctx.value(i).sharding.partial if ctx.value(i).sharding.reduce_op == "sum" else None
               for i in node.inputs]
    carriers = sum_carriers(node.op, pending)
    if carriers is None or pending[carriers[0]] != target.partial:
        return None
    return [target if j in carriers else target.without_partial() for j in range(len(node.inputs))]


@opdef.partition(TRANSPOSE)
def _transpose_partition(ctx, node):
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), _untransposed(target, node.attrs["perm"]))
    return ctx.emit_like(node, TRANSPOSE.name, [x], node.attrs, target)


@opdef.partition(BROADCAST_IN_DIM)
def _broadcast_partition(ctx, node):
    target = ctx.sharding(node.id)
    x = ctx.reshard(ctx.value(node.inputs[0]), _broadcast_operand(target, ctx.graph[node.inputs[0]].shape, node))
    local = target.local_shape(node.shape, ctx.mesh)
    return ctx.emit_like(node, BROADCAST_IN_DIM.name, [x], {"shape": local, "dims": node.attrs["dims"]}, target)


@opdef.partition(RESHAPE)
def _reshape_partition(ctx, node):
    """Cheapest of: reshard the operand so the result comes out as wanted, reshape the operand as it lies
    and reshard the result, or (when neither is exact) replicate the operand first."""
    x, target, mesh = ctx.value(node.inputs[0]), ctx.sharding(node.id), ctx.mesh
    candidates = []
    need = map_reshape_sharding(target, node.shape, x.shape, mesh, exact=True)
    if need is not None:
        candidates.append(Strategy(ctx.cost(x, need), operands=(need,), result=target))
    got = map_reshape_sharding(x.sharding, x.shape, node.shape, mesh, exact=True)
    if got is not None:
        candidates.append(Strategy(plan_cost(got, target, node.shape, node.dtype, mesh), operands=(x.sharding,),
                                   result=got))
    exchange = _reshape_exchange(ctx, node, x)
    if exchange is not None:
        candidates.append(Strategy(exchange[0]["wire_bytes"] + plan_cost(exchange[1], target, node.shape, node.dtype,
                                                                          mesh), operands=(x.sharding,),
                                   result=exchange[1], plan=exchange))
    if not candidates:
        ctx.notes.append(f"reshape %{node.id} {x.shape}->{node.shape} cannot keep {x.sharding} -> {target} "
                         f"local; it replicates the operand first")
        candidates.append(Strategy(0.0, operands=(Sharding.replicated(len(x.shape)),),
                                   result=Sharding.replicated(len(node.shape))))
    best = choose(candidates)
    if best.plan is not None:
        return _emit_reshape_exchange(ctx, node, x, *best.plan)
    x = ctx.reshard(x, best.operands[0])
    return ctx.emit_like(node, RESHAPE.name, [x], {"shape": best.result.local_shape(node.shape, mesh)}, best.result)


def _reshape_exchange(ctx, node, x):
    """A reshape that merges or splits a split dim across unaligned shard boundaries: each shard flattens its
    block of the group (a contiguous run of the flattened group), one all_to_allv sends every result block the
    flat entries it holds, and each shard unflattens its block. (exchange attrs, result sharding, the flat
    layouts) or None where ``unaligned_group`` finds no such group."""
    group = unaligned_group(x.sharding, x.shape, node.shape, ctx.mesh)
    if group is None:
        return None
    (a, b), (c, d) = group
    axes, total = x.sharding.dims[a], math.prod(x.shape[a:b + 1])
    k = ctx.mesh.axis_size(axes)
    flat_src = -(-x.shape[a] // k) * total // x.shape[a] * k  # k blocks of whole operand rows, flattened
    flat_dst = -(-node.shape[c] // k) * total // node.shape[c] * k
    src = Sharding(x.sharding.dims[:a] + (axes,) + x.sharding.dims[b + 1:])
    src_shape, dst_shape = x.shape[:a] + (flat_src,) + x.shape[b + 1:], x.shape[:a] + (flat_dst,) + x.shape[b + 1:]
    maps = [(0, 1, flat_dst, 0, total) if e == a else None for e in range(len(src_shape))]
    attrs = window_exchange(src, src.dims, src_shape, ctx.mesh, maps, np.dtype(x.dtype).itemsize)
    result = Sharding(x.sharding.dims[:a] + (axes,) + ((),) * (d - c) + x.sharding.dims[b + 1:])
    return attrs, result, src, src_shape, dst_shape


def _emit_reshape_exchange(ctx, node, x, attrs, result, flat, src_shape, dst_shape):
    local = lambda shape: flat.local_shape(shape, ctx.mesh)  # noqa: E731
    v = ctx.emit(RESHAPE.name, [x], {"shape": local(src_shape)}, flat, src_shape, x.dtype)
    v = ctx.emit("all_to_allv", [v], attrs, flat, dst_shape, x.dtype)
    return ctx.emit_like(node, RESHAPE.name, [v], {"shape": result.local_shape(node.shape, ctx.mesh)}, result)


@opdef.partition(REDUCE)
def _reduce_partition(ctx, node):
    """Reduce locally; split reduced dims make the result a partial reduction over their axes, which the
    planner turns into an all-reduce or a reduce-scatter. Of the operand layouts (the one the result asks
    for, or the operand's own), take the one whose resharding before plus after moves fewest bytes."""
    x, target, axes = ctx.value(node.inputs[0]), ctx.sharding(node.id), node.attrs["axes"]
    candidates = []
    for need in dict.fromkeys((_reduce_operand_for(target, x, axes), x.sharding.without_partial())):
        result = _reduced(need, axes, node.attrs["kind"])
        moved = ctx.cost(x, need) + plan_cost(result, target, node.shape, node.dtype, ctx.mesh)
        candidates.append(Strategy(moved, operands=(need,), result=result))
    best = choose(candidates)
    x = ctx.mask_padding(ctx.reshard(x, best.operands[0]), axes, reduce_identity(node.attrs["kind"], x.dtype))
    return ctx.emit_like(node, REDUCE.name, [x], node.attrs, best.result)


def _reduce_operand_for(target: Sharding, x, axes) -> Sharding:
    """Kept dims as the result wants them; reduced dims keep the operand's axes the result does not use."""
    kept, dims = iter(target.dims), []
    for i in range(len(x.shape)):
        dims.append(tuple(a for a in x.sharding.dims[i] if a not in target.axes) if i in axes else next(kept))
    return Sharding(tuple(dims))


def _reduced(operand: Sharding, axes, kind) -> Sharding:
    partial = tuple(a for i in axes for a in operand.dims[i])
    return Sharding(tuple(d for i, d in enumerate(operand.dims) if i not in axes), partial,
                    kind if partial else "sum")


# ================================================================ VJPs
@opdef.vjp(PARAMETER, CONSTANT)
def _leaf_vjp(node, g, ops, y):
    return []


@opdef.vjp(*COMPARISONS, ELEMENTWISE["and"], ELEMENTWISE["or"], ELEMENTWISE["not"])
def _no_gradient(node, g, ops, y):
    return [None] * len(ops)


@opdef.vjp(ELEMENTWISE["neg"])
def _neg_vjp(node, g, ops, y):
    return [negative(g)]


@opdef.vjp(ELEMENTWISE["exp"])
def _exp_vjp(node, g, ops, y):
    return [g * y]


@opdef.vjp(ELEMENTWISE["log"])
def _log_vjp(node, g, ops, y):
    return [g / ops[0]]


@opdef.vjp(ELEMENTWISE["tanh"])
def _tanh_vjp(node, g, ops, y):
    return [g * (1.0 - y * y)]


@opdef.vjp(ELEMENTWISE["sqrt"])
def _sqrt_vjp(node, g, ops, y):
    return [g / (2.0 * y)]


@opdef.vjp(ELEMENTWISE["abs"])
def _abs_vjp(node, g, ops, y):
    return [where(ops[0] >= 0.0, g, -g)]  # JAX: d|x|/dx = 1 at 0


@opdef.vjp(ELEMENTWISE["add"], ELEMENTWISE["sub"])
def _add_sub_vjp(node, g, ops, y):
    return [g, (lambda: -g) if node.op == "sub" else g]


@opdef.vjp(ELEMENTWISE["mul"])
def _mul_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g * b, lambda: g * a]


@opdef.vjp(ELEMENTWISE["div"])
def _div_vjp(node, g, ops, y):
    a, b = ops
    return [lambda: g / b, lambda: -(g * y) / b]


@opdef.vjp(ELEMENTWISE["pow"])
def _pow_vjp(node, g, ops, y):
    """d/da a^b = b a^(b-1) (0 where b == 0, even at a == 0); d/db a^b = log(a) a^b (0 where a == 0), as JAX."""
    a, b = ops
    da = lambda: g * b * power(a, where(b == 0.0, 1.0, b) - 1.0)
    db = lambda: g * y * log(where(a == 0.0, 1.0, a))
    return [da, db]


@opdef.vjp(ELEMENTWISE["maximum"], ELEMENTWISE["minimum"])
def _max_min_vjp(node, g, ops, y):
    """The cotangent goes to the operand that was chosen; ties split it equally (JAX's balanced rule)."""
    a, b = ops
    pick = lambda this, other: where(this == y, where(other == y, g * 0.5, g), 0.0)
    return [lambda: pick(a, b), lambda: pick(b, a)]


@opdef.vjp(SELECT)
def _select_vjp(node, g, ops, y):
    cond = ops[0]
    return [None, lambda: where(cond, g, 0.0), lambda: where(cond, 0.0, g)]


@opdef.vjp(CONVERT)
def _convert_vjp(node, g, ops, y):
    return [astype(g, ops[0].dtype) if is_floating(ops[0].dtype) else None]


@opdef.vjp(STOP_GRADIENT)
def _stop_gradient_vjp(node, g, ops, y):
    return [None]


@opdef.vjp(MESH_SPLIT)
def _mesh_split_vjp(node, g, ops, y):
    """The cotangent of an annotated value carries the same annotation, or the ``grad_sharding`` asked for."""
    attrs = dict(node.attrs)
    if "grad_sharding" in attrs:
        attrs = {"sharding": attrs.pop("grad_sharding"), "mesh": attrs["mesh"]}
    return [emit(MESH_SPLIT, [g], attrs, g.shape, g.dtype)]


@opdef.vjp(BROADCAST_IN_DIM)
def _broadcast_vjp(node, g, ops, y):
    """Sum over the new dims and the dims expanded from size 1, then restore the operand's shape."""
    x, dims = ops[0], node.attrs["dims"]
    expanded = {d for i, d in enumerate(dims) if x.shape[i] != node.shape[d]}
    summed = tuple(d for d in range(len(node.shape)) if d not in dims or d in expanded)
    return [reshape(sum(g, axis=summed), x.shape)]


@opdef.vjp(RESHAPE)
def _reshape_vjp(node, g, ops, y):
    return [reshape(g, ops[0].shape)]


@opdef.vjp(TRANSPOSE)
def _transpose_vjp(node, g, ops, y):
    return [transpose(g, tuple(np.argsort(node.attrs["perm"])))]


@opdef.vjp(REDUCE)
def _reduce_vjp(node, g, ops, y):
    x, axes = ops[0], node.attrs["axes"]
    kept = tuple(i for i in range(x.ndim) if i not in axes)
    back = lambda t: broadcast_in_dim(t, x.shape, kept)
    if node.attrs["kind"] == "sum":
        return [back(g)]
    # max / min: the cotangent goes to the positions holding the result, split equally among ties
    hit = x == back(y)
    count = sum(astype(hit, x.dtype), axis=axes)
    return [where(hit, back(g / count), 0.0)]
