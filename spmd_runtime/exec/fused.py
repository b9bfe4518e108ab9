"""Runs a ``fusion`` instruction (``partition/fusion.py``) as one kernel, prepared once per program: the
binders of the fusion records, which ask the array backend (``exec/backends/``) for the kernel.

* NumPy (``exec/backends/numpy_c.py``): the steps as ufuncs with ``out=``: intermediates in scratch buffers
  kept across calls (shared by every fusion of the interpreter: they never outlive one instruction), the
  result into a fresh or donated buffer. The same ufuncs in the same order as unfused, so bit-identical; what
  it saves is the allocation (and first-touch page faults) of every intermediate and one interpreted
  instruction per op. numexpr was measured here and left out: on this CPU NumPy's SIMD loops beat its
  interpreter 3-16x per pass (256x1024 float32: sqrt 104 us vs 1.7 ms, a*b+c 85 us vs 245 us, numexpr 2.14.2
  without VML, 1 thread).
* NumPy, compiled (default where a C compiler exists): fusions of at least ``$SPMD_CPU_KERNEL_MIN`` elements
  run as one generated C loop each, compiled once per program (``compiled_fusions`` here chooses them,
  ``exec/backends/numpy_c.py`` generates and compiles them): one pass over memory instead of one per step.
* CuPy (``exec/backends/cupy.py``): one generated ``ElementwiseKernel`` per fused instruction (compiled on
  first use, cached by CuPy), one with several outputs per sibling group (exec/groups.py: AdamW's m', v', p').
* Any other array module: the steps as plain calls (here).

A ``fused_reduce`` (a chain reduced over its trailing dims) runs compiled as one loop accumulating each row
(exec/backends/numpy_c.py); on CuPy as one generated ``ReductionKernel`` (the chain as its map; a sum
accumulated in double, a max/min of floats in the float type, NaN-propagating as NumPy's); elsewhere as its
chain into a buffer (scratch on NumPy) and the ``reduce`` op's own kernel.
"""
from __future__ import annotations

import hashlib
import subprocess

import numpy as np

from ..opdef import lookup
from ..ops.core import CONVERT, EXP, LOG, MAX_BLAS_ROW, POW, REDUCE, SELECT, TANH
from ..ops.special import ERF, ERFC, GELU_EXACT
from ..partition.fusion import FUSED_REDUCE, FUSION, row_reduction
from .backends import backend_of, numpy_c as cpu_kernels
# cuda_source, elementwise_kernels, operand_check: read here by the tests and the interpreter (re-exported)
from .backends.cupy import cuda_source, elementwise_kernels  # noqa: F401
from .backends.numpy_c import compiled_chain, operand_check  # noqa: F401
from .backends.steps import Fusion, RefIndex, Scratch


def chain_of(ins, program=None):
    """The ``fusion`` instruction computing the values a reduction reduces: a fused_reduce's chain, or for a
    plain ``reduce`` (``program`` given) its operand as a one-step chain."""
    if ins.op == REDUCE.name:
        operand = program.instrs[ins.args[0]]
        return ins.copy(op=FUSION.name, attrs={"code": f"t0={CONVERT.name}(p0)", "consts": (), "dtypes": (ins.dtype,),
                                               "shapes": (tuple(operand.shape),)}, shape=tuple(operand.shape),
                        donate=-1)
    attrs = {k: ins.attrs[k] for k in ("code", "consts", "dtypes", "shapes")}
    return ins.copy(op=FUSION.name, attrs=attrs, shape=tuple(ins.attrs["chain_shape"]), donate=-1)


def compiled_reduction(ins, program) -> bool:
    """Whether ``ins`` is a reduction a compiled loop may run: a fused_reduce, or a row reduction
    (partition/fusion.row_reduction) left on its own."""
    return ins.op == FUSED_REDUCE.name or (ins.op == REDUCE.name and row_reduction(ins, program.instrs[ins.args[0]]))


