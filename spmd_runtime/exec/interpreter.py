"""Runs an SPMDProgram on this rank's shards.

Binding happens once per (program, rank): each instruction becomes a ready
callable with its attributes and rank-dependent values (slice offsets)
resolved, so the per-step loop is just calls and frees.
"""
from __future__ import annotations

from functools import partial

from ..comm import collectives
from ..partition.resharding import exchange_table
from ..program import SPMDProgram
from .buffers import output_buffers
from .kernels import KERNELS, UFUNC_NAMES

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


class Interpreter:
    def __init__(self, program: SPMDProgram, mc, xp):
        self.program, self.mc, self.xp = program, mc, xp
        instrs = program.instrs
        self._keep_fresh = output_buffers(program)  # collectives whose result may leave the run: no reuse
        self.params = [(i.out, i.attrs["index"], i.free) for i in instrs if i.op == "parameter"]
        self.steps = [(i.out, self._bind(i), i.args, i.free) for i in instrs if i.op != "parameter"]
        self.output_slots = [o.slot for o in program.outputs]

    def _bind(self, ins):
        if ins.op == "all_to_allv":
            return self._exchange(ins)
        if ins.op in _COLLECTIVES:
            operand = self.program.instrs[ins.args[0]]
            return collectives.bind(self.mc, ins.op, self.xp, operand.shape, operand.dtype, **ins.attrs,
                                    reuse=ins.out not in self._keep_fresh, in_place=ins.donate == 0)
        if ins.op == "shard_slice":
            return partial(_take_block, self.xp, *self._block(ins))
        if ins.op == "shard_index":
            index = self.xp.asarray(self.program.mesh.index_along(self.mc.rank, ins.attrs["axes"]), "int64")
            return lambda: index
        if ins.op == "mask_padding":
            return partial(_fill_tail, *self._valid_prefix(ins), ins.attrs["fill"])
        if ins.donate >= 0:
            return partial(_into_operand, getattr(self.xp, UFUNC_NAMES[ins.op]), ins.donate)
        if ins.op not in KERNELS:
            raise NotImplementedError(f"the interpreter runs ops {sorted(KERNELS)} and collectives; got {ins.op!r}")
        return partial(KERNELS[ins.op], self.xp, **ins.attrs)

    def _exchange(self, ins):
        """all_to_allv: this rank's rounds of (peer, slices) from the planner's table, resolved once."""
        table = exchange_table(ins.attrs["src_dims"], ins.attrs["dst_dims"], ins.global_shape, self.program.mesh,
                               tuple(ins.attrs["partial_axes"]))
        rank = self.mc.rank
        return partial(collectives.all_to_allv, self.mc, sends=table.sends[rank], recvs=table.recvs[rank],
                       out_shape=ins.shape)

    def _block(self, ins):
        """(dim, start, stop, pad): this rank keeps [start, stop) of the operand's dim, zero-padded by pad
        (uneven shards: the tail of the last blocks lies past the true size)."""
        dim, size = ins.attrs["dim"], ins.shape[ins.attrs["dim"]]
        have = self.program.instrs[ins.args[0]].shape[dim]
        start = min(self.program.mesh.index_along(self.mc.rank, ins.attrs["axes"]) * size, have)
        stop = min(start + size, have)
        return dim, start, stop, size - (stop - start)

    def _valid_prefix(self, ins):
        """(dim, count): how many leading entries of this rank's block of dim are real, not padding."""
        dim, size = ins.attrs["dim"], ins.shape[ins.attrs["dim"]]
        start = self.program.mesh.index_along(self.mc.rank, ins.attrs["axes"]) * size
        return dim, max(0, min(size, ins.attrs["size"] - start))

    def run(self, local_inputs) -> list:
        """Local output shards for local input shards; each buffer is dropped after its last use."""
        env: dict = {}
        for out, index, free in self.params:
            env[out] = local_inputs[index]
            for s in free:
                del env[s]
        for out, fn, args, free in self.steps:
            env[out] = fn(*[env[a] for a in args])
            for s in free:
                del env[s]
        return [env[s] for s in self.output_slots]


def _take_block(xp, dim, start, stop, pad, x):
    # copy: a view would keep the whole unsliced buffer alive
    block = x[(slice(None),) * dim + (slice(start, stop),)].copy()
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, pad)
        block = xp.pad(block, widths)
    return block


def _fill_tail(dim, count, fill, x):
    if count == x.shape[dim]:
        return x
    x = x.copy()
    x[(slice(None),) * dim + (slice(count, None),)] = fill
    return x


def _into_operand(ufunc, position, *args):
    return ufunc(*args, out=args[position])
