"""Runs a ``fusion`` instruction (``partition/fusion.py``) as one kernel, prepared once per program.

* NumPy: the steps as ufuncs with ``out=``: intermediates in scratch buffers kept across calls (shared by
  every fusion of the interpreter: they never outlive one instruction), the result into a fresh or donated
  buffer. The same ufuncs in the same order as unfused, so bit-identical; what it saves is the allocation
  (and first-touch page faults) of every intermediate and one interpreted instruction per op. numexpr was
  measured here and left out: on this CPU NumPy's SIMD loops beat its interpreter 3-16x per pass
  (256x1024 float32: sqrt 104 us vs 1.7 ms, a*b+c 85 us vs 245 us, numexpr 2.14.2 without VML, 1 thread).
* NumPy, compiled (default where a C compiler exists): fusions of at least ``$SPMD_CPU_KERNEL_MIN`` elements
  run as one generated C loop each, compiled once per program (``exec/cpu_kernels.py``): one pass over
  memory instead of one per step.
* CuPy: one generated ``ElementwiseKernel`` per fused instruction (compiled on first use, cached by CuPy),
  one with several outputs per sibling group (exec/groups.py: AdamW's m', v', p').
* Any other array module: the steps as plain calls.

A ``fused_reduce`` (a chain reduced over its trailing dims) runs compiled as one loop accumulating each row
(exec/cpu_kernels.py); on CuPy as one generated ``ReductionKernel`` (the chain as its map; a sum accumulated
in double, a max/min of floats in the float type, NaN-propagating as NumPy's); elsewhere as its chain into a
buffer (scratch on NumPy) and the ``reduce`` op's own kernel.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import ctypes

import numpy as np

from .. import opdef
from ..opdef import lookup
from ..ops.core import MAX_BLAS_ROW
from . import cpu_kernels
from ..partition.fusion import FUSED_REDUCE, FUSION, parse_code, row_reduction

_C_TYPES = {"float16": "float16", "float32": "float", "float64": "double", "bool": "bool", "int8": "signed char",
            "int16": "short", "int32": "int", "int64": "long long", "uint8": "unsigned char",
            "uint16": "unsigned short", "uint32": "unsigned int", "uint64": "unsigned long long"}
_C_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
            "gt": ">", "ge": ">=", "and": "&&", "or": "||"}
_C_CALL = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "pow": "pow"}


class Scratch:
    """Buffers for a fusion's intermediate steps, by (shape, dtype, index): fusions run one at a time."""

    def __init__(self, xp):
        self.xp, self._held = xp, {}

    def get(self, shape, dtype, index: int):
        key = (shape, dtype, index)
        if key not in self._held:
            self._held[key] = self.xp.empty(shape, dtype)
        return self._held[key]


class Fusion:
    """A decoded fusion: steps, typed literals, operand views, result shape/dtype, in-place operand."""

    def __init__(self, ins):
        self.steps = parse_code(ins.attrs["code"])
        self.consts = [np.dtype(d).type(v) for v, d in ins.attrs["consts"]]
        self.const_dtypes = [str(np.dtype(d)) for _, d in ins.attrs["consts"]]
        self.dtypes = [str(np.dtype(d)) for d in ins.attrs["dtypes"]]
        self.shapes = [tuple(s) for s in ins.attrs["shapes"]]
        self.shape, self.dtype, self.donate = tuple(ins.shape), np.dtype(ins.dtype), ins.donate

    def views(self, args):
        """The operands reshaped for broadcasting (a view; only where the shapes differ)."""
        return [a if a.shape == s else a.reshape(s) for a, s in zip(args, self.shapes)]

    def param_dtypes(self, operand_dtypes):
        return [str(np.dtype(d)) for d in operand_dtypes]


@opdef.bind(FUSION)
def _bind_fusion(interp, ins):
    """The fusion record's binder: one kernel for the chain, scratch shared by the interpreter's fusions."""
    if ins.out in interp.cpu_kernels:
        return bind_compiled(interp, ins)
    return bind_fusion(ins, interp.xp, operand_dtypes(interp.program, ins), interp.fusion_scratch,
                       interp.planned.get(ins.out))


@opdef.bind(FUSED_REDUCE)
def _bind_fused_reduce(interp, ins):
    """The chain's kernel into a buffer and the ``reduce`` op's own kernel over it (its numerics exactly); on
    CuPy one ReductionKernel. (Where it compiled, the interpreter binds the loop: bind_compiled.)"""
    chain, xp, planned = chain_of(ins), interp.xp, interp.planned.get(ins.out)
    reduce_kernel, kind, axes = lookup("reduce").kernel, ins.attrs["kind"], ins.attrs["axes"]
    dtypes = operand_dtypes(interp.program, ins)
    if xp is np:  # the chain's values into scratch kept across runs (they never outlive this instruction)
        values = interp.fusion_scratch.get(chain.shape, np.dtype(chain.dtype), "reduced chain")
        run_chain = _numpy_chain(Fusion(chain), interp.fusion_scratch, values)
    elif _is_cupy(xp) and hasattr(xp, "ReductionKernel") and _cupy_reduction(kind, chain.dtype) is not None:
        return _cupy_reduce_kernel(Fusion(chain), xp, dtypes, kind, axes, planned)
    else:
        run_chain = bind_fusion(chain, xp, dtypes, interp.fusion_scratch)
    return lambda *args: reduce_kernel(xp, run_chain(*args), kind, axes, into=planned)


