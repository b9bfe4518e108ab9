"""The NumPy backend (``NUMPY_C``): NumPy arrays on the host, fused chains as ufuncs with ``out=`` into scratch
or, where a C compiler exists, as generated C loops compiled once per program.

Fused instructions as compiled C loops on the CPU: one pass over memory per fusion.

NumPy runs a fused chain one ufunc per step, a full pass over memory each (``exec/fused.py``). Here each
fusion of a program big enough to pay (``$SPMD_CPU_KERNEL_MIN`` elements, default 16384) becomes one C
loop nest, generated from its steps as the CuPy path generates an ElementwiseKernel, compiled with the
system C compiler into one shared library per program, cached on disk and loaded with ctypes: the way
TorchInductor's CPU backend runs its fused loops. The library is the field's usual tools: ``cc``, ``ctypes``.
numexpr and numba were the library options: numexpr 2.14 is 3-5x slower than NumPy per pass on this CPU
(no VML: ``sqrt`` of 2^19 float32 0.98 vs 0.22 ms, measured); numba would JIT-compile each distinct fusion in
every process (not measured here), where one cached C library per program is compiled once per machine.

Numerics: the compiler keeps IEEE order (``-ffp-contract=off``: no FMA contraction, no reassociation), so
``+ - * /``, ``sqrt``, comparisons, select and casts give NumPy's bits; ``exp log tanh pow`` call glibc's
vector math library (libmvec, declared SIMD here instead of through ``-ffast-math``, which would also drop
NaN and Inf semantics), accurate to a few ulp as NumPy's own SIMD loops are: fused and unfused agree to
float32 rounding. float16/bfloat16 chains stay NumPy chains.

``$SPMD_CPU_KERNELS``: ``0`` never compiles; ``1`` or unset compiles when a C compiler is found, else
warns once that fused chains run as NumPy ufuncs. ``$CC`` names the compiler (default ``cc``);
``$SPMD_KERNEL_CACHE`` the cache folder (default ``~/.cache/spmd_runtime/kernels``).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ...devices import to_host
from ...opdef import lookup
from ...ops.core import (ABS, ADD, AND, CONVERT, DIV, EQ, EXP, GE, GT, LE, LOG, LT, MAXIMUM, MINIMUM, MUL, NE, NEG,
                         NOT, OR, POW, SELECT, SQRT, SUB, TANH)
from ...ops.special import ERF, ERFC, GELU_EXACT, SQRT_HALF
from .steps import Fusion, RefIndex, Scratch, result_of

KERNELS_ENV, MIN_ENV, CACHE_ENV = "SPMD_CPU_KERNELS", "SPMD_CPU_KERNEL_MIN", "SPMD_KERNEL_CACHE"
# -fno-trapping-math lets selects around float ops become vector blends (FP exception flags are not read
# here); -ffp-contract=off keeps NumPy's rounding (no FMA contraction); -fwrapv NumPy's integer wraparound.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-fwrapv", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300

# bool as its byte (NumPy stores 0 or 1): GCC vectorises no loop that loads or stores _Bool (a select on a
# bool mask ran as scalar code, slower than NumPy's chain); steps whose C value may be another byte are
# normalised with != 0 (``_expression``).
C_TYPES = {"float32": "float", "float64": "double", "bool": "uint8_t", "int8": "int8_t", "int16": "int16_t",
           "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
           "uint32": "uint32_t", "uint64": "uint64_t"}
FLOATS = ("float32", "float64")
INFIX = {ADD.name: "+", SUB.name: "-", MUL.name: "*", DIV.name: "/", EQ.name: "==", NE.name: "!=", LT.name: "<",
         LE.name: "<=", GT.name: ">", GE.name: ">=", AND.name: "&&", OR.name: "||"}
# computed in the step's dtype (operands cast to it), as NumPy's loop for that dtype
ARITHMETIC = tuple(op.name for op in (ADD, SUB, MUL, DIV, MAXIMUM, MINIMUM, NEG, ABS, EXP, LOG, TANH, SQRT, POW))
# each op's C function: C's math library names them as the ops are named, but for abs
MATH = {**{op.name: op.name for op in (EXP, LOG, TANH, SQRT, POW)}, ABS.name: "fabs"}
# The special functions: their NumPy kernels (ops/special.py) evaluate Cody's approximations in float64 and round
# once, ~100 ns per float32 element in NumPy passes (GPT-2 124M's exact GELU and its backward's erfc: ~0.3 s per
# layer and pass); here glibc's erf/erfc in double (libmvec's vector forms from glibc 2.35), rounded once too:
# both within a few double ulps of the true value, so equal to float32 rounding.
SPECIAL = {**{op.name: op.name for op in (ERF, ERFC)}, GELU_EXACT.name: "spmd_gelu_exact"}  # C names erf, erfc as the ops
SPECIAL_HELPERS = f"""
static inline double spmd_gelu_exact(double x) {{ return 0.5 * x * erfc(x * -{SQRT_HALF.hex()}); }}
"""
# NumPy's integer loops differ (true_divide, power)
FLOAT_ONLY = tuple(op.name for op in (DIV, EXP, LOG, TANH, SQRT, POW)) + tuple(SPECIAL)


# ------------------------------------------------------------------------------------------- policy


def enabled() -> bool:
    return os.environ.get(KERNELS_ENV, "1") != "0"


def min_elements() -> int:
    return int(os.environ.get(MIN_ENV, "16384"))


def compilable(fusion, operand_dtypes) -> bool:
    """Whether ``fusion`` (exec/backends/steps.Fusion) has a C loop here: known dtypes everywhere, float-only ops on
    floats, operands of the result's rank (broadcast ones with 1 where they repeat)."""
    types = [str(np.dtype(d)) for d in operand_dtypes] + fusion.dtypes + fusion.const_dtypes
    if any(t not in C_TYPES for t in types) or any(len(s) != len(fusion.shape) for s in fusion.shapes):
        return False
    for (op, _), dtype in zip(fusion.steps, fusion.dtypes):
        if op not in INFIX and op not in MATH and op not in SPECIAL and op not in (NEG.name, NOT.name, MAXIMUM.name, MINIMUM.name,
                                                              SELECT.name, CONVERT.name):
            return False
        if op in FLOAT_ONLY and dtype not in FLOATS:
            return False
    return all(s[d] in (1, fusion.shape[d]) for s in fusion.shapes for d in range(len(s)))


