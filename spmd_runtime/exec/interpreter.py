"""Runs an SPMDProgram on this rank's shards.

Binding happens once per (program, rank): each instruction becomes a ready
callable with its attributes and rank-dependent values (slice offsets)
resolved, so the per-step loop is just calls and frees.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ..comm import collectives
from ..opdef import lookup
from ..ops.core import PARAMETER
from ..partition.fusion import FUSION
from ..partition.schedule import pairs
from ..program import SPMDProgram
from .buffers import output_buffers, plan_buffers
from .fused import Scratch, bind_compiled, compiled_fusions, elementwise_kernels
from .groups import bind_group, sibling_groups
from .overlap import with_progress
from .rules.table import BIND


class Interpreter:
    def __init__(self, program: SPMDProgram, mc, xp, copied_outputs=frozenset(), groups=True):
        """``copied_outputs``: positions of outputs the caller copies before running again (a scan body's
        stacked results): their buffers are planned and reused like intermediates'. ``groups``: sibling
        fusions run as one compiled loop or CuPy kernel (exec/groups.py); not in loop bodies, whose results a scan
        redirects per iteration (``steps_into``)."""
        self.program, self.mc, self.xp = program, mc, xp
        instrs = program.instrs
        self.keep_fresh = output_buffers(program, copied_outputs)  # results that leave the run: no reuse
        self.planned = plan_buffers(program, xp, copied_outputs) if xp is np else {}  # made once (NumPy)
        self.fusion_scratch = Scratch(xp)  # intermediates of fused chains, shared by this program's fusions
        # a member after the lead writes its result early: only into a fresh array (no planned buffer, which
        # may still hold another value until the member's own place)
        grouping = groups and (xp is np or elementwise_kernels(xp))
        candidates = {lead: g for lead, g in (sibling_groups(program) if grouping else {}).items()
                      if not any(m in self.planned for m in g.members[1:])}
        self.cpu_kernels = compiled_fusions(program, candidates) if xp is np else {}  # slot -> compiled C loop
        self.params = [(i.out, i.attrs["index"], i.free) for i in instrs if i.op == PARAMETER.name]
        self.children: list = []  # the interpreters of loop bodies and branches bound inside this one
        self.rebound: list = []  # callables bound again by ``steps_into`` (their persistent requests freed with us)
        self.in_flight: list = []  # issued nonblocking collectives not yet waited for, oldest first
        self.dones = pairs(program)  # start slot -> done slot: a start binds with its done's flags
        grouped = {slot: bound for lead, group in candidates.items()
                   if xp is not np or ("group", lead) in self.cpu_kernels
                   for slot, bound in bind_group(self, group).items()}  # slot -> (callable, operand slots)
        self.bound = [(i.out, *grouped[i.out], i.free) if i.out in grouped else (i.out, self._bind(i), i.args, i.free)
                      for i in instrs if i.op != PARAMETER.name]
        self.steps = with_progress(self, self.bound)
        self.output_slots = [o.slot for o in program.outputs]

    def steps_into(self, destinations: dict) -> list:
        """The steps with the results of the instructions in ``destinations`` (slot -> array of the result's
        shape, C-ordered) written there instead of their planned buffers: a scan writes every iteration's
        stacked results in place. Only slots with a planned buffer can be redirected."""
        planned, self.planned = self.planned, {**self.planned, **destinations}
        try:
            rebound = {slot: self._bind(self.program.instrs[slot]) for slot in self._bound_on(destinations)}
        finally:
            self.planned = planned
        self.rebound.extend(rebound.values())
        return with_progress(self, [(out, rebound.get(out, fn), args, free) for out, fn, args, free in self.bound])

    def _bound_on(self, destinations) -> list:
        """The slots whose binding holds the planned buffer of a slot in ``destinations``: those instructions
        themselves, and each collective whose operand is one of them (its persistent request is set up on
        that buffer: comm/collectives.py)."""
        return [*destinations, *(i.out for i in self.program.instrs if i.args and i.args[0] in destinations
                                 and lookup(i.op).collective and i.out not in destinations)]

    def _bind(self, ins):
        """The op's record decides: a binder (rank-dependent ops, collectives) or its pure kernel; an
        elementwise op whose operand buffer dies here writes into it (``ins.donate``; a collective's binder
        handles its own)."""
        record = lookup(ins.op)
        if ins.out in self.cpu_kernels and ins.op != FUSION.name:  # an op compiled alone (fused.COMPILED_ALONE), a
            return bind_compiled(self, ins)  # reduction over rows (fused or not)
        if ins.donate >= 0 and record.ufunc:
            return partial(_into_operand, getattr(self.xp, record.ufunc), ins.donate)
        if ins.out in self.planned and record.ufunc:
            return partial(_into_buffer, getattr(self.xp, record.ufunc), self.planned[ins.out])
        binder = BIND.get(record)
        if binder is not None:
            return binder(self, ins)
        if record.kernel is None:
            raise NotImplementedError(f"the interpreter runs ops with a kernel or a binder; got neither for "
                                      f"{ins.op!r}")
        if ins.out in self.planned:  # a kernel that takes into= (exec/buffers.PLANNED_OPS)
            return partial(record.kernel, self.xp, **ins.attrs, into=self.planned[ins.out])
        return partial(record.kernel, self.xp, **ins.attrs)

    def free(self) -> None:
        """Free what the bound program holds outside Python, now: its collectives' MPI-4 persistent requests
        (comm/collectives.release), its loop bodies' too. Local; this interpreter must not run again."""
        for child in self.children:
            child.free()
        for fn in [fn for _, fn, _, _ in self.bound] + self.rebound:
            collectives.release(fn)

    def run(self, local_inputs, steps=None) -> list:
        """Local output shards for local input shards; each buffer is dropped after its last use. ``steps``:
        a variant of ``self.steps`` (``steps_into``)."""
        env: dict = {}
        for out, index, free in self.params:
            env[out] = local_inputs[index]
            for s in free:
                del env[s]
        for out, fn, args, free in steps or self.steps:
            env[out] = fn(*[env[a] for a in args])
            for s in free:
                del env[s]
        return [env[s] for s in self.output_slots]


def _into_operand(ufunc, position, *args):
    return ufunc(*args, out=args[position])


def _into_buffer(ufunc, buffer, *args):
    return ufunc(*args, out=buffer)