def bind_compiled(interp, ins):
    """The compiled C loop of ``ins`` (a fusion, an op compiled alone, or a reduction: its chain's operands in,
    one value per row out) with its operand checks."""
    program, reducing = interp.program, ins.op in (FUSED_REDUCE.name, REDUCE.name)
    fusion = Fusion(chain_of(ins, program) if reducing else as_fusion(ins, program))
    if reducing and int(np.prod(ins.shape)) * int(np.prod(fusion.shape[len(fusion.shape) - len(ins.attrs["axes"]):])) \
            != int(np.prod(fusion.shape)):  # the loop writes one value per row of the chain
        raise ValueError(f"instruction %{ins.out} = {ins.op}: a compiled reduction writes one value per row of its "
                         f"chain {fusion.shape} over axes {ins.attrs['axes']}; got result shape {tuple(ins.shape)}")
    return compiled_chain(fusion, interp.cpu_kernels[ins.out], operand_dtypes(program, ins),
                          interp.planned.get(ins.out), tuple(ins.shape) if reducing else None)


def operand_dtypes(program, ins) -> list:
    return [program.instrs[a].dtype for a in ins.args]


# Ops worth a compiled loop of their own, outside any fusion: libmvec's vector routines compute them ~2x
# faster than NumPy's ufunc here (the cross-entropy's exp over the logits, 4x128x1024 float32: 0.39 vs
# 0.85 ms), and glibc's erf/erfc those of ops/special.py ~30x faster than its float64 NumPy passes (the exact
# GELU, 1024x3072 float32: 0.31 s as NumPy passes); every other single op is one memory pass either way.
COMPILED_ALONE = tuple(op.name for op in (EXP, LOG, TANH, POW, ERF, ERFC, GELU_EXACT))


def as_fusion(ins, program):
    """``ins`` itself if a fusion, else the one-step fusion computing it (an op in COMPILED_ALONE)."""
    if ins.op == FUSION.name:
        return ins
    refs = ",".join(f"p{k}" for k in range(len(ins.args)))
    return ins.copy(op=FUSION.name, attrs={"code": f"t0={ins.op}({refs})", "consts": (), "dtypes": (ins.dtype,),
                                           "shapes": tuple(tuple(program.instrs[a].shape) for a in ins.args)})


def compiled_fusions(program, groups=None) -> dict:
    """Slot -> compiled C loop (ctypes function) of every fusion (and fused_reduce, and op in COMPILED_ALONE)
    of ``program`` that has one here (exec/backends/numpy_c.py): one library per program, compiled at bind time;
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
        if ins.op in (FUSION.name,) + COMPILED_ALONE and big(ins) and ins.out not in grouped:
            fusion, dtypes = Fusion(as_fusion(ins, program)), operand_dtypes(program, ins)
            if cpu_kernels.compilable(fusion, dtypes):
                chosen[ins.out] = (fusion, dtypes, {})
        elif compiled_reduction(ins, program) and big(chain_of(ins, program)):
            fusion, dtypes = Fusion(chain_of(ins, program)), operand_dtypes(program, ins)
            if cpu_kernels.reducible(fusion, dtypes, ins.attrs["kind"], len(ins.attrs["axes"]), MAX_BLAS_ROW):
                chosen[ins.out] = (fusion, dtypes, dict(reduce=(ins.attrs["kind"], len(ins.attrs["axes"]))))
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


def bind_fusion(ins, xp, operand_dtypes, scratch: Scratch, out=None):
    """``f(*operands) -> result`` for fusion instruction ``ins`` on array module ``xp``; NumPy writes the
    result into ``out`` (a buffer planned for it, exec/buffers.py) when given."""
    fusion = Fusion(ins)
    kernel = backend_of(xp).fusion_kernel(fusion, xp, operand_dtypes, scratch, out)
    return kernel if kernel is not None else _generic_chain(fusion, xp)


# ------------------------------------------------------------------------------------------- others


def _generic_chain(fusion: Fusion, xp):
    """Plain array-module calls, one per step (array modules without out= or generated kernels)."""
    index = RefIndex(len(fusion.shapes), len(fusion.consts))
    plan = [(_generic_step(xp, op, d), [index[r] for r in refs]) for (op, refs), d in zip(fusion.steps, fusion.dtypes)]
    consts, views = fusion.consts, fusion.views

    def run(*args):
        env = views(args) + consts
        for fn, idx in plan:
            env.append(fn(*[env[i] for i in idx]))
        return env[-1]
    return run


def _generic_step(xp, op: str, dtype: str):
    if op == SELECT.name:
        return xp.where
    if op == CONVERT.name:
        return lambda x: xp.asarray(x).astype(dtype)
    return getattr(xp, lookup(op).ufunc)
