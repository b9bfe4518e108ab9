"""The binders of the ``ops/spmd.py`` family, registered in ``table.py``: the collectives (bound once per program
by ``comm/collectives.py``; the planner's block exchange from its table), the scheduler's start/done pairs
(``partition/schedule.py``) and the layout ops, each resolving its rank-dependent parts once."""
from __future__ import annotations

from functools import partial

import numpy as np

from ...comm import collectives
from ...collective_kinds import BY_START
from ...program_check import derives
from ...ops.spmd import (ALL_TO_ALLV, COLLECTIVES, DONES, MASK_PADDING, ROTATED_CONCAT, SHARD_INDEX, SHARD_SLICE,
                         STARTS)
from ...partition.exchange import exchange_rounds
from ...sharding import block_span
from .table import bind


@bind(*(record for kind, record in COLLECTIVES.items() if not kind.exchange))
def _bind_collective(interp, ins):
    """The collective bound once for its operand's shape and dtype: its receive buffer is kept across runs
    unless a program output may be it, and an all-reduce into a dying operand runs in place (where MPI cannot,
    on device arrays, its result is a fresh buffer: the output analysis counted it as the operand's). An operand
    with a planned buffer gets a persistent request on it (comm/collectives.py)."""
    operand = interp.program.instrs[ins.args[0]]
    run = collectives.bind(interp.mc, ins.op, interp.xp, operand.shape, operand.dtype, **ins.attrs,
                           reuse=ins.out not in interp.keep_fresh and ins.donate != 0, in_place=ins.donate == 0,
                           operand=interp.planned.get(operand.out))
    return _operand_checked(run, ins, operand)


def _operand_checked(run, ins, operand):
    """``run`` itself where the program check derived the operand's shape and dtype (``program_check.derives``):
    the operand then is what MPI's buffers were sized for. Otherwise (an op whose shape the file states) each call
    first compares the operand's shape and dtype with the bound ones (a tuple compare: ~0.2 us), so a file can
    never hand MPI a buffer of another size than its receive buffers."""
    if derives(operand.op):
        return run
    shape, dtype = tuple(operand.shape), np.dtype(operand.dtype)

    def checked(x):
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"instruction %{ins.out} = {ins.op}: its operand %{operand.out} ({operand.op}) must be "
                             f"{dtype}{list(shape)} as the program says; got {x.dtype}{list(x.shape)}")
        return run(x)
    checked.persistent_requests = getattr(run, "persistent_requests", ())
    return checked


@bind(ALL_TO_ALLV)
def _bind_all_to_allv(interp, ins):
    """This rank's rounds of (peer, slices), resolved once for this rank alone (window maps included: a slice,
    pad or concatenation along a split dim): no table of every rank's rounds is built."""
    a = ins.attrs
    operand = interp.program.instrs[ins.args[0]].global_shape
    sends, recvs = exchange_rounds(a["src_dims"], a["dst_dims"], operand, interp.program.mesh, interp.mc.rank,
                                   tuple(a["partial_axes"]), a.get("maps"))
    return partial(collectives.all_to_allv, interp.mc, sends=sends, recvs=recvs, out_shape=ins.shape,
                   fill=a.get("fill", 0))


@bind(*STARTS.values())
def _bind_start(interp, ins):
    """A start binds its collective once, nonblocking (``collectives.bind(..., nonblocking=True)``): per run it
    posts the MPI call and returns the ``Pending`` handle; the done waits on it (a watchdog wait site, so a
    stuck collective is still named with its instruction) and returns the result. An all-reduce whose done
    donates its operand reduces into it (``MPI.IN_PLACE``); receive buffers are kept across runs as the
    blocking binders keep them, and an operand with a planned buffer gets a persistent request on it."""
    done, operand = interp.program.instrs[interp.dones[ins.out]], interp.program.instrs[ins.args[0]]
    start = collectives.bind(interp.mc, BY_START[ins.op].name, interp.xp, operand.shape, operand.dtype,
                             **ins.attrs, reuse=done.out not in interp.keep_fresh and done.donate != 1,
                             in_place=done.donate == 1, nonblocking=True,
                             operand=interp.planned.get(operand.out))
    start = _operand_checked(start, ins, operand)
    in_flight = interp.in_flight

    def run(x):
        pending = start(x)
        in_flight.append(pending)
        return pending
    run.persistent_requests = getattr(start, "persistent_requests", ())
    return run


@bind(*DONES.values())
def _bind_done(interp, ins):
    in_flight = interp.in_flight

    def run(pending, operand):
        in_flight.remove(pending)
        return pending.wait()
    return run


def _shard(interp, ins) -> int:
    return interp.program.mesh.index_along(interp.mc.rank, ins.attrs["axes"])


@bind(SHARD_SLICE)
def _bind_shard_slice(interp, ins):
    """This rank keeps [start, stop) of the operand's dim, zero-padded to the block size (uneven shards:
    the tail of the last blocks lies past the true size). With ``shift`` s it keeps block (i + s) mod k
    instead, i its shard number of k (a step of a windowed einsum, partition/windowed.py)."""
    dim, block = ins.attrs["dim"], ins.shape[ins.attrs["dim"]]
    have = interp.program.instrs[ins.args[0]].shape[dim]
    shard = (_shard(interp, ins) + ins.attrs.get("shift", 0)) % interp.program.mesh.axis_size(ins.attrs["axes"])
    start, stop = block_span(have, block, shard)
    return partial(_take_block, interp.xp, dim, start, stop, block - (stop - start))


def _take_block(xp, dim, start, stop, pad, x):
    # copy: a view would keep the whole unsliced buffer alive
    block = x[(slice(None),) * dim + (slice(start, stop),)].copy()
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, pad)
        block = xp.pad(block, widths)
    return block


@bind(ROTATED_CONCAT)
def _bind_rotated_concat(interp, ins):
    """The k operands (blocks of ``dim``) joined so that operand t lands at block (i + t) mod k: this rank's
    order, resolved once."""
    k, shard = len(ins.args), _shard(interp, ins)
    order = [(j - shard) % k for j in range(k)]
    xp, dim = interp.xp, ins.attrs["dim"]
    return lambda *blocks: xp.concatenate([blocks[t] for t in order], axis=dim)


@bind(SHARD_INDEX)
def _bind_shard_index(interp, ins):
    index = interp.xp.asarray(_shard(interp, ins), "int64")
    return lambda: index


@bind(MASK_PADDING)
def _bind_mask_padding(interp, ins):
    """Entries of this rank's block of ``dim`` past the true size ``size`` are set to ``fill``."""
    dim, block = ins.attrs["dim"], ins.shape[ins.attrs["dim"]]
    start, stop = block_span(ins.attrs["size"], block, _shard(interp, ins))
    return partial(_fill_tail, dim, stop - start, ins.attrs["fill"])


def _fill_tail(dim, count, fill, x):
    if count == x.shape[dim]:
        return x
    x = x.copy()
    x[(slice(None),) * dim + (slice(count, None),)] = fill
    return x
