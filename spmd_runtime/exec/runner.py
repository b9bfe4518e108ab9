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
from ..comm.communicator import MeshCommunicator
from ..program import SPMDProgram
from .backend import get_array_module, to_device
from .interpreter import Interpreter

_communicators: dict = {}


def communicator(mesh, comm=None) -> MeshCommunicator:
    """The MeshCommunicator for ``mesh`` over ``comm`` (default COMM_WORLD), created once."""
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    key = (mesh, id(comm))
    held = _communicators.get(key)
    if held is None or held[0] is not comm:  # the held reference keeps id(comm) from being reused
        held = _communicators[key] = (comm, MeshCommunicator(mesh, comm))
    return held[1]


def run(program: SPMDProgram, *inputs, comm=None, backend=None) -> list:
    """Run on every rank with the same global ``inputs``; returns the global outputs (NumPy/CuPy arrays)."""
    mc = _prepare(program, comm, [_check_global(program, inputs)], inputs)
    xp = get_array_module(backend)
    local = [to_device(shard(x, spec.sharding, program.mesh, mc.rank), xp) for x, spec in zip(inputs, program.inputs)]
    outs = _guarded(mc, lambda: _interpreter(program, mc, xp).run(local))
    return _guarded(mc, lambda: [unshard(o, spec.sharding, mc) for o, spec in zip(outs, program.outputs)])


def run_local(program: SPMDProgram, *local_inputs, comm=None, backend=None) -> list:
    """Run on this rank's input shards (shapes as ``program.inputs[i].sharding.local_shape``); returns local shards."""
    mc = _prepare(program, comm, [_check_local(program, local_inputs)], local_inputs)
    xp = get_array_module(backend)
    return _guarded(mc, lambda: _interpreter(program, mc, xp).run([to_device(x, xp) for x in local_inputs]))


def shard(x, sharding, mesh, rank):
    """This rank's block of the global array ``x``."""
    index = []
    for n, axes in zip(x.shape, sharding.dims):
        size = n // mesh.axis_size(axes)
        start = mesh.index_along(rank, axes) * size
        index.append(slice(start, start + size))
    return x[tuple(index)]


def unshard(local, sharding, mc):
    """The global array from every rank's block: all-gathers along each split dim."""
    for dim, axes in enumerate(sharding.dims):
        if axes:
            local = collectives.all_gather(mc, local, axes, dim)
    return local


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


def _check_local(program, inputs) -> str | None:
    return _check(program, inputs, lambda spec: spec.sharding.local_shape(spec.shape, program.mesh), "local")


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


def _interpreter(program, mc, xp) -> Interpreter:
    cache = program.__dict__.setdefault("_interpreters", {})
    key = (id(mc), xp.__name__)
    if key not in cache or cache[key].mc is not mc:
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