def chain_of(ins, program=None):
    """The ``fusion`` instruction computing the values a reduction reduces: a fused_reduce's chain, or for a
    plain ``reduce`` (``program`` given) its operand as a one-step chain."""
    if ins.op == "reduce":
        operand = program.instrs[ins.args[0]]
        return ins.copy(op="fusion", attrs={"code": "t0=convert(p0)", "consts": (), "dtypes": (ins.dtype,),
                                            "shapes": (tuple(operand.shape),)}, shape=tuple(operand.shape), donate=-1)
    attrs = {k: ins.attrs[k] for k in ("code", "consts", "dtypes", "shapes")}
    return ins.copy(op="fusion", attrs=attrs, shape=tuple(ins.attrs["chain_shape"]), donate=-1)


def compiled_reduction(ins, program) -> bool:
    """Whether ``ins`` is a reduction a compiled loop may run: a fused_reduce, or a row reduction
    (partition/fusion.row_reduction) left on its own."""
    return ins.op == "fused_reduce" or (ins.op == "reduce" and row_reduction(ins, program.instrs[ins.args[0]]))


def bind_compiled(interp, ins):
    """The compiled C loop of ``ins`` (a fusion, an op compiled alone, or a reduction: its chain's operands in,
    one value per row out) with its operand checks."""
    program, reducing = interp.program, ins.op in ("fused_reduce", "reduce")
    fusion = Fusion(chain_of(ins, program) if reducing else as_fusion(ins, program))
    return _compiled_chain(fusion, interp.cpu_kernels[ins.out], operand_dtypes(program, ins),
                           interp.planned.get(ins.out), tuple(ins.shape) if reducing else None)


def operand_dtypes(program, ins) -> list:
    return [program.instrs[a].dtype for a in ins.args]


# Ops worth a compiled loop of their own, outside any fusion: libmvec's vector routines compute them ~2x
# faster than NumPy's ufunc here (the cross-entropy's exp over the logits, 4x128x1024 float32: 0.39 vs
# 0.85 ms); every other single op is one memory pass either way.
COMPILED_ALONE = ("exp", "log", "tanh", "pow")


def as_fusion(ins, program):
    """``ins`` itself if a fusion, else the one-step fusion computing it (an op in COMPILED_ALONE)."""
    if ins.op == "fusion":
        return ins
    refs = ",".join(f"p{k}" for k in range(len(ins.args)))
    return ins.copy(op="fusion", attrs={"code": f"t0={ins.op}({refs})", "consts": (), "dtypes": (ins.dtype,),
                                        "shapes": tuple(tuple(program.instrs[a].shape) for a in ins.args)})


def compiled_fusions(program, groups=None) -> dict:
    """Slot -> compiled C loop (ctypes function) of every fusion (and fused_reduce, and op in COMPILED_ALONE)
    of ``program`` that has one here (exec/cpu_kernels.py): one library per program, compiled at bind time;
    {} when compiling is off, impossible (said once) or fails (said once, with the compiler's message). ``groups`` (lead slot ->
    exec/groups.Group): each group that compiles gets ONE loop, under ``("group", lead slot)``, its members
    none of their own."""
    if not cpu_kernels.enabled():
        return {}
    chosen, grouped = {}, set()
    big = lambda ins: int(np.prod(ins.shape)) >= cpu_kernels.min_elements()
    for lead, group in (groups or {}).items():
        if big(group.ins) and cpu_kernels.compilable(group.fusion, group.dtypes):
            chosen["group", lead] = (group.fusion, group.dtypes, {"results": list(group.results)})
            grouped.update(group.members)
    for ins in program.instrs:
        if ins.op in ("fusion",) + COMPILED_ALONE and big(ins) and ins.out not in grouped:
            fusion, dtypes = Fusion(as_fusion(ins, program)), operand_dtypes(program, ins)
            if cpu_kernels.compilable(fusion, dtypes):
                chosen[ins.out] = (fusion, dtypes, {})
        elif compiled_reduction(ins, program) and big(chain_of(ins, program)):
            fusion, dtypes = Fusion(chain_of(ins, program)), operand_dtypes(program, ins)
            if cpu_kernels.reducible(fusion, dtypes, ins.attrs["kind"], len(ins.attrs["axes"]), MAX_BLAS_ROW):
                chosen[ins.out] = (fusion, dtypes, {"reduce": (ins.attrs["kind"], len(ins.attrs["axes"]))})
    if not chosen or not cpu_kernels.compiler_available():
        return {}
    sources = {slot: cpu_kernels.c_function(f, d, "fusion_KEY", **o) for slot, (f, d, o) in chosen.items()}
    names = {slot: "fusion_" + hashlib.sha256(src.encode()).hexdigest()[:16] for slot, src in sources.items()}
    functions = {names[slot]: src.replace("fusion_KEY", names[slot], 1) for slot, src in sources.items()}
    try:
        library = cpu_kernels.KernelLibrary(functions)
    except (cpu_kernels.CompileError, OSError, subprocess.SubprocessError) as error:
        cpu_kernels.warn_fallback(error)
        return {}
    return {slot: library.function(name) for slot, name in names.items()}


