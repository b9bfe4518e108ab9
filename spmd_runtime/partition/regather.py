"""FSDP's reshard after forward: a weight gathered from a program input and read again much later is gathered
again there, instead of being kept whole in between.

Under FSDP each weight is held split and all-gathered where it is used (``mesh_split(w, use, grad_spec=held)``).
The partitioner emits one all-gather per annotation, so the gathered weight is read by its layer's forward and
again by the same layer's backward pass, and stays whole from one to the other: every layer's full weights are
alive at the end of the forward pass, the program's peak (PyTorch's FSDP frees them after the forward and
gathers again for the backward: ``reshard_after_forward``). This pass splits the readers of such a gathered
value (through the local reshapes that view it, e.g. a fused q, k, v weight viewed head-major) into runs with
more than ``REGATHER_GAP`` instructions between them, and gives each run after the first its own copy of the
all-gather (and the reshapes), placed just before the run; the scheduler (``schedule.py``) then prefetches it
like the first. The operand is a program input, alive throughout, so a later gather costs wire bytes only.
Runs after fusion and before scheduling; ``SPMD_REGATHER=0`` turns it off.
"""
from __future__ import annotations

import os

from ..graph import PARAMETER
from ..ops.core import RESHAPE
from ..ops.spmd import ALL_GATHER
from ..program import Instr

REGATHER_ENV = "SPMD_REGATHER"
REGATHER_GAP = 64  # instructions between two reads of a gathered weight beyond which it is gathered again


def regather_enabled() -> bool:
    return os.environ.get(REGATHER_ENV, "1").strip() != "0"


def regathered(instrs: list[Instr], gap: int = REGATHER_GAP):
    """(``instrs`` (blocking collectives, slot = position) with the late readers of each gathered input given
    their own gather, slots renumbered, frees and donations left for the caller to redo; old slot -> new slot;
    copied gather -> the earliest gap the scheduler may start it at, after the previous run's last reader: its
    operand exists from the top, and prefetched from there it would be alive all along), or None when no
    gathered value is read again more than ``gap`` instructions after its previous reader."""
    readers: dict[int, list[int]] = {}
    for ins in instrs:
        for a in dict.fromkeys(ins.args):
            readers.setdefault(a, []).append(ins.out)
    before: dict[int, list[tuple[list[int], int]]] = {}  # reader slot -> chains (slots) to copy before it
    rebind: dict[int, list[int]] = {}  # reader slot -> the chain ends it reads, each replaced by its copy's
    for ins in instrs:
        if ins.op != ALL_GATHER.name or instrs[ins.args[0]].op != PARAMETER.name:
            continue
        chain = [ins.out]
        while len(readers.get(chain[-1], ())) == 1 and instrs[readers[chain[-1]][0]].op == RESHAPE.name:
            chain.append(readers[chain[-1]][0])
        runs = _runs(readers.get(chain[-1], []), gap)
        for previous, run in zip(runs, runs[1:]):
            before.setdefault(run[0], []).append((chain, chain[-1], previous[-1]))
            for r in run:
                rebind.setdefault(r, []).append(chain[-1])
    if not before:
        return None
    return _rebuilt(instrs, before, rebind)


def _runs(slots: list[int], gap: int) -> list[list[int]]:
    """``slots`` (ascending) cut where two neighbours lie more than ``gap`` apart."""
    runs: list[list[int]] = []
    for s in slots:
        if runs and s - runs[-1][-1] <= gap:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _rebuilt(instrs: list[Instr], before: dict, rebind: dict) -> tuple[list[Instr], dict[int, int], dict[int, int]]:
    """(the program with each chain copied before the reader that starts its run, the run's readers reading the
    copy; old slot -> new slot; each copied gather -> the first gap it may start at: after the previous run)."""
    out: list[Instr] = []
    not_before: dict[int, int] = {}
    new: dict[int, int] = {}
    current: dict[int, int] = {}  # chain end -> slot of the copy its current run reads
    for ins in instrs:
        for chain, end, previous in before.get(ins.out, ()):
            local = dict(new)
            for slot in chain:
                local[slot] = len(out)
                out.append(instrs[slot].renumbered(local, out=len(out)))
            current[end] = local[end]
            not_before[local[chain[0]]] = new[previous] + 1
        new[ins.out] = len(out)
        mapping = {**new, **{end: current[end] for end in rebind[ins.out]}} if ins.out in rebind else new
        out.append(ins.renumbered(mapping, out=len(out)))
    return out, new, not_before
