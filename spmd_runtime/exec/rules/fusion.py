"""The binders of the fusion records (``partition/fusion.py``: ``fusion``, ``fused_reduce``), registered in
``table.py``; the kernels they bind are ``exec/fused.py``'s (a generated loop, CuPy kernel or NumPy chain)."""
from __future__ import annotations

import numpy as np

from ...ops.core import REDUCE
from ...partition.fusion import FUSED_REDUCE, FUSION
from ..backends import backend_of
from ..backends.steps import Fusion
from ..fused import bind_compiled, bind_fusion, chain_of, operand_dtypes
from .table import bind


@bind(FUSION)
def _bind_fusion(interp, ins):
    """The fusion record's binder: one kernel for the chain, scratch shared by the interpreter's fusions."""
    if ins.out in interp.cpu_kernels:
        return bind_compiled(interp, ins)
    return bind_fusion(ins, interp.xp, operand_dtypes(interp.program, ins), interp.fusion_scratch,
                       interp.planned.get(ins.out))


@bind(FUSED_REDUCE)
def _bind_fused_reduce(interp, ins):
    """The chain's kernel into a buffer and the ``reduce`` op's own kernel over it (its numerics exactly); on
    CuPy one ReductionKernel. (Where it compiled, the interpreter binds the loop: bind_compiled.)"""
    chain, xp, planned = chain_of(ins), interp.xp, interp.planned.get(ins.out)
    reduce_kernel, kind, axes = REDUCE.kernel, ins.attrs["kind"], ins.attrs["axes"]
    dtypes = operand_dtypes(interp.program, ins)
    fused = backend_of(xp).reduction_kernel(Fusion(chain), xp, dtypes, kind, axes, planned)
    if fused is not None:
        return fused
    values = None
    if xp is np:  # the chain's values into scratch kept across runs (they never outlive this instruction)
        values = interp.fusion_scratch.get(chain.shape, np.dtype(chain.dtype), "reduced chain")
    run_chain = bind_fusion(chain, xp, dtypes, interp.fusion_scratch, values)
    return lambda *args: reduce_kernel(xp, run_chain(*args), kind, axes, into=planned)