# ------------------------------------------------------------------------------------------- C source


def c_function(fusion, operand_dtypes, name: str, results=None, reduce=None) -> str:
    """``void name(const T0* p0, ..., R* out)``: the fusion's steps inside a loop nest over the result,
    dims of extent 1 dropped and neighbours merged where every operand repeats (or not) alike, the inner
    loop vectorised; a broadcast operand's index has stride 0 along the dims it repeats on. ``results``
    (step indices, several results of the same shape: a sibling group, exec/fused.py): ``R0* out0, ...``.
    ``reduce`` ((kind, n): a reduction) reduces the chain over its last n dims instead, one result per row:
    sums in double (float32 sums agree with NumPy's to float32 rounding), max/min over lanes."""
    dtypes = [str(np.dtype(d)) for d in operand_dtypes]
    if reduce is not None:
        return _reduce_function(fusion, dtypes, name, *reduce)
    extents, strides, _ = _loop_nest(fusion.shape, fusion.shapes)
    last = len(fusion.steps) - 1
    outs = [(f"out{j}" if results else "out", k) for j, k in enumerate(results or [last])]
    params = [f"const {C_TYPES[d]}* p{i}" for i, d in enumerate(dtypes)] + [
        f"{C_TYPES[fusion.dtypes[k]]}* {o}" for o, k in outs]
    index = [f"i{k}" for k in range(len(extents))]
    lines = [f"void {name}({', '.join(params)}) {{"]
    for k, e in enumerate(extents):
        lines.append(("  #pragma omp simd\n" if k == len(extents) - 1 else "") + f"  for (int64_t i{k} = 0; "
                     f"i{k} < {e}LL; i{k}++)")
    lines.append("  {")
    lines += _body(fusion, dtypes, index, strides)
    at = _offset(index, _contiguous(extents, [True] * len(extents)))
    lines += [f"    {o}[{at}] = t{k};" for o, k in outs]
    lines.append("  }\n}")
    return "\n".join(lines)


def _body(fusion, dtypes, index, strides) -> list[str]:
    """The loads of every operand at ``index`` and the steps ``t0 .. tN`` computed from them."""
    # Every operand loaded up front: read inside a select's arm, GCC makes it a masked load and gives up
    # vectorising the loop (attention's masked scores ran scalar).
    lines = [f"    const {C_TYPES[d]} a{i} = p{i}[{_offset(index, strides[i])}];" for i, d in enumerate(dtypes)]
    value = {f"p{i}": f"a{i}" for i in range(len(dtypes))}
    types = {f"p{i}": d for i, d in enumerate(dtypes)}
    for k, c in enumerate(fusion.consts):
        value[f"c{k}"], types[f"c{k}"] = _literal(c, fusion.const_dtypes[k]), fusion.const_dtypes[k]
    for k, ((op, refs), dtype) in enumerate(zip(fusion.steps, fusion.dtypes)):
        lines.append(f"    const {C_TYPES[dtype]} t{k} = {_expression(op, [value[r] for r in refs], [types[r] for r in refs], dtype)};")
        value[f"t{k}"], types[f"t{k}"] = f"t{k}", dtype
    return lines


# Reductions a compiled loop runs: sums, and max/min over rows that merge into one loop. As ONE accumulator
# with NumPy's NaN rule a max did not vectorise (3x slower than NumPy's SIMD max over a softmax's rows,
# measured); it runs as LANES accumulators instead, each a plain compare-and-select, with a NaN flag per
# lane (NumPy's rule: a NaN anywhere gives NaN), the lanes combined at the row's end.
COMPILED_REDUCTIONS = ("sum", "max", "min")
LANES = 8


