"""Entry points that run an SPMDProgram on every rank.

``run`` takes and returns global arrays (each rank slices its own shards and the
outputs are gathered); ``run_local`` takes and returns this rank's shards only,
for inputs too large for one rank. Both first agree collectively that every
rank holds the same program and valid inputs, so a bad input raises on every
rank instead of leaving some blocked in a collective; a failure during the run
itself aborts the whole job with the failing rank's message.
"""
from __future__ import annotations

import sys
import traceback

import numpy as np

from ..comm import collectives
from ..dtypes import check_backend
from ..comm.communicator import MeshCommunicator
from ..program import SPMDProgram
from .backend import get_array_module, select_device, to_device
from .interpreter import Interpreter

_communicators: dict = {}


def communicator(mesh, comm=None) -> MeshCommunicator:
    """The MeshCommunicator for ``mesh`` over ``comm`` (default COMM_WORLD), created once."""
    if comm is None:
        from mpi4py import MPI  # here, not at the top: importing it initialises MPI (simulated runs need none)
        comm = MPI.COMM_WORLD
    key = (mesh, id(comm))
    held = _communicators.get(key)
    if held is None or held[0] is not comm:  # the held reference keeps id(comm) from being reused
        held = _communicators[key] = (comm, MeshCommunicator(mesh, comm))
    return held[1]


def run(program: SPMDProgram, *inputs, comm=None, backend=None) -> list:
    """Run on every rank with the same global ``inputs``; returns the global outputs (NumPy/CuPy arrays)."""
    mc = _prepare(program, comm, [_check_global(program, inputs)], inputs)
    xp = _array_module(backend, mc)
    local = [to_device(shard(x, spec.sharding, program.mesh, mc.rank, pad=True), xp)
             for x, spec in zip(inputs, program.inputs)]
    outs = _guarded(mc, lambda: _interpreter(program, mc, xp).run(local))
    return _guarded(mc, lambda: [unshard(o, spec.sharding, spec.shape, mc) for o, spec in zip(outs, program.outputs)])


def run_local(program: SPMDProgram, *local_inputs, comm=None, backend=None) -> list:
    """Run on this rank's true input blocks (``shard(x, sharding, mesh, rank)``: uneven tails are short);
    returns this rank's true output blocks."""
    mc = communicator(program.mesh, comm)
    mc_rank, mesh = mc.rank, program.mesh
    mc = _prepare(program, comm, [_check_local(program, local_inputs, mc_rank)], local_inputs)
    xp = _array_module(backend, mc)
    padded = [_pad_to(to_device(x, xp), s.sharding.local_shape(s.shape, mesh), xp)
              for x, s in zip(local_inputs, program.inputs)]
    outs = _guarded(mc, lambda: _interpreter(program, mc, xp).run(padded))
    return [_trim(o, spec, mesh, mc_rank) for o, spec in zip(outs, program.outputs)]


def block_slices(shape, sharding, mesh, rank) -> tuple[slice, ...]:
    """The global index of ``rank``'s true block of a ``shape`` tensor laid out as ``sharding``."""
    return sharding.block_slices(shape, mesh, rank)


def shard(x, sharding, mesh, rank, pad=False):
    """This rank's true block of the global array ``x``; ``pad=True`` zero-pads it to the ceil size."""
    block = x[block_slices(x.shape, sharding, mesh, rank)]
    widths = [(0, want - have) for have, want in zip(block.shape, sharding.local_shape(x.shape, mesh))]
    return np.pad(block, widths) if pad and any(w for _, w in widths) else block


def unshard(local, sharding, shape, mc):
    """The global array from every rank's (padded) block: all-gathers along each split dim, then trims."""
    for dim, axes in enumerate(sharding.dims):
        if axes:
            local = collectives.all_gather(mc, local, axes, dim)[(slice(None),) * dim + (slice(0, shape[dim]),)]
    return local


def _pad_to(x, shape, xp):
    widths = [(0, want - have) for have, want in zip(x.shape, shape)]
    return xp.pad(x, widths) if any(w for _, w in widths) else x


def _trim(x, spec, mesh, rank):
    return x[tuple(slice(0, s.stop - s.start) for s in block_slices(spec.shape, spec.sharding, mesh, rank))]


def _prepare(program, comm, errors, inputs) -> MeshCommunicator:
    mc = communicator(program.mesh, comm)
    error = next((e for e in errors if e), None)
    mine = program.hash
    hashes = mc.comm.allgather(mine)
    if error is None and any(h != mine for h in hashes):
        error = f"every rank must run the same program; got hashes {sorted(set(h[:12] for h in hashes))}"
    mc.agree(error)
    return mc


def _check_global(program, inputs) -> str | None:
    return _check(program, inputs, lambda spec: spec.shape, "global")


def _check_local(program, inputs, rank) -> str | None:
    def true_block(spec):
        return tuple(s.stop - s.start for s in block_slices(spec.shape, spec.sharding, program.mesh, rank))
    return _check(program, inputs, true_block, "local")


def _check(program, inputs, shape_of, kind) -> str | None:
    if len(inputs) != len(program.inputs):
        return (f"the program takes {len(program.inputs)} inputs {[i.name for i in program.inputs]}; "
                f"got {len(inputs)}")
    for x, spec in zip(inputs, program.inputs):
        want = shape_of(spec)
        if tuple(getattr(x, "shape", ())) != tuple(want) or np.dtype(getattr(x, "dtype", None)) != spec.dtype:
            got = f"{np.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            return f"{kind} input {spec.name!r} must be {spec.dtype}{list(want)}; got {got}"
    return None


def _array_module(backend, mc):
    """NumPy or CuPy; with CuPy each rank binds its GPU (node-local rank) once per communicator."""
    xp = get_array_module(backend)
    if xp.__name__ == "cupy" and not getattr(mc, "gpu_selected", False):
        select_device(mc.comm)  # collective on first use: every rank of a CuPy run gets here
        mc.gpu_selected = True
    return xp


def _interpreter(program, mc, xp) -> Interpreter:
    cache = program.__dict__.setdefault("_interpreters", {})
    key = (id(mc), xp.__name__)
    if key not in cache or cache[key].mc is not mc:
        for dtype in {v.dtype for v in (*program.inputs, *program.instrs)}:
            check_backend(xp, dtype)  # CuPy has no bfloat16: refused, not emulated
        cache[key] = Interpreter(program, mc, xp)
    return cache[key]


def _guarded(mc, fn):
    """Run ``fn``; on failure print the rank's error and abort the job so no rank hangs in a collective."""
    try:
        return fn()
    except Exception as e:
        if mc.comm.Get_size() == 1 or not hasattr(mc.comm, "Abort"):
            raise
        sys.stderr.write(f"spmd_runtime: rank {mc.rank} failed, aborting the job:\n{traceback.format_exc()}")
        sys.stderr.flush()
        mc.comm.Abort(1)
        raise e
