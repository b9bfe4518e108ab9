"""Sibling groups: fusions of one shape computed in ONE loop with several results (XLA's multi-output
fusion), chosen when a program is bound: a compiled C loop on the CPU, one ElementwiseKernel on CuPy.

A fusion that reads the results of other fusions of its shape (AdamW: the new moments m' and v' feed the new
parameter p') leaves those results in memory only to read them back; when the others' results must exist
anyway (they are program outputs), one loop can read g, m, v, p once and write m', v', p' (7 passes over the
parameter instead of 10). The group's loop runs where its first member stands, so every operand a member
takes from outside the group must exist by then; the members keep their places in the program (and its
listing), each handing on its result from the group's loop. A member that writes into a dying operand
(``donate``: AdamW's update of a donated parameter, ``partition(donate=...)``) does so from the group's loop
too, where nothing else reads that operand after the lead. ``$SPMD_CPU_GROUPS=0`` binds every fusion alone.

Only compiled loops (exec/backends/numpy_c.py) and CuPy's generated kernels run groups: on NumPy without a
compiler, for a group too small or not compilable, in loop bodies (whose results a scan redirects per
iteration), and where a member after the lead has a planned buffer (exec/buffers.py: it may hold another
value until the member's place), each fusion runs alone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..partition.fusion import FUSION
from ..program import Instr
from .backends import backend_of
from .fused import Fusion, operand_dtypes

GROUPS_ENV = "SPMD_CPU_GROUPS"


@dataclass(frozen=True)
class Group:
    """``members``: fusion slots in program order (the first leads); ``ins``: the one fusion over all their
    operands (``ins.args``, slots) computing every step, ``fusion`` its decoded form; ``results``: each
    member's result step in it."""
    members: tuple
    ins: Instr
    fusion: Fusion
    results: tuple
    dtypes: tuple  # of ins.args
    into: tuple = ()  # per member: the position in ins.args of the dying operand it writes into, or -1


def groups_enabled() -> bool:
    """Whether sibling fusions are bound as one loop (``$SPMD_CPU_GROUPS``: anything but 0; default on)."""
    return os.environ.get(GROUPS_ENV, "1") != "0"


def sibling_groups(program) -> dict[int, Group]:
    """Lead slot -> Group for each fusion with fusion operands of its shape whose outside operands all exist
    before the first of them; a fusion joins one group at most."""
    if not groups_enabled():
        return {}
    instrs = program.instrs
    at = {ins.out: k for k, ins in enumerate(instrs)}
    readers: dict[int, list[int]] = {}
    for ins in instrs:
        for a in ins.args:
            readers.setdefault(a, []).append(ins.out)
    taken: set[int] = set()
    groups = {}
    for ins in instrs:
        if not _groupable(ins) or ins.out in taken:
            continue
        shapes = dict(zip(ins.args, ins.attrs["shapes"]))
        feeders = [a for a in dict.fromkeys(ins.args) if a not in taken and _groupable(instrs[at[a]])
                   and tuple(instrs[at[a]].shape) == tuple(ins.shape) and tuple(shapes[a]) == tuple(ins.shape)]
        if not feeders:
            continue
        members = sorted(feeders + [ins.out], key=at.get)
        outside = {a for m in members for a in instrs[at[m]].args if a not in members}
        if all(at[a] < at[members[0]] for a in outside) and _donations_hold(instrs, at, members, readers):
            groups[members[0]] = _merged(program, [instrs[at[m]] for m in members])
            taken.update(members)
    return groups


def _donations_hold(instrs, at, members, readers) -> bool:
    """Whether every member that writes into a dying operand (``donate``) may do so at the lead's place: the
    operand comes from outside the group, no other instruction reads it after the lead (the member's own
    place is its last read), and every member reads it whole (the loop then reads each element before
    writing it: a broadcast read would see another element already overwritten)."""
    lead, inside = at[members[0]], set(members)
    for m in members:
        ins = instrs[at[m]]
        if ins.donate < 0:
            continue
        x = ins.args[ins.donate]
        if x in inside or any(r not in inside and at[r] > lead for r in readers.get(x, ())):
            return False
        for other in members:
            o = instrs[at[other]]
            if any(a == x and tuple(s) != tuple(ins.shape) for a, s in zip(o.args, o.attrs["shapes"])):
                return False
    return True


def bind_group(interp, group: Group) -> dict:
    """Slot -> (callable, operand slots) for every member: the lead runs the group's loop (the backend's: a
    compiled C loop, or on CuPy one ElementwiseKernel with an output per member) over all the group's operands
    and keeps the later members' results until each hands its own on."""
    compute, results = backend_of(interp.xp).group_kernel(interp, group), {}

    def run(*args):
        outs = compute(args)
        results.update(zip(group.members[1:], outs[1:]))
        return outs[0]
    handed_on = {slot: ((lambda *_, slot=slot: results.pop(slot)), ()) for slot in group.members[1:]}
    return {group.members[0]: (run, group.ins.args), **handed_on}


def _groupable(ins) -> bool:
    return ins.op == FUSION.name


def _merged(program, members: list) -> Group:
    """One fusion computing every member's steps, their operands merged (a member's read of another's result
    becomes that result's step)."""
    params, shapes, consts, steps, dtypes, results = [], [], [], [], [], []
    index: dict = {}  # (slot, shape) -> parameter reference
    produced: dict[int, str] = {}  # member slot -> step reference of its result
    for ins in members:
        refs = {}
        for i, (slot, shape) in enumerate(zip(ins.args, ins.attrs["shapes"])):
            key = (slot, tuple(shape))
            if slot in produced:
                refs[f"p{i}"] = produced[slot]
                continue
            if key not in index:
                index[key] = f"p{len(params)}"
                params.append(slot)
                shapes.append(tuple(shape))
            refs[f"p{i}"] = index[key]
        for k, const in enumerate(ins.attrs["consts"]):
            refs[f"c{k}"] = f"c{len(consts)}"
            consts.append(const)
        first = len(steps)
        for k, (op, operands) in enumerate(Fusion(ins).steps):
            refs[f"t{k}"] = f"t{first + k}"
            steps.append(f"t{first + k}={op}({','.join(refs[r] for r in operands)})")
        dtypes += list(ins.attrs["dtypes"])
        produced[ins.out] = f"t{len(steps) - 1}"
        results.append(len(steps) - 1)
    merged = members[0].copy(args=tuple(params), free=(), donate=-1,
                             attrs={"code": "; ".join(steps), "consts": tuple(consts), "dtypes": tuple(dtypes),
                                    "shapes": tuple(shapes)})
    into = tuple(params.index(i.args[i.donate]) if i.donate >= 0 else -1 for i in members)
    return Group(tuple(i.out for i in members), merged, Fusion(merged), tuple(results),
                 tuple(operand_dtypes(program, merged)), into)
