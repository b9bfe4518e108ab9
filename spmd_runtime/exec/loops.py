"""Running control instructions: each body is an SPMD program of its own, bound ONCE per rank (its own
Interpreter) and run as many times as the loop goes round. A control instruction's value is the tuple
of its results, read by ``loop_out`` instructions."""
from __future__ import annotations

from .interpreter import Interpreter


def _bound(interp, program):
    return Interpreter(program, interp.mc, interp.xp)


def bind_scan(interp, ins):
    a, xp, mesh = ins.attrs, interp.xp, interp.program.mesh
    body, length, nc, nx = _bound(interp, a["body"]), a["length"], a["num_carry"], a["num_xs"]
    stacked = [((length,) + o.sharding.local_shape(o.shape, mesh), o.dtype) for o in a["body"].outputs[nc:]]
    order = range(length - 1, -1, -1) if a["reverse"] else range(length)

    def run(*args):
        carry, xs, consts = list(args[:nc]), args[nc:nc + nx], list(args[nc + nx:])
        ys = [xp.empty(shape, dtype) for shape, dtype in stacked]
        for t in order:
            outs = body.run(carry + [x[t] for x in xs] + consts)
            carry = outs[:nc]
            for y, o in zip(ys, outs[nc:]):
                y[t] = o
        return tuple(carry) + tuple(ys)
    return run


def bind_while(interp, ins):
    a = ins.attrs
    cond, body, n, n_cond = _bound(interp, a["cond"]), _bound(interp, a["body"]), a["num_carry"], a["captures"][0]

    def run(*args):
        carry, cond_caps, body_caps = list(args[:n]), list(args[n:n + n_cond]), list(args[n + n_cond:])
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


LOOP_BINDERS = {"scan": bind_scan, "while": bind_while, "cond": bind_cond}


def bind_region(interp, ins):
    """A shard_map region: its body runs once per call on this rank's blocks."""
    body = _bound(interp, ins.attrs["body"])
    return lambda *args: tuple(body.run(list(args)))
