"""Running control instructions: each body is an SPMD program of its own, bound ONCE per rank (its own
Interpreter) and run as many times as the loop goes round. A control instruction's value is the tuple
of its results, read by ``loop_out`` instructions. The binders here (scan, while, cond, and a shard_map
region's) are registered in ``rules/control.py`` and ``rules/manual.py``."""
from __future__ import annotations

import numpy as np

from ..ops.control import LOOP_OUT
from .buffers import buffer_owners, may_reach_outputs
from .interpreter import Interpreter


def _bound(interp, program, copied_outputs=frozenset()):
    child = Interpreter(program, interp.mc, interp.xp, copied_outputs, groups=False)
    interp.children.append(child)  # freed with its parent
    return child


def bind_scan(interp, ins):
    """The body bound once; its per-iteration results (``ys``) are copied into the stacked arrays, so the body
    writes them into buffers of its own reused every iteration. The stacked arrays themselves are made once
    and refilled every run (no allocation, no page faults) when no program output can be them: residuals
    the backward scan reads, typically. Then a result computed in a planned buffer is written straight into its
    stacked array (a planned buffer always holds its value, C-ordered: exec/buffers.py), the rest copied: the
    2-rank reference step's forward scan copied 2.6 MB per layer before the in-place chains were followed
    (``_written_in_place``), 0.5 MB after (its layer inputs). Its backward scan's stacked gradients leave the
    run (AdamW computes v' into them), so they are fresh arrays each run and copied (3.1 MB per layer)."""
    a, xp, mesh = ins.attrs, interp.xp, interp.program.mesh
    length, nc, nx = a["length"], a["num_carry"], a["num_xs"]
    shifts = a.get("shifts") or (0,) * nx  # an xs read at t + shift (wrapping): a prefetched next slice
    body = _bound(interp, a["body"], frozenset(range(nc, len(a["body"].outputs))))
    stacked = [((length,) + o.sharding.local_shape(o.shape, mesh), o.dtype) for o in a["body"].outputs[nc:]]
    order = range(length - 1, -1, -1) if a["reverse"] else range(length)
    kept = None if xp is not np or _escapes(interp.program, ins) else [np.empty(s, d) for s, d in stacked]
    direct = _written_in_place(body, nc) if kept is not None else {}
    steps = [body.steps_into({slot: kept[j][t] for j, slot in direct.items()}) if direct else None
             for t in range(length)]
    copied = [j for j in range(len(stacked)) if j not in direct]
    own = _OwnCarries(interp, ins, nc)

    def run(*args):
        carry, xs, consts = own.filled(list(args[:nc])), args[nc:nc + nx], list(args[nc + nx:])
        ys = kept if kept is not None else [xp.empty(shape, dtype) for shape, dtype in stacked]
        for t in order:
            outs = body.run(carry + [x[(t + s) % length] for x, s in zip(xs, shifts)] + consts, steps[t])
            carry = outs[:nc]
            for j in copied:
                ys[j][t] = outs[nc + j]
        return tuple(carry) + tuple(ys)
    return run


def _written_in_place(body, nc: int) -> dict:
    """``{j: slot}``: stacked result j computed in the buffer planned for ``slot``, so that instruction can
    write straight into the stacked array: the result's own instruction, or the first of a chain computed in
    place into it (a donated fusion: attention's scores, scaled, masked and exponentiated in one buffer; a
    gradient all-reduced in place: ``_in_place_root``). The buffer must be no other output's (nor a view's
    of it); the rest are copied after each iteration."""
    program = body.program
    slots = [o.slot for o in program.outputs]
    owners = buffer_owners(program)
    direct = {}
    for k, s in enumerate(slots):
        root = _in_place_root(program, s) if k >= nc and slots.count(s) == 1 else None
        if root in body.planned and not any(root in owners[o] for o in slots if o != s):
            direct[k - nc] = root
    return direct


def _in_place_root(program, slot: int):
    """The instruction whose result buffer ``slot``'s value is, the same shape and dtype, followed back through
    instructions computed into their donated operand (``donate``); None where a link of another shape, or a
    view, stands between."""
    ins = program.instrs[slot]
    while ins.donate >= 0:
        operand = program.instrs[ins.args[ins.donate]]
        if tuple(operand.shape) != tuple(ins.shape) or operand.dtype != ins.dtype:
            return None
        ins = operand
    return ins.out


class _OwnCarries:
    """The loop's own buffers for the carries its body writes in place (donated carries, partition/loops.py),
    filled with the initial values at the start of every run: the caller's arrays are never written. A carry
    whose initial value dies at the loop in a buffer the program owns alone is adopted instead (``adopt``,
    partition/partitioner.py): the body writes into that buffer, no copy. A buffer
    is made once and refilled every run when no program output can be that carry's final value (it dies
    within the run: a gradient accumulator); otherwise each run copies afresh (the caller keeps the output)."""

    def __init__(self, interp, ins, nc: int):
        adopted = set(ins.attrs.get("adopt", ()))  # initial values that die here: the loop runs in their buffers
        self.carries = sorted(k for k in ins.attrs["body"].written_inputs if k < nc and k not in adopted)
        self.reused = {k for k in self.carries if not _escapes(interp.program, ins, k.__eq__)}
        self.xp, self.buffers = interp.xp, {}

    def filled(self, carry: list) -> list:
        """``carry`` with each overwritten carry replaced by the loop's own buffer holding its value."""
        for k in self.carries:
            buffer = self.buffers.get(k)
            if buffer is None:
                buffer = self.xp.array(carry[k], copy=True)
                if k in self.reused:
                    self.buffers[k] = buffer
            else:
                self.xp.copyto(buffer, carry[k])
            carry[k] = buffer
        return carry


def bind_while(interp, ins):
    a = ins.attrs
    cond, body, n, n_cond = _bound(interp, a["cond"]), _bound(interp, a["body"]), a["num_carry"], a["captures"][0]
    own = _OwnCarries(interp, ins, n)

    def run(*args):
        carry, cond_caps, body_caps = own.filled(list(args[:n])), list(args[n:n + n_cond]), list(args[n + n_cond:])
        while bool(cond.run(carry + cond_caps)[0]):  # replicated: every rank takes the same branch
            carry = body.run(carry + body_caps)
        return tuple(carry)
    return run


def bind_cond(interp, ins):
    a = ins.attrs
    branches, n, caps = [_bound(interp, p) for p in a["branches"]], a["num_operands"], a["captures"]

    def run(pred, *args):
        which = int(bool(pred))  # replicated: every rank runs the same branch
        start = n + (caps[0] if which else 0)
        return tuple(branches[which].run(list(args[:n]) + list(args[start:start + caps[which]])))
    return run


def _escapes(program, ins, which=None) -> bool:
    """Whether a program output may be (or view) one of the results of control instruction ``ins`` whose index
    ``which`` accepts (default: a scan's stacked results)."""
    which = which or (lambda k: k >= ins.attrs["num_carry"])
    return may_reach_outputs(program, [i.out for i in program.instrs
                                       if i.op == LOOP_OUT.name and i.args[0] == ins.out and which(i.attrs["index"])])


def bind_region(interp, ins):
    """A shard_map region: its body runs once per call on this rank's blocks."""
    body = _bound(interp, ins.attrs["body"])
    return lambda *args: tuple(body.run(list(args)))