def reducible(fusion, operand_dtypes, kind: str, n_reduced: int, max_sum_row: int) -> bool:
    """Whether a reduction has a compiled loop here: a kind in COMPILED_REDUCTIONS of a compilable float chain;
    a max/min over rows that merge into one loop (the lanes run over it), a float32 sum over rows of any length
    (its double accumulator's error, n 2^-53, stays far below float32 rounding: a cross-entropy's rows of
    50304 logits run as one pass instead of the chain's passes and NumPy's sum), a float64 one over rows of at
    most ``max_sum_row`` elements (what the unfused reduction sums by BLAS, ops/core.MAX_BLAS_ROW; longer ones
    keep NumPy's pairwise sum, whose error grows as log n, where one accumulator's grows as n)."""
    row = int(np.prod(fusion.shape[len(fusion.shape) - n_reduced:]))
    if kind in ("max", "min"):
        extents, _, n_outer = _loop_nest(fusion.shape, fusion.shapes, len(fusion.shape) - n_reduced)
        if len(extents) - n_outer != 1:  # the lanes run over one merged row loop
            return False
    return (kind in COMPILED_REDUCTIONS and fusion.dtypes[-1] in FLOATS and compilable(fusion, operand_dtypes)
            and (kind != "sum" or row <= max_sum_row or fusion.dtypes[-1] == "float32"))


def _reduce_function(fusion, dtypes, name, kind, n_reduced) -> str:
    """``void name(const T0* p0, ..., R* out)``: per row (the leading dims), the chain over the last
    ``n_reduced`` dims reduced in one pass (a sum in double here, max/min by ``_extremum_function``); its
    values are never stored."""
    if kind not in COMPILED_REDUCTIONS:
        raise ValueError(f"compiled reductions are {COMPILED_REDUCTIONS}; got {kind!r}")
    if kind != "sum":
        return _extremum_function(fusion, dtypes, name, kind, n_reduced)
    extents, strides, n_outer = _loop_nest(fusion.shape, fusion.shapes, len(fusion.shape) - n_reduced)
    result, last = C_TYPES[fusion.dtypes[-1]], len(fusion.steps) - 1
    params = [f"const {C_TYPES[d]}* p{i}" for i, d in enumerate(dtypes)] + [f"{result}* out"]
    index = [f"i{k}" for k in range(len(extents))]
    lines = [f"void {name}({', '.join(params)}) {{"]
    lines += [f"  for (int64_t i{k} = 0; i{k} < {extents[k]}LL; i{k}++)" for k in range(n_outer)]
    lines.append("  {")
    lines.append("    double acc = 0.0;")
    for k in range(n_outer, len(extents)):
        simd = "    #pragma omp simd reduction(+:acc)\n" if k == len(extents) - 1 else ""
        lines.append(f"{simd}    for (int64_t i{k} = 0; i{k} < {extents[k]}LL; i{k}++)")
    lines.append("    {")
    lines += ["  " + line for line in _body(fusion, dtypes, index, strides)]
    lines.append(f"      acc += (double)t{last};")
    lines.append("    }")
    at = _offset(index[:n_outer], _contiguous(extents[:n_outer], [True] * n_outer))
    lines.append(f"    out[{at}] = ({result})acc;")
    lines.append("  }\n}")
    return "\n".join(lines)


def _extremum_function(fusion, dtypes, name, kind, n_reduced) -> str:
    """A row max/min (the reduced dims one merged loop) over LANES accumulators: lane j takes the row's elements
    j, j + LANES, ... (a tie goes to the later element within a lane, then to the later lane, as NumPy's SIMD
    loops do), a NaN flag per lane; the row's tail goes to lane 0."""
    extents, strides, n_outer = _loop_nest(fusion.shape, fusion.shapes, len(fusion.shape) - n_reduced)
    result, last, row = C_TYPES[fusion.dtypes[-1]], len(fusion.steps) - 1, f"i{n_outer}"
    better = ">=" if kind == "max" else "<="
    params = [f"const {C_TYPES[d]}* p{i}" for i, d in enumerate(dtypes)] + [f"{result}* out"]
    outer = [f"i{k}" for k in range(n_outer)]

    def update(lane, index):
        body = ["  " + line for line in _body(fusion, dtypes, outer + [index], strides)]
        return body + [f"      nan[{lane}] |= (t{last} != t{last});",
                       f"      m[{lane}] = (t{last} {better} m[{lane}]) ? t{last} : m[{lane}];"]
    lines = [f"void {name}({', '.join(params)}) {{"]
    lines += [f"  for (int64_t i{k} = 0; i{k} < {extents[k]}LL; i{k}++)" for k in range(n_outer)]
    flag = "int32_t" if result == "float" else "int64_t"  # the flags as wide as the values: one vector width
    lines += ["  {", f"    {result} m[{LANES}]; {flag} nan[{LANES}];",
              f"    for (int j = 0; j < {LANES}; j++) {{ m[j] = {'-' if kind == 'max' else ''}INFINITY; nan[j] = 0; }}",
              f"    int64_t {row} = 0;",
              f"    for (; {row} + {LANES} <= {extents[-1]}LL; {row} += {LANES})",
              "    #pragma omp simd", f"    for (int j = 0; j < {LANES}; j++)", "    {",
              f"      const int64_t lane_index = {row} + j;", *update("j", "lane_index"), "    }",
              f"    for (; {row} < {extents[-1]}LL; {row}++)", "    {", *update("0", row), "    }",
              f"    {result} acc = m[0]; int any_nan = nan[0];",
              f"    for (int j = 1; j < {LANES}; j++) {{ acc = (m[j] {better} acc) ? m[j] : acc; any_nan |= nan[j]; }}",
              f"    out[{_offset(outer, _contiguous(extents[:n_outer], [True] * n_outer))}] = any_nan ? "
              f"({result})NAN : acc;", "  }\n}"]
    return "\n".join(lines)


