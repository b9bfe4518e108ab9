"""Latency hiding: collectives split into a start and a done, so communication overlaps computation.

XLA's ``all-reduce-start`` / ``all-reduce-done`` and its latency-hiding scheduler, reduced to what an
in-order interpreter can use. Runs once after partitioning (and fusion); the compute instructions keep
their order and only the collectives move:

- ``<kind>_start(%x, attrs...)`` goes right after ``%x`` exists and posts MPI's nonblocking collective
  (``Iallreduce``, ``Iallgather``, ``Ireduce_scatter_block``, ``Ialltoall``, ``Irecv`` + ``Isend``); its
  value is the request handle;
- ``<kind>_done(%start, %x)`` goes just before the collective's first user and waits; its value is the
  collective's result. It names ``%x`` too: MPI reads ``%x`` until then, so ``%x`` stays alive and
  unwritten; ``%x!`` marks an all-reduce reduced in place into ``%x`` (``MPI.IN_PLACE``).

A collective that is its operand's last reader and returns fewer bytes (a gradient's reduce-scatter) waits
``SHRINK_WORK`` compute instructions after its start, not before its first user: the done frees the operand,
so it starts right after the operand exists whatever the budget (left blocking, it would run where the
partitioner put it: a gradient's reduce-scatter at the end of the backward pass).

Memory budget: the receive buffers of the collectives in flight at any point stay within ``budget``
bytes; a start that would exceed it moves later, as far as its done allows. FSDP's weight all-gathers,
whose operands exist from the top of the program, thus prefetch as many layers ahead as the budget holds
(inside a scanned layer stack, one iteration ahead when asked: partition/scan_prefetch.py).

A collective stays one blocking instruction when nothing would run between its start and its done, when
it feeds only other collectives, or when it reduces 16-bit floats (emulated by several collectives; 16-bit
moves are split like any other). One that
feeds compute and another collective (a windowed einsum's ring, partition/windowed.py) is split, and the
collective it feeds starts after its done.
``partition(overlap=False)`` or ``SPMD_ASYNC=0`` turns the pass off; ``SPMD_ASYNC_BUDGET`` (bytes) or
``partition(overlap_budget=...)`` sets the budget.
"""
from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from ..collective_kinds import BY_DONE, FLOAT32, KINDS
from ..dtypes import is_low_precision
from ..opdef import lookup
from ..graph import PARAMETER
from ..ops.spmd import DONES, STARTS
from ..program import Instr, SPMDProgram

ASYNC_ENV, BUDGET_ENV = "SPMD_ASYNC", "SPMD_ASYNC_BUDGET"
DEFAULT_BUDGET = 64 << 20  # bytes of receive buffers in flight
SHRINK_WORK = 4  # compute instructions a collective that frees its larger operand overlaps before its done


def overlap_enabled(overlap: bool | None) -> bool:
    """``overlap`` itself, or for None whether ``$SPMD_ASYNC`` allows the split (anything but 0; default on)."""
    return os.environ.get(ASYNC_ENV, "1").strip() != "0" if overlap is None else bool(overlap)


def overlap_budget(budget: int | None) -> int:
    """``budget`` itself, or ``$SPMD_ASYNC_BUDGET`` (bytes), or ``DEFAULT_BUDGET``."""
    if budget is not None:
        value, where = budget, "overlap_budget"
    else:
        raw, where = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET)), f"${BUDGET_ENV}"
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{where} must be a whole number of bytes; got {raw!r}") from None
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where} must be a whole number of bytes >= 0; got {value!r}")
    return int(value)


