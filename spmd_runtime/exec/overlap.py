"""Making progress on the scheduler's start/done pairs (partition/schedule.py) while they are in flight; their
binders are in exec/rules/spmd.py.

Progress: MPICH advances nonblocking collectives only inside MPI calls (unless ``MPICH_ASYNC_PROGRESS=1``
gives it a thread). With ``SPMD_PROGRESS=test`` (the default) every instruction that runs while a
collective is in flight is followed by one ``MPI_Test`` of the oldest in-flight request, which drives the
whole progress engine; which instructions those are is known from the schedule, so the rest pay nothing.
``SPMD_PROGRESS=none`` leaves progress to MPI (the waits, or its async-progress thread).
"""
from __future__ import annotations

import os

from ..ops.spmd import DONES, STARTS

PROGRESS_ENV = "SPMD_PROGRESS"
PROGRESS_MODES = ("test", "none")


def progress_mode() -> str:
    mode = os.environ.get(PROGRESS_ENV, "test").strip().lower()
    if mode not in PROGRESS_MODES:
        raise ValueError(f"{PROGRESS_ENV} must be one of {list(PROGRESS_MODES)}; got {mode!r}")
    return mode


def with_progress(interp, steps: list) -> list:
    """``steps`` with a progress test after each instruction that runs while a collective is in flight."""
    if progress_mode() == "none" or not any(i.op in STARTS_NAMES for i in interp.program.instrs):
        return steps
    in_flight, open_, out = interp.in_flight, 0, []
    ops = {i.out: i.op for i in interp.program.instrs}
    for out_slot, fn, args, free in steps:
        op = ops[out_slot]
        open_ += (op in STARTS_NAMES) - (op in DONES_NAMES)
        poke = open_ > 0 and op not in STARTS_NAMES and op not in DONES_NAMES
        out.append((out_slot, _poked(fn, in_flight) if poke else fn, args, free))
    return out


def _poked(fn, in_flight):
    def step(*args):
        result = fn(*args)
        if in_flight:
            in_flight[0].test()
        return result
    return step


STARTS_NAMES = frozenset(r.name for r in STARTS.values())
DONES_NAMES = frozenset(r.name for r in DONES.values())