def _loop_nest(shape, operand_shapes, split=None):
    """(extents, per-operand element strides, loops before ``split``) of the merged loop dims: dims of
    extent 1 dropped, neighbours merged where every operand spans (or repeats along) both alike and, given
    ``split`` (a dim index), both lie on the same side of it."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    side = (lambda d: d < split) if split is not None else (lambda d: True)
    groups: list[list[int]] = []
    for d in dims:
        if groups and side(groups[-1][-1]) == side(d) and \
                all((s[groups[-1][-1]] != 1) == (s[d] != 1) for s in operand_shapes):
            groups[-1].append(d)
        else:
            groups.append([d])
    outer = sum(1 for g in groups if side(g[0])) if split is not None else len(groups)
    if split is None and not groups:
        return [1], [[1] for _ in operand_shapes], 1
    extents = [int(np.prod([shape[d] for d in g])) for g in groups]
    full = [[s[g[0]] != 1 for g in groups] for s in operand_shapes]
    return extents, [_contiguous(extents, f) for f in full], outer


def _contiguous(extents, full):
    """Row-major element strides over the dims an operand spans (``full``); 0 where it repeats."""
    strides, step = [], 1
    for e, f in zip(reversed(extents), reversed(full)):
        strides.append(step if f else 0)
        step *= e if f else 1
    return strides[::-1]


def _offset(index, strides) -> str:
    terms = [i if s == 1 else f"{i}*{s}LL" for i, s in zip(index, strides) if s]
    return " + ".join(terms) or "0"


def _literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "1" if value else "0"
    if dtype in FLOATS:
        v = float(value)
        text = "NAN" if v != v else ("INFINITY" if v == float("inf") else "-INFINITY" if v == -float("inf")
                                     else float(value).hex())
        return f"(({C_TYPES[dtype]}){text})"
    return f"(({C_TYPES[dtype]}){int(value)}LL)" if dtype.startswith("int") else f"(({C_TYPES[dtype]}){int(value)}ULL)"


ZERO_OR_ONE = tuple(op.name for op in (EQ, NE, LT, LE, GT, GE, AND, OR, NOT, SELECT))  # a bool result stays 0 or 1


def _expression(op: str, a: list[str], types: list[str], dtype: str) -> str:
    value = _value(op, a, types, dtype)
    return value if dtype != "bool" or op in ZERO_OR_ONE else f"({value} != 0)"  # NumPy's bool(x): nonzero


def _value(op: str, a: list[str], types: list[str], dtype: str) -> str:
    ctype = C_TYPES[dtype]
    if op == CONVERT.name and dtype == "bool":
        return f"{a[0]}"  # tested != 0 as it is: a cast to a byte first would make 0.5 false
    if op in ARITHMETIC:
        a = [x if t == dtype else f"(({ctype}){x})" for x, t in zip(a, types)]
    if op in INFIX:
        return f"({a[0]} {INFIX[op]} {a[1]})"
    if op == ABS.name and dtype not in FLOATS:
        return f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
    if op == EXP.name:
        return _exp(a[0], dtype)
    if op in SPECIAL:  # in double, rounded once, as the NumPy kernel
        return f"(({ctype}){SPECIAL[op]}((double){a[0]}))"
    if op in MATH:
        return f"{MATH[op]}{'f' if dtype == 'float32' else ''}({', '.join(a)})"
    if op in POINTWISE:
        return POINTWISE[op](*a)
    return f"(({ctype}){a[0]})"  # convert


# Ops spelled alike in C and in CUDA C (exec/backends/cupy.py's kernels read this table too). A NaN on either
# side propagates and a tie gives the second operand, as np.maximum/np.minimum (max(-0.0, 0.0) is 0.0).
POINTWISE = {
    NEG.name: lambda x: f"(-{x})",
    NOT.name: lambda x: f"(!{x})",
    MAXIMUM.name: lambda x, y: f"(({x} != {x} || {x} > {y}) ? {x} : {y})",
    MINIMUM.name: lambda x, y: f"(({x} != {x} || {x} < {y}) ? {x} : {y})",
    SELECT.name: lambda c, x, y: f"({c} ? {x} : {y})",
}


# exp's vector routine falls back to scalar code for a whole vector when one lane's result leaves the normal
# range (a masked softmax's -1e9 logits: 10-20x slower). So ``spmd_exp`` computes x < LOW as
# exp(x + SHIFT) * exp(-SHIFT) (the denormal results, within a few ulp) and x < ZERO as exp(-1) * 0 = 0,
# exactly what the result rounds to. The argument is blended through integer masks: with a plain select
# GCC computes exp on both arms and blends the results, which brings the out-of-range lanes back.
EXP_HELPERS = """
static inline float spmd_blend_f(int c, float a, float b) {
  int32_t ia, ib, m = -c; memcpy(&ia, &a, 4); memcpy(&ib, &b, 4); ia = (ia & m) | (ib & ~m);
  memcpy(&a, &ia, 4); return a;
}
static inline double spmd_blend_d(int c, double a, double b) {
  int64_t ia, ib, m = -(int64_t)c; memcpy(&ia, &a, 8); memcpy(&ib, &b, 8); ia = (ia & m) | (ib & ~m);
  memcpy(&a, &ia, 8); return a;
}
static inline float spmd_expf(float x) {
  const float xs = spmd_blend_f(x < -87.0f, spmd_blend_f(x < -104.0f, -1.0f, x + 20.0f), x);
  return expf(xs) * (x < -87.0f ? (x < -104.0f ? 0.0f : 2.0611536e-09f) : 1.0f);
}
static inline double spmd_exp(double x) {
  const double xs = spmd_blend_d(x < -708.0, spmd_blend_d(x < -746.0, -1.0, x + 40.0), x);
  return exp(xs) * (x < -708.0 ? (x < -746.0 ? 0.0 : 4.248354255291589e-18) : 1.0);
}
"""


def _exp(x: str, dtype: str) -> str:
    prefix = "spmd_" if _vector_math() else ""
    return f"{prefix}{MATH[EXP.name]}{'f' if dtype == 'float32' else ''}({x})"


@functools.cache
def _vector_math() -> str:
    """Declarations that let the loop call glibc's vector math (libmvec) without -ffast-math; empty where
    that library is absent (the loops then call the scalar functions)."""
    if platform.machine() != "x86_64" or _glibc() < (2, 22):
        return ""
    names = [MATH[op.name] for op in (EXP, LOG, POW)] + ([MATH[TANH.name], SPECIAL[ERF.name], SPECIAL[ERFC.name]]
                                                         if _glibc() >= (2, 35) else [])
    simd = '__attribute__((simd("notinbranch")))'
    lines = ["#include <string.h>"]
    for n in names:
        args2 = n == MATH[POW.name]
        lines.append(f"float {n}f(float{', float' if args2 else ''}) {simd};")
        lines.append(f"double {n}(double{', double' if args2 else ''}) {simd};")
    return "\n".join(lines) + EXP_HELPERS


def _glibc() -> tuple:
    try:
        return tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])
    except (ValueError, OSError, IndexError, AttributeError):
        return (0, 0)


# ------------------------------------------------------------------------------------------- compile


class KernelLibrary:
    """The compiled loops of a set of fusions: ``function(name) -> ctypes function``. One shared library per
    distinct source, made once per machine (disk cache, file lock so concurrent ranks compile it once) and
    loaded once per process."""

    _loaded: dict[str, ctypes.CDLL] = {}

    def __init__(self, functions: dict[str, str]):
        source = "\n".join(["#include <math.h>", "#include <stdint.h>", _vector_math(), SPECIAL_HELPERS,
                            *functions.values()])
        self.lib = self._load(source)

    def function(self, name: str):
        return getattr(self.lib, name)

    @classmethod
    def _load(cls, source: str) -> ctypes.CDLL:
        compiler = os.environ.get("CC", "cc")
        key = hashlib.sha256("\0".join([source, compiler, *FLAGS, _machine()]).encode()).hexdigest()[:24]
        if key not in cls._loaded:
            cls._loaded[key] = ctypes.CDLL(str(_compiled(source, compiler, key)))
        return cls._loaded[key]


@functools.cache
def _machine() -> str:
    """What -march=native depends on: the CPU model and flags (a cache shared by different nodes keeps one
    library per CPU kind)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return platform.machine() + "\n".join(lines)
    except OSError:
        return platform.machine() + platform.processor()


