"""Cross-iteration prefetch of a scan body's all-gathers (XLA's collective pipeliner, for FSDP's weights).

A scanned layer stack under FSDP gathers each layer's weight shard inside the body: the scheduler starts the
gathers at the top of the body, so the first layer ops wait for theirs with nothing to hide behind. When a
gather's operand is the iteration's slice of a stacked input (``xs``), the next iteration's gather need not
wait: the body instead receives its gathered weight as a carry, starts the gather of the NEXT iteration's
slice (an ``xs`` read at t + 1: ``shifts``) before its compute and waits for it at its end, handing it on as
the carry; a gather before the loop fills the first iteration's. The last iteration gathers a slice no one
reads (t + 1 wraps around): one gather more than the loop's length, the price of a body the same every
iteration. Two gathered weights are alive at once (this layer's and the next's): taken only while the
prefetched bytes alone fit the overlap budget (the body's own collectives were scheduled within it before).

Asked for with ``$SPMD_SCAN_PREFETCH=1`` (off by default: on this project's CPU hosts the ranks copy each
other's bytes on the cores the compute uses, so overlap buys nothing measurable; see docs/BENCHMARKS.md).
"""
from __future__ import annotations

import os

from ..ops.core import PARAMETER
from ..ops.spmd import ALL_GATHER, DONES, STARTS
from ..program import IOSpec, Instr, SPMDProgram

PREFETCH_ENV = "SPMD_SCAN_PREFETCH"


def prefetch_enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, "0").strip() == "1"


def pipelined_body(body: SPMDProgram, nc: int, nx: int, budget: int):
    """``(body', picks)``: ``body`` with each all-gather of an xs slice taken from a carry and the next
    iteration's started at its top and waited at its end, or None when it has none (or their gathered bytes
    exceed ``budget``). Inputs of ``body'``: carries, then one per prefetch (its gathered weight),
    xs, then one per prefetch (its slice at the next iteration), then the loop invariants; outputs: carries,
    the prefetched weights, then the stacked ys; ``picks``: per prefetch, its operand's position among the xs."""
    instrs = body.instrs
    params = {i.out: i.attrs["index"] for i in instrs if i.op == PARAMETER.name}
    starts = {i.out: i for i in instrs if i.op == STARTS[ALL_GATHER].name and nc <= params.get(i.args[0], -1) < nc + nx}
    dones = [i for i in instrs if i.op == DONES[ALL_GATHER].name and i.args[0] in starts]
    if not dones or sum(d.nbytes for d in dones) > budget:
        return None
    m = len(dones)
    picks = [params[starts[d.args[0]].args[0]] - nc for d in dones]  # each gather's operand among the xs
    moved = {d.args[0] for d in dones} | {d.out for d in dones}

    def index(old: int) -> int:  # carries stay; xs move past the new carries; invariants past both
        return old if old < nc else old + m if old < nc + nx else old + 2 * m

    order: list[Instr] = [i.copy(attrs={"index": index(i.attrs["index"])}) for i in instrs if i.op == PARAMETER.name]
    carried = [_parameter(d, nc + j, len(instrs) + j) for j, d in enumerate(dones)]
    nxt = [_parameter(instrs[starts[d.args[0]].args[0]], nc + m + nx + j, len(instrs) + m + j)
           for j, d in enumerate(dones)]
    fresh = len(instrs) + 2 * m
    new_starts = [starts[d.args[0]].copy(out=fresh + j, args=(x.out,)) for j, (d, x) in enumerate(zip(dones, nxt))]
    new_dones = [d.copy(out=fresh + m + j, args=(s.out, x.out)) for j, (d, s, x) in enumerate(zip(dones, new_starts,
                                                                                                   nxt))]
    rest = [i for i in instrs if i.op != PARAMETER.name and i.out not in moved]
    order += carried + nxt + new_starts + rest + new_dones
    replaced = {d.out: p.out for d, p in zip(dones, carried)}  # a done's readers now read the carried weight
    renumber = {ins.out: k for k, ins in enumerate(order)}
    renumber.update({old: renumber[new] for old, new in replaced.items()})
    new_instrs = [ins.renumbered(renumber) for ins in order]
    inputs = sorted([i.at(renumber[i.slot]) for i in body.inputs]
                    + [IOSpec(f"prefetched{j}", renumber[p.out], d.global_shape, d.dtype, d.sharding)
                       for j, (p, d) in enumerate(zip(carried, dones))]
                    + [IOSpec(f"next{j}", renumber[x.out], x.global_shape, x.dtype, x.sharding)
                       for j, x in enumerate(nxt)], key=lambda io: new_instrs[io.slot].attrs["index"])
    outs = [o.at(renumber[o.slot]) for o in body.outputs]
    handed = [IOSpec(f"prefetched{j}", renumber[d.out], d.global_shape, d.dtype, d.sharding)
              for j, d in enumerate(new_dones)]
    return SPMDProgram(body.mesh, new_instrs, inputs, outs[:nc] + handed + outs[nc:], list(body.notes), body.report,
                       None, None, {renumber[s]: n for s, n in body.names.items() if s in renumber}), picks


def _parameter(like: Instr, index: int, slot: int) -> Instr:
    """A parameter of ``like``'s local shape, dtype and sharding at input ``index``."""
    return Instr(PARAMETER.name, slot, (), {"index": index}, like.shape, like.dtype, like.sharding, like.global_shape)