def schedule_collectives(program: SPMDProgram, budget: int):
    """``(instrs, inputs, outputs, names, in_place)`` of ``program`` with its collectives split (slots
    renumbered; frees and donations left for the partitioner to redo; ``in_place``: the done slots whose
    all-reduce may reduce into its dying operand), or None when no collective is worth splitting."""
    instrs, n = program.instrs, len(program.instrs)
    not_before = program.__dict__.get("not_before", {})  # partition/regather.py's copies
    users: dict[int, list[int]] = defaultdict(list)
    for ins in instrs:
        for a in dict.fromkeys(ins.args):
            users[a].append(ins.out)
    collective = {op: lookup(op).collective for op in {i.op for i in instrs}}
    work = np.array([not collective[i.op] and i.op != PARAMETER.name for i in instrs] + [False])
    works_before = np.concatenate(([0], np.cumsum(work)))  # compute instructions before each gap
    load = np.zeros(n + 1, np.int64)  # bytes in flight just before each instruction (gap g: before %g)
    in_flight = 0  # bytes of every split so far: a bound on the load anywhere
    moved: dict[int, tuple[int, int]] = {}
    for ins in instrs:
        window = _window(ins, instrs, users, n, collective)
        if window is None:
            continue
        first, done, size = *window, ins.nbytes
        first = max([first] + [moved[a][1] for a in ins.args if a in moved])  # after the done of a split operand
        first = max(first, not_before.get(ins.out, 0))  # a weight gathered again: not before its earlier readers
        shrinks = _frees_more(ins, instrs, users)
        if shrinks:  # its operand dies at the done: wait soon, not at the first reader
            done = max(first + 1, min(done, int(np.searchsorted(works_before, works_before[first] + SHRINK_WORK))))
        if in_flight + size <= budget or shrinks:  # fits from its first gap on, or frees more than it takes
            start = first if first < done else None
        else:
            start = _earliest_fit(load, first, done, size, budget)
        if start is None or works_before[done] == works_before[start]:
            continue  # over budget, or nothing to hide it behind: stays blocking
        load[start:done] += size
        in_flight += size
        moved[ins.out] = (start, done)
    if not moved:
        return None
    order = _order(n, moved)
    new, started = {}, {}
    for pos, (what, slot) in enumerate(order):
        (started if what == "start" else new)[slot] = pos
    out = []
    for pos, (what, slot) in enumerate(order):
        ins = instrs[slot]
        if what == "instr":
            out.append(ins.renumbered(new, out=pos))
        elif what == "start":
            out.append(ins.copy(op=STARTS[lookup(ins.op)].name, out=pos, args=(new[ins.args[0]],), free=(),
                                donate=-1))
        else:
            out.append(ins.copy(op=DONES[lookup(ins.op)].name, out=pos, args=(started[slot], new[ins.args[0]]),
                                attrs={}, free=(), donate=-1))
    inputs = [i.at(new[i.slot]) for i in program.inputs]
    outputs = [o.at(new[o.slot]) for o in program.outputs]
    names = {new[s]: name for s, name in program.names.items() if s in new}
    in_place = [new[s] for s in moved if instrs[s].donate == 0 and users[instrs[s].args[0]] == [s]]
    return out, inputs, outputs, names, in_place


def _window(ins: Instr, instrs, users, n, collective) -> tuple[int, int] | None:
    """(earliest start gap, done gap) of a collective worth splitting, else None. Gap g lies just before %g.
    ``collective``: op name -> whether it is a collective."""
    if lookup(ins.op) not in STARTS or not ins.args:
        return None  # a kind without a nonblocking split (collective_kinds.py), or not a collective
    if is_low_precision(ins.dtype) and KINDS[ins.op].sixteen_bit == FLOAT32:
        return None  # a 16-bit reduction: several collectives, blocking (comm/low_precision.py)
    readers = users.get(ins.out, [])
    if readers and all(collective[instrs[u].op] for u in readers):
        return None  # a chain of collectives (a multi-step reshard) stays blocking: its done would be its start
    return max(ins.args) + 1, min(readers) if readers else n


def _frees_more(ins: Instr, instrs, users) -> bool:
    """Whether ``ins`` is its operand's last reader and returns fewer bytes than it reads (a reduce-scatter of a
    gradient that dies there): its done frees more than its result takes, so it goes ``SHRINK_WORK`` compute
    instructions after the start. Waiting until the first reader instead (the optimizer update, at the end)
    would keep every layer's unreduced gradient alive through the rest of the backward pass."""
    x = ins.args[0]
    return users[x][-1] == ins.out and instrs[x].nbytes > ins.nbytes and instrs[x].op != PARAMETER.name


def _earliest_fit(load, first: int, done: int, size: int, budget: int) -> int | None:
    """The earliest gap in [first, done) from which ``size`` more bytes stay within ``budget`` up to ``done``."""
    if size > budget or first >= done:
        return None
    peak_after = np.maximum.accumulate(load[first:done][::-1])[::-1]  # max load from each gap up to done
    fits = np.flatnonzero(peak_after + size <= budget)
    return first + int(fits[0]) if fits.size else None


def _order(n: int, moved: dict) -> list[tuple[str, int]]:
    """The new instruction order: at each gap the dones due there, then the starts, then the instruction."""
    starts, dones = defaultdict(list), defaultdict(list)
    for slot, (start, done) in sorted(moved.items()):
        starts[start].append(slot)
        dones[done].append(slot)
    order = []
    for gap in range(n + 1):
        if gap in dones:
            order += [("done", s) for s in dones[gap]]
        if gap in starts:
            order += [("start", s) for s in starts[gap]]
        if gap < n and gap not in moved:
            order.append(("instr", gap))
    return order


def pairs(program: SPMDProgram) -> dict[int, int]:
    """start slot -> its done slot."""
    return {i.args[0]: i.out for i in program.instrs if i.op in BY_DONE}
