"""The CuPy backend (``CUPY``): CuPy arrays on this rank's GPU, fused instructions as generated CUDA kernels.

``cupy`` is optional (``spmd_runtime.devices.import_cupy``): nothing here imports it at module level.

* A fusion runs as one generated ``ElementwiseKernel`` (compiled on first use, cached by CuPy); a sibling group
  (exec/groups.py: AdamW's m', v', p') as one with several outputs.
* A ``fused_reduce`` runs as one generated ``ReductionKernel`` (the chain as its map; a sum accumulated in
  double, a max/min of floats in the float type, NaN-propagating as NumPy's).
* A CuPy without those (the tests' fake GPU) runs the steps as plain calls (exec/fused.py).

Environment: ``SPMD_DEVICE``, the GPU id for this rank (default: node-local rank modulo the number of
visible GPUs).
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

from ...devices import import_cupy, is_cupy
from ...ops.core import (ABS, ADD, AND, ARCCOS, ARCCOSH, ARCSIN, ARCSINH, ARCTAN, ARCTAN2, ARCTANH, BITWISE_AND,
                         BITWISE_OR, BITWISE_XOR, CBRT, CEIL, CONVERT, COPYSIGN, COS, COSH, DIV, EQ, EXP, EXP2, EXPM1,
                         FLOOR, FLOOR_DIVIDE, FMAX, FMIN, FMOD, GE, GT, HEAVISIDE, HYPOT, INVERT, ISFINITE, ISINF,
                         ISNAN, LE, LEFT_SHIFT, LOG, LOG1P, LOG2, LOG10, LOGADDEXP, LT, MUL, NE, OR, POW, RECIPROCAL,
                         REMAINDER, RIGHT_SHIFT, RINT, SIGN, SIGNBIT, SIN, SINH, SQRT, SUB, TAN, TANH, TRUNC)
from .numpy_c import POINTWISE
from .steps import Fusion, result_of

_C_TYPES = {"float16": "float16", "float32": "float", "float64": "double", "bool": "bool", "int8": "signed char",
            "int16": "short", "int32": "int", "int64": "long long", "uint8": "unsigned char",
            "uint16": "unsigned short", "uint32": "unsigned int", "uint64": "unsigned long long"}
_C_INFIX = {ADD.name: "+", SUB.name: "-", MUL.name: "*", DIV.name: "/", EQ.name: "==", NE.name: "!=", LT.name: "<",
            LE.name: "<=", GT.name: ">", GE.name: ">=", AND.name: "&&", OR.name: "||"}
_C_CALL = {op.name: op.name for op in (EXP, LOG, TANH, SQRT, POW, SIN, COS, TAN, SINH, COSH, LOG1P, EXPM1, LOG2,
                                       LOG10, EXP2, CBRT, FLOOR, CEIL, TRUNC, RINT, COPYSIGN, HYPOT)}  # CUDA's, named alike
_C_CALL.update({ARCSIN.name: "asin", ARCCOS.name: "acos", ARCTAN.name: "atan", ARCSINH.name: "asinh",
                ARCCOSH.name: "acosh", ARCTANH.name: "atanh", ARCTAN2.name: "atan2"})
_C_BITWISE = {BITWISE_AND.name: "&", BITWISE_OR.name: "|", BITWISE_XOR.name: "^"}
# NumPy's integer and float loops where C's operators differ (a floor toward -inf, a divisor's sign, a shift by the
# width or more, division by 0): device functions, the float ones NumPy's npy_divmod step for step.
DEVICE_HELPERS = """
template <typename T> __device__ T spmd_floordiv_i(T a, T b) {
  if (b == 0) return (T)0;
  const T q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? (T)(q - 1) : q;
}
template <typename T> __device__ T spmd_rem_i(T a, T b) {
  if (b == 0) return (T)0;
  const T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
template <typename T> __device__ T spmd_fmod_int_i(T a, T b) { return b == 0 ? (T)0 : (T)(a % b); }
template <typename T> __device__ T spmd_floordiv_f(T a, T b) {
  if (b == (T)0) return a / b;
  const T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != (T)0 && ((b < (T)0) != (mod < (T)0))) div -= (T)1;
  if (div == (T)0) return copysign((T)0, a / b);
  T fl = floor(div);
  if (div - fl > (T)0.5) fl += (T)1;
  return fl;
}
template <typename T> __device__ T spmd_rem_f(T a, T b) {
  T mod = fmod(a, b);
  if (b == (T)0) return mod;
  if (mod != (T)0) { if ((b < (T)0) != (mod < (T)0)) mod += b; } else { mod = copysign((T)0, b); }
  return mod;
}
template <typename T> __device__ T spmd_lshift(T a, T b) {
  return (unsigned long long)b < sizeof(T) * 8 ? (T)(a << b) : (T)0;
}
template <typename T> __device__ T spmd_rshift(T a, T b) {
  return (unsigned long long)b < sizeof(T) * 8 ? (T)(a >> b) : (a < 0 ? (T)-1 : (T)0);
}
template <typename T> __device__ T spmd_logaddexp(T x, T y) {
  if (x == y) return x + (T)0.693147180559945309417232121458176568;
  const T d = x - y;
  if (d > (T)0) return x + log1p(exp(-d));
  if (d <= (T)0) return y + log1p(exp(d));
  return d;
}
"""
_FLOAT_C = ("float16", "float32", "float64")


def _c_numpy_loop(op: str, a: list[str], dtype: str) -> str | None:
    """The C expression of the ops whose NumPy loops C has no one function or operator for, or None."""
    t, floating = _C_TYPES[dtype], dtype in _FLOAT_C
    if op in (FLOOR_DIVIDE.name, REMAINDER.name, FMOD.name):
        if floating and op == FMOD.name:  # C's fmod, named as the op
            return f"(({t}){op}({a[0]}, {a[1]}))"
        name = {FLOOR_DIVIDE.name: "floordiv", REMAINDER.name: "rem"}.get(op, "fmod_int")
        return f"spmd_{name}_{'f' if floating else 'i'}<{t}>({a[0]}, {a[1]})"
    if op in (LEFT_SHIFT.name, RIGHT_SHIFT.name):
        return f"spmd_{'lshift' if op == LEFT_SHIFT.name else 'rshift'}<{t}>({a[0]}, {a[1]})"
    if op == LOGADDEXP.name:
        return f"spmd_logaddexp<{t}>({a[0]}, {a[1]})"
    if op in _C_BITWISE:
        return f"(({t})({a[0]} {_C_BITWISE[op]} {a[1]}))"
    x = a[0]
    simple = {
        INVERT.name: f"(!{x})" if dtype == "bool" else f"(({t})~{x})",
        RECIPROCAL.name: f"((({t})1) / {x})",
        SIGN.name: f"({x} > ({t})0 ? ({t})1 : ({x} < ({t})0 ? ({t})-1 : ({x} == ({t})0 ? ({t})0 : {x})))",
        SIGNBIT.name: f"signbit((double){x})",
        ISNAN.name: f"isnan((double){x})",
        ISINF.name: f"isinf((double){x})",
        ISFINITE.name: f"isfinite((double){x})",
    }
    if op in simple:
        return simple[op]
    if op in (FMAX.name, FMIN.name):  # NumPy's: C's fmax / fmin on floats (the other side where one is nan)
        y = a[1]
        if floating:  # C's fmax / fmin, named as the ops
            return f"(({t}){op}({x}, {y}))"
        return f"({x} {'>=' if op == FMAX.name else '<='} {y} ? {x} : {y})"
    if op == HEAVISIDE.name:
        y = a[1]
        return f"({x} < ({t})0 ? ({t})0 : ({x} > ({t})0 ? ({t})1 : ({x} == ({t})0 ? {y} : {x})))"
    return None


def elementwise_kernels(xp) -> bool:
    """Whether ``xp`` generates elementwise kernels from source (CuPy's ``ElementwiseKernel``)."""
    return is_cupy(xp) and hasattr(xp, "ElementwiseKernel")


def cuda_source(fusion: Fusion, operand_dtypes, results=None) -> tuple[str, str, str]:
    """(in_params, out_params, operation) of the ElementwiseKernel for ``fusion``: its last step as ``out``,
    or each step of ``results`` as ``out0``, ``out1``, ... (a sibling group's kernel, exec/groups.py)."""
    params = fusion.param_dtypes(operand_dtypes)
    in_params = ", ".join(f"{d} p{i}" for i, d in enumerate(params))
    outs = [("out", len(fusion.steps) - 1)] if results is None else [(f"out{i}", r) for i, r in enumerate(results)]
    out_params = ", ".join(f"{fusion.dtypes[r]} {name}" for name, r in outs)
    lines = []
    for k, ((op, refs), d) in enumerate(zip(fusion.steps, fusion.dtypes)):
        a = [_c_literal(fusion, r) for r in refs]
        lines.append(f"const {_C_TYPES[d]} t{k} = {_c_expr(op, a, d)};")
    lines += [f"{name} = t{r};" for name, r in outs]
    return in_params, out_params, "\n".join(lines)


def _c_literal(fusion: Fusion, ref: str) -> str:
    if ref[0] != "c":
        return ref
    k = int(ref[1:])
    value, dtype = fusion.consts[k], fusion.const_dtypes[k]
    text = ("true" if value else "false") if dtype == "bool" else repr(value.item())
    return f"(({_C_TYPES[dtype]}){text})"


def _c_expr(op: str, a: list[str], dtype: str) -> str:
    if op in _C_INFIX:
        return f"({a[0]} {_C_INFIX[op]} {a[1]})"
    if op in _C_CALL:
        return f"{_C_CALL[op]}({', '.join(a)})"
    if op in POINTWISE:
        return POINTWISE[op](*a)
    looped = _c_numpy_loop(op, a, dtype)
    if looped is not None:
        return looped
    x = a[0]
    if op == CONVERT.name:
        return f"(({_C_TYPES[dtype]}){x})"
    if op != ABS.name:
        raise NotImplementedError(f"a fused step needs its CUDA expression (exec/backends/cupy.py: _c_expr); got op "
                                  f"{op!r}, which has none")
    if dtype == "float16":  # through float: abs(-0.0) is +0.0 with the sign bit cleared, as NumPy's
        return f"((float16)fabsf((float){x}))"
    return f"fabs({x})" if dtype in ("float32", "float64") else f"({x} < 0 ? -{x} : {x})"


# -inf and +inf as CUDA device intrinsics (no header needed): the identities of max and min.
_INF_BITS = {"float": ("__int_as_float", "0x7f800000", "0xff800000"),
             "double": ("__longlong_as_double", "0x7ff0000000000000LL", "0xfff0000000000000LL")}


def _cupy_reduction(kind: str, dtype) -> tuple[str, str, str] | None:
    """(reduce_expr, identity, reduce_type) of a fused ``kind`` reduction's ReductionKernel, or None (max/min
    of a non-float: the chain then the library's reduction). Max/min keep a NaN from either side, as NumPy's."""
    if kind == "sum":
        return "a + b", "0", "double"
    ctype = _C_TYPES.get(np.dtype(dtype).name)
    if kind not in ("max", "min") or ctype not in _INF_BITS:
        return None
    cast, plus, minus = _INF_BITS[ctype]
    if kind == "max":
        return "(a != a || a > b) ? a : b", f"{cast}({minus})", ctype
    return "(a != a || a < b) ? a : b", f"{cast}({plus})", ctype


def _cupy_reduce_kernel(fusion: Fusion, cp, operand_dtypes, kind, axes, planned):
    """A fused reduction as ONE ``ReductionKernel``: the chain is the map (a device function generated as the
    ElementwiseKernel's body); a sum accumulates in double (as the compiled CPU loop does)."""
    in_params, head, body = cuda_reduce_source(fusion, operand_dtypes)
    reduce_expr, identity, reduce_type = _cupy_reduction(kind, fusion.dtype)
    kernel = cp.ReductionKernel(in_params, f"{fusion.dtype.name} out", head, reduce_expr,
                                f"out = ({_C_TYPES[fusion.dtype.name]})a", identity, f"spmd_fused_{kind}",
                                reduce_type=reduce_type, preamble=body)
    views, axes = fusion.views, tuple(axes)

    def run(*args):
        result = kernel(*views(args), axis=axes)
        if planned is None:
            return result
        planned[...] = result
        return planned
    return run


def cuda_reduce_source(fusion: Fusion, operand_dtypes) -> tuple[str, str, str]:
    """(in_params, map expression, preamble) of a fused reduction's ReductionKernel: the chain as a device function
    ``spmd_chain(p0, ...)`` returning its last step."""
    in_params, _, operation = cuda_source(fusion, operand_dtypes)
    params = fusion.param_dtypes(operand_dtypes)
    args = ", ".join(f"{_C_TYPES[d]} p{i}" for i, d in enumerate(params))
    last = f"t{len(fusion.steps) - 1}"
    body = operation.replace(f"out = {last};", f"return {last};")
    preamble = f"{DEVICE_HELPERS}__device__ {_C_TYPES[fusion.dtype.name]} spmd_chain({args}) {{\n{body}\n}}"
    return in_params, f"spmd_chain({', '.join(f'p{i}' for i in range(len(params)))})", preamble


def _cupy_kernel(fusion: Fusion, cp, operand_dtypes):
    in_params, out_params, operation = cuda_source(fusion, operand_dtypes)
    kernel = cp.ElementwiseKernel(in_params, out_params, operation, "spmd_fusion", preamble=DEVICE_HELPERS)
    views, shape, dtype, donate = fusion.views, fusion.shape, fusion.dtype, fusion.donate

    def run(*args):
        out = args[donate] if donate >= 0 else cp.empty(shape, dtype)
        return kernel(*views(args), out)
    return run


def _elementwise_kernel(interp, group: Group):
    """``operands -> member results`` through ONE generated CuPy ElementwiseKernel writing every member."""
    cp = interp.xp
    kernel = cp.ElementwiseKernel(*cuda_source(group.fusion, group.dtypes, group.results), "spmd_group",
                                  preamble=DEVICE_HELPERS)
    made = [(*result_of(interp, slot), k) for slot, k in zip(group.members, group.into)]

    def compute(args):
        outs = [args[k] if k >= 0 else cp.empty(shape, dtype) for shape, dtype, k in made]
        kernel(*group.fusion.views(args), *outs)
        return outs
    return compute


# ------------------------------------------------------------------------------------------- devices


def _gpu_count(cupy: ModuleType) -> int:
    """Number of GPUs visible to this process; raises RuntimeError if none."""
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError when there is no driver / device
        raise RuntimeError(
            "backend 'cupy' needs a visible CUDA GPU; cupy.cuda.runtime.getDeviceCount() raised "
            f"{type(e).__name__}: {e}"
        ) from e
    if n <= 0:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""
        raise RuntimeError(f"backend 'cupy' needs a visible CUDA GPU; found none{extra}")
    return n


def gpu_available() -> bool:
    """True when cupy imports and at least one GPU is visible."""
    try:
        _gpu_count(import_cupy())
    except RuntimeError:
        return False
    return True


def _local_rank(comm: Any) -> int:
    """Rank of this process among the ranks on its node (collective on comm)."""
    if comm is None:
        from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI

        comm = MPI.COMM_WORLD
    if hasattr(comm, "Split_type"):
        MPI = sys.modules.get("mpi4py.MPI")  # already imported if comm is an mpi4py comm
        if MPI is None:
            from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            return int(local.Get_rank())
        finally:
            if hasattr(local, "Free"):
                local.Free()
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 0


def select_device(comm: Any = None, device: int | str | None = None) -> int | None:
    """Pick and activate this rank's GPU; return its id.

    The device is ``device`` if given, else ``SPMD_DEVICE`` if set, else the
    node-local rank (``comm.Split_type(COMM_TYPE_SHARED)``) modulo the number
    of visible GPUs. Collective over ``comm`` (default ``MPI.COMM_WORLD``) in
    that last case: call it on every rank.

    Without cupy or without a visible GPU it returns None (host run), unless a
    device was asked for explicitly (argument or SPMD_DEVICE): that raises a
    RuntimeError, as does an id outside ``0..count-1``.
    """
    origin = "device argument"
    if device is None:
        env = os.environ.get("SPMD_DEVICE", "").strip()
        if env:
            device, origin = env, "SPMD_DEVICE"
    requested = device is not None
    if requested:
        try:
            device = int(device)
        except (TypeError, ValueError):
            raise ValueError(f"{origin} must be an integer GPU id; got {device!r}") from None

    try:
        cupy = import_cupy()
        count = _gpu_count(cupy)
    except RuntimeError as e:
        if requested:
            raise RuntimeError(f"{origin}={device} asks for a GPU, but: {e}") from e
        return None

    if not requested:
        device = _local_rank(comm) % count
    elif not 0 <= device < count:
        raise RuntimeError(f"{origin}={device} is out of range: {count} GPU(s) visible (ids 0..{count - 1})")
    cupy.cuda.Device(device).use()
    return device


# ------------------------------------------------------------------------------------------- the backend


class Cupy:
    """The GPU backend: CuPy's arrays and the generated kernels above (see
    ``exec/backends/__init__.ArrayBackend`` for what each method promises)."""

    name = "cupy"

    def array_module(self):
        cupy = import_cupy()
        _gpu_count(cupy)
        return cupy

    def to_device(self, x, xp):
        return xp.asarray(x)

    def synchronize(self) -> None:
        import_cupy().cuda.get_current_stream().synchronize()

    def fusion_kernel(self, fusion: Fusion, xp, operand_dtypes, scratch, out=None):
        return _cupy_kernel(fusion, xp, operand_dtypes) if elementwise_kernels(xp) else None

    def group_kernel(self, interp, group):
        return _elementwise_kernel(interp, group)

    def reduction_kernel(self, fusion: Fusion, xp, operand_dtypes, kind, axes, planned):
        if is_cupy(xp) and hasattr(xp, "ReductionKernel") and _cupy_reduction(kind, fusion.dtype) is not None:
            return _cupy_reduce_kernel(fusion, xp, operand_dtypes, kind, axes, planned)
        return None


CUPY = Cupy()