# The cache holds code this process will run, so it is trusted only as far as the folder is: it must be the
# user's own and writable by no one else (else a private temporary folder is used, said once), and a library is
# loaded only if its bytes' sha256 is the one recorded beside it (``<key>.sha256``) when this user compiled it
# from the source and flags its name (``key``) hashes; anything else (a replaced, truncated or half-copied
# ``.so``) is compiled again, never loaded: dlopen runs a library's constructors before any symbol is looked
# at. The check costs one read and hash of the library (~1 ms) per program bound, not per step.
_private_dir: list = []


def _cache_dir() -> Path:
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spmd_runtime" / "kernels")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    unsafe = _unsafe(folder)
    if unsafe is None:
        return folder
    if not _private_dir:  # mode 0700, ours; removed when the process ends
        _private_dir.append(tempfile.TemporaryDirectory(prefix="spmd_kernels_"))
    private = Path(_private_dir[0].name)
    _warn_once(f"spmd_runtime: the kernel cache folder {folder} must be owned by this user and writable by no "
               f"one else; got {unsafe}: compiled loops are cached in {private} for this process instead")
    return private


def _unsafe(folder: Path) -> str | None:
    """Why ``folder`` may not hold code this process loads (another owner, group or world write), or None."""
    info = folder.stat()
    if info.st_uid != os.getuid():
        return f"owner uid {info.st_uid} (this user is {os.getuid()})"
    if info.st_mode & 0o022:
        return f"mode {oct(info.st_mode & 0o777)} (group or world writable)"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(target: Path, sidecar: Path) -> bool:
    """Whether ``target`` is the library this user compiled: its bytes hash to what ``sidecar`` records."""
    try:
        return target.is_file() and sidecar.read_text().strip() == _digest(target)
    except OSError:
        return False


