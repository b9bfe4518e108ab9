"""Which buffers of a program may be reused from one run to the next, decided once per program.

A collective's receive buffer can be kept and refilled every run (no allocation,
no first-touch page faults) only if no program output can be that buffer or a
view of it: the caller keeps outputs after the run, and the next run would
overwrite them. Ownership follows the partitioner's alias rules: fresh ops make
new buffers, an op computed in place (``donate``) writes into its operand's
buffer, and any other op may return a view of its operands.
"""
from __future__ import annotations

import os

import numpy as np

from ..opdef import fresh_result, lookup
from ..ops.control import LOOP_OUT
from ..ops.core import CONVERT, REDUCE, SELECT
from ..ops.einsum import EINSUM
from ..partition.fusion import FUSED_REDUCE, FUSION


def buffer_owners(program) -> dict[int, frozenset]:
    """Per slot, the instructions whose buffers its value may be or view (none for read-only values)."""
    owners: dict[int, frozenset] = {}
    producer = {ins.out: ins for ins in program.instrs}.__getitem__
    for ins in program.instrs:
        record = lookup(ins.op)
        if record.read_only:
            owners[ins.out] = frozenset()
        elif ins.donate >= 0:
            owners[ins.out] = owners[ins.args[ins.donate]]
        elif _adopted(ins, producer):
            owners[ins.out] = owners[producer(ins.args[0]).args[ins.attrs["index"]]]  # the loop ran in that buffer
        elif fresh_result(ins, producer):
            owners[ins.out] = frozenset({ins.out})
        else:
            owners[ins.out] = frozenset().union(*(owners[a] for a in ins.args))
    return owners


def _adopted(ins, producer) -> bool:
    """Whether ``ins`` is the result of a loop's carry that ran in its initial value's buffer (``adopt``)."""
    return ins.op == LOOP_OUT.name and ins.attrs["index"] in producer(ins.args[0]).attrs.get("adopt", ())


def output_buffers(program, copied=frozenset()) -> frozenset[int]:
    """Slots of the instructions that made a buffer some program output may be, or view; the outputs at the
    positions in ``copied`` excepted (the caller copies them out before the next run: a scan's ``ys``)."""
    owners = buffer_owners(program)
    return frozenset().union(*(owners[o.slot] for k, o in enumerate(program.outputs) if k not in copied))


def may_reach_outputs(program, slots) -> bool:
    """Whether some output of ``program`` may be, or view, the buffer of one of ``slots``: followed through
    views, in-place results and control results (anything but an op that makes a fresh buffer)."""
    users: dict[int, list] = {}
    for ins in program.instrs:
        for a in ins.args:
            users.setdefault(a, []).append(ins)
    outputs, seen, stack = {o.slot for o in program.outputs}, set(), list(slots)
    producer = {ins.out: ins for ins in program.instrs}.__getitem__
    while stack:
        slot = stack.pop()
        if slot in outputs:
            return True
        if slot not in seen:
            seen.add(slot)
            for user in users.get(slot, ()):
                fresh = fresh_result(user, producer) and (user.donate < 0 or user.args[user.donate] != slot) \
                    and not _adopted(user, producer)
                if not fresh and not lookup(user.op).read_only:
                    stack.append(user.out)
    return False


# ------------------------------------------------------------------ planned result buffers
PLAN_ENV = "SPMD_PLAN_BUFFERS"
# With the ufunc ops: the ops whose binder or kernel (its ``into=``) writes into a given buffer.
PLANNED_OPS = tuple(op.name for op in (FUSION, FUSED_REDUCE, EINSUM, REDUCE, SELECT, CONVERT))


def planning_enabled() -> bool:
    """Whether result buffers are planned (``$SPMD_PLAN_BUFFERS``, default on)."""
    return os.environ.get(PLAN_ENV, "1").strip() != "0"


def plans_into(ins) -> bool:
    """Whether ``ins`` can write its result into a buffer planned for it (and needs one: not in place)."""
    record = lookup(ins.op)
    return ins.donate < 0 and bool(ins.shape) and (record.ufunc is not None or ins.op in PLANNED_OPS)


def plan_buffers(program, xp, copied=frozenset()) -> dict:
    """``{slot: array}``: a result buffer, made once, for each instruction that ``plans_into`` and whose value
    never leaves the run; the instruction's kernel returns that buffer holding its value, C-ordered. Buffers are shared by values whose lifetimes do not overlap (same dtype and size):
    a buffer is busy from its instruction to the last use of any value that may view it (``fresh`` ops own
    their result, in-place ops write into their operand's, other ops may return views of their operands).
    Program outputs keep fresh buffers: the caller holds them after the run; those at the positions in
    ``copied`` are planned too (the caller copies them before the next run), busy to the run's end. ``$SPMD_PLAN_BUFFERS=0``: none
    planned (every result a new buffer each run; for measuring what the plan saves)."""
    if not planning_enabled():
        return {}
    instrs = program.instrs
    leaves = output_buffers(program, copied)
    roots = buffer_owners(program)
    last = {a: k for k, ins in enumerate(instrs) for a in ins.args}
    last.update({program.outputs[k].slot: len(instrs) for k in copied})
    busy_until = {}
    for k, ins in enumerate(instrs):
        for r in roots[ins.out]:
            busy_until[r] = max(busy_until.get(r, k), last.get(ins.out, k))
    position = {ins.out: k for k, ins in enumerate(instrs)}
    releases: dict[int, list[int]] = {}
    for owner, until in busy_until.items():
        releases.setdefault(until, []).append(owner)
    pools: dict[tuple, list] = {}
    held: dict[int, tuple] = {}
    planned: dict[int, object] = {}
    for k, ins in enumerate(instrs):
        if plans_into(ins) and ins.out not in leaves:
            key = (str(ins.dtype), int(np.prod(ins.shape)))
            pool = pools.setdefault(key, [])
            flat = pool.pop() if pool else xp.empty(key[1], key[0])
            planned[ins.out], held[ins.out] = flat.reshape(ins.shape), (key, flat)
        for owner in releases.get(k, ()):  # free after this instruction ran: never its own result's buffer
            if owner in held and position[owner] <= k:
                key, flat = held.pop(owner)
                pools[key].append(flat)
    return planned