def elementwise_kernels(xp) -> bool:
    """Whether ``xp`` generates elementwise kernels from source (CuPy's ``ElementwiseKernel``)."""
    return _is_cupy(xp) and hasattr(xp, "ElementwiseKernel")


def bind_fusion(ins, xp, operand_dtypes, scratch: Scratch, out=None):
    """``f(*operands) -> result`` for fusion instruction ``ins`` on array module ``xp``; NumPy writes the
    result into ``out`` (a buffer planned for it, exec/buffers.py) when given."""
    fusion = Fusion(ins)
    if elementwise_kernels(xp):
        return _cupy_kernel(fusion, xp, operand_dtypes)
    if xp is np:
        return _numpy_chain(fusion, scratch, out)
    return _generic_chain(fusion, xp)


# ------------------------------------------------------------------------------------------- NumPy


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
    index = _RefIndex(n_params, n_consts)
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


def _compiled_chain(fusion: Fusion, kernel, dtypes, planned, shape=None):
    """The compiled loop over C-contiguous operands (a strided one is copied first) into the donated
    operand, the planned buffer or a fresh one (of ``shape``: a reduction's, else the chain's); an operand of
    another size or dtype than the program says is refused (the loop's bounds and types are compiled in)."""
    kernel.argtypes, kernel.restype = [ctypes.c_void_p] * (len(fusion.shapes) + 1), None
    check = operand_check(fusion, dtypes)
    shape, dtype, donate = fusion.shape if shape is None else shape, fusion.dtype, fusion.donate

    def run(*args):
        arrays = check(args)
        out = arrays[donate] if donate >= 0 else planned if planned is not None else np.empty(shape, dtype)
        kernel(*[a.ctypes.data for a in arrays], out.ctypes.data)
        return out
    return run


def _numpy_step(op: str, dtype: str):
    if op == "select":
        def select(cond, a, b, out):
            if out is a or out is b or out is cond:  # in place: writing b first would clobber an operand
                np.copyto(out, np.where(cond, a, b))
            else:
                np.copyto(out, b)
                np.copyto(out, a, where=cond)
            return out
        return select
    if op == "convert":
        def convert(x, out):
            np.copyto(out, x, casting="unsafe")
            return out
        return convert
    return getattr(np, lookup(op).ufunc)


class _RefIndex(dict):
    """Position of each ref in the run-time value list [params..., consts..., temps...]."""

    def __init__(self, n_params, n_consts):
        super().__init__()
        self.n_params, self.n_consts = n_params, n_consts

    def __missing__(self, ref):
        base = {"p": 0, "c": self.n_params, "t": self.n_params + self.n_consts}[ref[0]]
        return base + int(ref[1:])


# ------------------------------------------------------------------------------------------- others


def _generic_chain(fusion: Fusion, xp):
    """Plain array-module calls, one per step (array modules without out= or generated kernels)."""
    index = _RefIndex(len(fusion.shapes), len(fusion.consts))
    plan = [(_generic_step(xp, op, d), [index[r] for r in refs]) for (op, refs), d in zip(fusion.steps, fusion.dtypes)]
    consts, views = fusion.consts, fusion.views

    def run(*args):
        env = views(args) + consts
        for fn, idx in plan:
            env.append(fn(*[env[i] for i in idx]))
        return env[-1]
    return run


def _generic_step(xp, op: str, dtype: str):
    if op == "select":
        return xp.where
    if op == "convert":
        return lambda x: xp.asarray(x).astype(dtype)
    return getattr(xp, lookup(op).ufunc)


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
    if op in cpu_kernels.POINTWISE:
        return cpu_kernels.POINTWISE[op](*a)
    x = a[0]
    if op != "abs":
        return f"(({_C_TYPES[dtype]}){x})"  # convert
    if dtype == "float16":  # through float: abs(-0.0) is +0.0 with the sign bit cleared, as NumPy's
        return f"((float16)fabsf((float){x}))"
    return f"fabs({x})" if dtype in ("float32", "float64") else f"({x} < 0 ? -{x} : {x})"


def _is_cupy(xp) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


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
    preamble = f"__device__ {_C_TYPES[fusion.dtype.name]} spmd_chain({args}) {{\n{body}\n}}"
    return in_params, f"spmd_chain({', '.join(f'p{i}' for i in range(len(params)))})", preamble


def _cupy_kernel(fusion: Fusion, cp, operand_dtypes):
    in_params, out_params, operation = cuda_source(fusion, operand_dtypes)
    kernel = cp.ElementwiseKernel(in_params, out_params, operation, "spmd_fusion")
    views, shape, dtype, donate = fusion.views, fusion.shape, fusion.dtype, fusion.donate

    def run(*args):
        out = args[donate] if donate >= 0 else cp.empty(shape, dtype)
        return kernel(*views(args), out)
    return run