def _compiled(source: str, compiler: str, key: str) -> Path:
    folder = _cache_dir()
    target, sidecar = folder / f"fusions_{key}.so", folder / f"fusions_{key}.sha256"
    with open(folder / f"fusions_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
        if not _trusted(target, sidecar):
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                c_file, so_file = Path(tmp) / "fusions.c", Path(tmp) / "fusions.so"
                c_file.write_text(source)
                libs = ["-lmvec", "-lm"] if _vector_math() else ["-lm"]
                done = subprocess.run([compiler, *FLAGS, "-o", str(so_file), str(c_file), *libs],
                                      capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
                if done.returncode != 0:
                    raise CompileError(f"compiling fused kernels with {compiler!r} must succeed; got exit "
                                       f"{done.returncode}: {done.stderr.strip()[-800:]}")
                digest = Path(tmp) / "fusions.sha256"
                digest.write_text(_digest(so_file))
                os.replace(so_file, target)  # atomic: no other process sees a half-written library
                os.replace(digest, sidecar)
        if not _trusted(target, sidecar):  # what was just written: anything else is not loaded
            raise CompileError(f"a kernel library must match the sha256 recorded when it was compiled; got "
                               f"another for {target}")
    return target


class CompileError(RuntimeError):
    pass


_warned: set[str] = set()


def compiler_available() -> bool:
    """Whether ``$CC`` (or ``cc``) exists; warns once per process when it does not and kernels are on."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler):
        return True
    _warn_once(f"spmd_runtime: no C compiler ({compiler!r} not found; set CC): fused elementwise chains run "
               f"as NumPy ufunc chains, one pass per step (slower). Set {KERNELS_ENV}=0 to choose this "
               f"and silence this note.")
    return False


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def warn_fallback(error: Exception) -> None:
    _warn_once(f"spmd_runtime: {error}. Fused elementwise chains of this program run as NumPy ufunc "
               f"chains (slower). Set {KERNELS_ENV}=0 to choose this and silence this note.")


# ------------------------------------------------------------------------------------------- NumPy chains
# A fusion's steps as ufuncs with out= (exec/fused.py binds them where no compiled loop runs it): the same ufuncs
# in the same order as unfused, so bit-identical; intermediates in scratch kept across calls.


def _numpy_chain(fusion: Fusion, scratch: Scratch, planned=None):
    """Steps as ufuncs with out=: intermediates in shared scratch (slots freed after last use), result into the
    planned buffer, a donated operand or a fresh one. With ``BLOCK`` > 0, a chain over more than 2 * BLOCK
    elements runs block by block (``_blocks``), each block through every step, so its intermediates stay in
    cache instead of streaming through memory once per step."""
    plan = _scratch_plan(fusion)
    blocks = _blocks(fusion) if len(fusion.steps) > 1 and BLOCK > 0 else None
    if blocks is None:
        return _whole(fusion, plan, [scratch.get(fusion.shape, np.dtype(d), k) for k, d in plan.slots], planned)
    return _blocked(fusion, plan, blocks, scratch, planned)


# Elements a block runs through a whole chain (its live intermediates fit in a core's L2), set by
# $SPMD_FUSE_BLOCK; 0 (the default) runs every chain whole, one full pass per step. Off by default: with the
# result buffers planned (exec/buffers.py) the one-rank training step's elementwise CPU time was higher with
# 16384-element blocks than whole (min of 3 rounds 98.4 vs 87.5 ms, scripts/profile_step.py): the per-block
# Python calls cost more than the cache misses they save at these sizes on this machine.
BLOCK = int(os.environ.get("SPMD_FUSE_BLOCK", "0"))


class _ScratchPlan:
    """Per step: the ufunc, where its operands lie in the value list [params, consts, temps], and the scratch
    slot (dtype, index) of its result (None for the last step: the result buffer)."""

    def __init__(self, steps, slots):
        self.steps, self.slots = steps, slots


def _scratch_plan(fusion: Fusion) -> _ScratchPlan:
    n_params, n_consts, last = len(fusion.shapes), len(fusion.consts), len(fusion.steps) - 1
    index = RefIndex(n_params, n_consts)
    steps, slots, free, holder, last_use, made = [], [], {}, {}, {}, {}
    for k, (_, refs) in enumerate(fusion.steps):
        for r in refs:
            last_use[r] = k
    for k, (op, refs) in enumerate(fusion.steps):
        for r in refs:  # a temp dying here frees its scratch for this step's result (in place is fine)
            if r.startswith("t") and last_use[r] == k and r in holder:
                free.setdefault(fusion.dtypes[int(r[1:])], []).append(holder.pop(r))
        slot = None
        if k != last:
            pool = free.setdefault(fusion.dtypes[k], [])
            if not pool:
                pool.append(made.get(fusion.dtypes[k], 0))
                made[fusion.dtypes[k]] = pool[-1] + 1
            slot = holder[f"t{k}"] = pool.pop()
            slots.append((slot, fusion.dtypes[k]))
        steps.append((_numpy_step(op, fusion.dtypes[k]), [index[r] for r in refs]))
    return _ScratchPlan(steps, slots)


def _result_buffer(fusion: Fusion, planned):
    """``f(args) -> the buffer the result goes to``: the donated operand, the planned buffer, or a fresh one."""
    shape, dtype, donate = fusion.shape, fusion.dtype, fusion.donate
    if donate >= 0:
        return lambda args: args[donate]
    if planned is not None:
        return lambda args: planned
    return lambda args: np.empty(shape, dtype)


def _whole(fusion: Fusion, plan: _ScratchPlan, outs, planned):
    consts, views, result = fusion.consts, fusion.views, _result_buffer(fusion, planned)
    steps = [(fn, idx, out) for (fn, idx), out in zip(plan.steps[:-1], outs)]
    last_fn, last_idx = plan.steps[-1]

    def run(*args):
        env = views(args) + consts
        for fn, idx, out in steps:
            env.append(fn(*[env[i] for i in idx], out=out))
        return last_fn(*[env[i] for i in last_idx], out=result(args))
    return run


def _blocks(fusion: Fusion):
    """The index of every block of the result, or None when it is too small to split. Blocks split the
    leading dims: integer indices on the dims before ``axis``, a range of ``step`` along it, whole trailing
    dims; an operand of size 1 along a dim (broadcast) takes index 0 / its whole extent there."""
    shape = fusion.shape
    if int(np.prod(shape)) < 2 * BLOCK:
        return None
    axis, inner = len(shape), 1
    while axis > 0 and inner * shape[axis - 1] <= BLOCK:
        axis, inner = axis - 1, inner * shape[axis - 1]
    axis = max(axis - 1, 0)
    step = max(1, BLOCK // int(np.prod(shape[axis + 1:])))
    return [(*lead, slice(j, min(j + step, shape[axis]))) for lead in np.ndindex(*shape[:axis])
            for j in range(0, shape[axis], step)], axis, step


def _operand_index(block, operand_shape, axis):
    return tuple((0 if d < axis else slice(None)) if operand_shape[d] == 1 else b for d, b in enumerate(block))


def _blocked(fusion: Fusion, plan: _ScratchPlan, blocks, scratch: Scratch, planned):
    blocks, axis, step = blocks
    block_shape = (step, *fusion.shape[axis + 1:])
    held = [scratch.get(block_shape, np.dtype(d), ("block", k)) for k, d in plan.slots]
    tail = blocks[-1][axis].stop - blocks[-1][axis].start
    tail_of = {id(h): h[:tail] for h in held}  # one view per buffer: a select in place checks identity
    tails = [tail_of[id(h)] for h in held]
    work = [([_operand_index(b, s, axis) for s in fusion.shapes], b,
             held if b[axis].stop - b[axis].start == step else tails) for b in blocks]
    consts, views, result = fusion.consts, fusion.views, _result_buffer(fusion, planned)
    steps, (last_fn, last_idx) = plan.steps[:-1], plan.steps[-1]

    def run(*args):
        operands = views(args)
        out = result(args)
        for operand_index, block, temps in work:
            env = [a[i] for a, i in zip(operands, operand_index)] + consts
            for (fn, idx), t in zip(steps, temps):
                env.append(fn(*[env[i] for i in idx], out=t))
            last_fn(*[env[i] for i in last_idx], out=out[block])
        return out
    return run


def _numpy_step(op: str, dtype: str):
    if op == SELECT.name:
        def select(cond, a, b, out):
            if out is a or out is b or out is cond:  # in place: writing b first would clobber an operand
                np.copyto(out, np.where(cond, a, b))
            else:
                np.copyto(out, b)
                np.copyto(out, a, where=cond)
            return out
        return select
    if op == CONVERT.name:
        def convert(x, out):
            np.copyto(out, x, casting="unsafe")
            return out
        return convert
    return getattr(np, lookup(op).ufunc)


# ------------------------------------------------------------------------------------------- compiled loops run


def operand_check(fusion: Fusion, dtypes):
    """``check(args) -> arrays``: the operands C-contiguous (a strided one copied), each of the size and dtype
    the compiled loop has built in (else a ValueError naming both)."""
    expected = [(int(np.prod(s)), np.dtype(d)) for s, d in zip(fusion.shapes, dtypes)]

    def check(args):
        arrays = []
        for a, (size, dt) in zip(args, expected):
            if type(a) is not np.ndarray or not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            if a.size != size or a.dtype != dt:
                raise ValueError(f"a fused instruction's operand must be {dt}[{size} elements] as the program "
                                 f"says; got {a.dtype}{list(a.shape)}")
            arrays.append(a)
        return arrays
    return check


def compiled_chain(fusion: Fusion, kernel, dtypes, planned, shape=None):
    """The compiled loop over C-contiguous operands (a strided one is copied first) into the donated
    operand, the planned buffer or a fresh one (of ``shape``: a reduction's, else the chain's); an operand of
    another size or dtype than the program says is refused (the loop's bounds and types are compiled in), and
    so is, once here, a result buffer the loop would overrun (``result_fits``)."""
    kernel.argtypes, kernel.restype = [ctypes.c_void_p] * (len(fusion.shapes) + 1), None
    check = operand_check(fusion, dtypes)
    shape, dtype, donate = fusion.shape if shape is None else shape, fusion.dtype, fusion.donate
    writes = (int(np.prod(shape)), np.dtype(fusion.dtypes[-1]))
    if donate >= 0:
        result_fits(writes, (int(np.prod(fusion.shapes[donate])), np.dtype(dtypes[donate])), f"donated operand {donate}")
    elif planned is not None:
        result_fits(writes, _buffer_of(planned), "planned buffer")
    else:
        result_fits(writes, (int(np.prod(shape)), dtype), "result")

    def run(*args):
        arrays = check(args)
        out = arrays[donate] if donate >= 0 else planned if planned is not None else np.empty(shape, dtype)
        kernel(*[a.ctypes.data for a in arrays], out.ctypes.data)
        return out
    return run


def result_fits(writes, buffer, what: str) -> None:
    """A compiled loop writes ``writes`` = (elements, dtype) through a raw pointer: the buffer it is given, of
    (elements, dtype) ``buffer``, must be exactly that (checked once, at bind; the program check makes it so for
    every program file, this is the loop's own guard)."""
    if writes[0] != buffer[0] or writes[1] != buffer[1]:
        raise ValueError(f"a compiled loop's {what} must hold what it writes, {writes[1]}[{writes[0]} elements]; "
                         f"got {buffer[1]}[{buffer[0]} elements]")


def _buffer_of(array) -> tuple:
    if type(array) is not np.ndarray or not array.flags.c_contiguous:
        raise ValueError(f"a compiled loop writes C-contiguous NumPy buffers; got {type(array).__name__}")
    return array.size, array.dtype


def _group_loop(interp, group):
    """``operands -> member results`` through the group's (exec/groups.Group) compiled C loop (above)."""
    kernel = interp.cpu_kernels["group", group.members[0]]
    kernel.argtypes = [ctypes.c_void_p] * (len(group.ins.args) + len(group.members))
    kernel.restype = None
    check = operand_check(group.fusion, group.dtypes)
    made = [(interp.planned.get(slot), *result_of(interp, slot), k) for slot, k in zip(group.members, group.into)]
    fusion = group.fusion
    for slot, (planned, shape, dtype, k), step in zip(group.members, made, group.results):
        writes = (int(np.prod(fusion.shape)), np.dtype(fusion.dtypes[step]))
        buffer = ((int(np.prod(fusion.shapes[k])), np.dtype(group.dtypes[k])) if k >= 0 else
                  _buffer_of(planned) if planned is not None else (int(np.prod(shape)), np.dtype(dtype)))
        result_fits(writes, buffer, f"result buffer for group member %{slot}")

    def compute(args):
        arrays = check(args)
        outs = [arrays[k] if k >= 0 else planned if planned is not None else np.empty(shape, dtype)
                for planned, shape, dtype, k in made]
        kernel(*[a.ctypes.data for a in arrays], *[o.ctypes.data for o in outs])
        return outs
    return compute


# ------------------------------------------------------------------------------------------- the backend


class NumpyC:
    """The host backend: NumPy's arrays, its ufunc chains and the compiled C loops above (see
    ``exec/backends/__init__.ArrayBackend`` for what each method promises)."""

    name = "numpy"

    def array_module(self):
        return np

    def to_device(self, x, xp):
        return to_host(x)

    def synchronize(self) -> None:
        """Nothing to wait for: NumPy computes eagerly."""

    def fusion_kernel(self, fusion: Fusion, xp, operand_dtypes, scratch: Scratch, out=None):
        return _numpy_chain(fusion, scratch, out) if xp is np else None

    def group_kernel(self, interp, group):
        return _group_loop(interp, group)

    def reduction_kernel(self, fusion: Fusion, xp, operand_dtypes, kind, axes, planned):
        return None  # the chain into scratch, then the reduce op's own kernel (or a compiled row loop)


NUMPY_C = NumpyC()
