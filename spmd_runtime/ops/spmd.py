"""Program ops: what only the partitioner emits. Collectives over mesh axes and the layout ops that
move between a global value and this rank's block (take a block, mask the padding of an uneven one,
this rank's shard number, resize a dim). ONE record each; their binders resolve the rank-dependent
parts (block bounds, peers) once, when the interpreter binds the program.
"""
from __future__ import annotations

from functools import partial

from .. import opdef
from ..comm import collectives
from ..opdef import define
from ..partition.resharding import exchange_table
from ..sharding import block_span

ALL_REDUCE = define("all_reduce", "program", fresh=True, collective=True, in_place=True)  # MPI.IN_PLACE
ALL_GATHER = define("all_gather", "program", fresh=True, collective=True)
REDUCE_SCATTER = define("reduce_scatter", "program", fresh=True, collective=True)
ALL_TO_ALL = define("all_to_all", "program", fresh=True, collective=True)
COLLECTIVE_PERMUTE = define("collective_permute", "program", fresh=True, collective=True)
ALL_TO_ALLV = define("all_to_allv", "program", fresh=True, collective=True)  # the planner's block exchange
SHARD_SLICE = define("shard_slice", "program", fresh=True)  # this rank's block of a whole dim (or ``shift`` on)
ROTATED_CONCAT = define("rotated_concat", "program", fresh=True)  # k blocks, operand t at block (i + t) mod k
SHARD_INDEX = define("shard_index", "program", read_only=True)  # this rank's shard number along some axes
MASK_PADDING = define("mask_padding", "program")  # the padding of an uneven block set to a fill value
RESIZE = define("resize", "program")  # a dim trimmed, or zero-padded, to a size


@opdef.bind(ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE)
def _bind_collective(interp, ins):
    """The collective bound once for its operand's shape and dtype: its receive buffer is kept across runs
    unless a program output may be it, and an all-reduce into a dying operand runs in place (where MPI cannot,
    on device arrays, its result is a fresh buffer: the output analysis counted it as the operand's). An operand
    with a planned buffer gets a persistent request on it (comm/collectives.py)."""
    operand = interp.program.instrs[ins.args[0]]
    return collectives.bind(interp.mc, ins.op, interp.xp, operand.shape, operand.dtype, **ins.attrs,
                            reuse=ins.out not in interp.keep_fresh and ins.donate != 0, in_place=ins.donate == 0,
                            operand=interp.planned.get(operand.out))


@opdef.bind(ALL_TO_ALLV)
def _bind_all_to_allv(interp, ins):
    """This rank's rounds of (peer, slices) from the planner's exchange table, resolved once (window maps
    included: a slice, pad or concatenation along a split dim)."""
    a = ins.attrs
    operand = interp.program.instrs[ins.args[0]].global_shape
    table = exchange_table(a["src_dims"], a["dst_dims"], operand, interp.program.mesh, tuple(a["partial_axes"]),
                           a.get("maps"))
    rank = interp.mc.rank
    return partial(collectives.all_to_allv, interp.mc, sends=table.sends[rank], recvs=table.recvs[rank],
                   out_shape=ins.shape, fill=a.get("fill", 0))


def _shard(interp, ins) -> int:
    return interp.program.mesh.index_along(interp.mc.rank, ins.attrs["axes"])


@opdef.bind(SHARD_SLICE)
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


@opdef.bind(ROTATED_CONCAT)
def _bind_rotated_concat(interp, ins):
    """The k operands (blocks of ``dim``) joined so that operand t lands at block (i + t) mod k: this rank's
    order, resolved once."""
    k, shard = len(ins.args), _shard(interp, ins)
    order = [(j - shard) % k for j in range(k)]
    xp, dim = interp.xp, ins.attrs["dim"]
    return lambda *blocks: xp.concatenate([blocks[t] for t in order], axis=dim)


@opdef.bind(SHARD_INDEX)
def _bind_shard_index(interp, ins):
    index = interp.xp.asarray(_shard(interp, ins), "int64")
    return lambda: index


@opdef.bind(MASK_PADDING)
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


def block_pairs(mesh, axes, sign: int, shift: int, cyclic: bool = False) -> list[tuple[int, int]]:
    """(sender, receiver) world ranks: the rank holding block j receives block sign*j + shift along
    ``axes`` from the rank with the same coordinates elsewhere; blocks outside [0, k) send nothing, unless
    ``cyclic`` (a rotation: block numbers taken modulo k)."""
    k, pairs = mesh.axis_size(axes), []
    for rank in mesh.devices:
        src = sign * mesh.index_along(rank, axes) + shift
        src = src % k if cyclic else src
        if 0 <= src < k:
            coords = mesh.coords(rank)
            for a in reversed(axes):
                src, coords[a] = divmod(src, mesh.axis_size(a))
            pairs.append((mesh.rank_at(coords), rank))
    return sorted(pairs)


@opdef.kernel(RESIZE)
def _resize_kernel(xp, x, dim, size):
    """Trim ``dim`` to ``size``, or pad it with zeros up to ``size`` (uneven shards)."""
    n = x.shape[dim]
    if size <= n:
        return x[(slice(None),) * dim + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[dim] = (0, size - n)
    return xp.pad(x, pad)
