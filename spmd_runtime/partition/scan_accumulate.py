"""A scan's stacked result added into an accumulator is accumulated by the scan itself, in place.

The backward pass of scanned layers returns each layer's gradient as a stacked result ``ys`` [L, ...] of its
reverse scan; gradient accumulation then adds it to an accumulator of the same shape (``acc + ys``). Both are
whole-model sized and both are live while the scan runs: 2 bytes per parameter more than Megatron's one
gradient buffer. When the accumulator dies at that add (its buffer is the add's to overwrite: ``Instr.donate``)
and the stacked result is read by nothing else, the accumulator becomes a carry of the scan instead, and the
body adds each iteration's slice into it: ``acc = dynamic_update_slice(acc, acc[t] + y_t, t)``, written in place
(the carry donated in the body, the scan adopting the dying accumulator: ``Instr.attrs["adopt"]``,
partitioner.py). One buffer instead of two; each element is the same single addition, so the numerics do not
change. The iteration index ``t`` comes in as one more ``xs``: a constant ``arange(L)``.

Run on a program whose frees and donations are assigned (``accumulate_in_scans``); the bodies of its scans are
already partitioned and get their own rewrite where the program they are in is finished.
"""
from __future__ import annotations

import numpy as np

from ..ops.control import LOOP_OUT, SCAN
from ..ops.core import ADD, CONSTANT, PARAMETER, RESHAPE
from ..ops.slicing import DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE
from ..program import IOSpec, Instr, SPMDProgram
from ..sharding import Sharding

INDEX = "int32"  # the iteration index's dtype


def accumulate_in_scans(program: SPMDProgram, assign) -> SPMDProgram:
    """``program`` with each ``add(acc!, ys)`` of a scan's stacked result into a dying accumulator folded into
    that scan (module docstring); ``assign(instrs, keep)``: the frees-and-donations pass, rerun on what changed.
    The program itself when nothing matches."""
    found = _matches(program)
    if not found:
        return program
    instrs = list(program.instrs)
    for scan_slot, adds in found.items():
        scan = instrs[scan_slot]
        body = _accumulating_body(scan, [(j, instrs[acc]) for j, acc, _ in adds], assign)
        nc, nx = scan.attrs["num_carry"], scan.attrs["num_xs"]
        counter = Instr(CONSTANT.name, -1, (), {"value": np.arange(scan.attrs["length"], dtype=INDEX)},
                        (scan.attrs["length"],), INDEX, Sharding(((),)), (scan.attrs["length"],))
        attrs = {**scan.attrs, "body": body, "num_carry": nc + len(adds), "num_xs": nx + 1}
        if scan.attrs.get("shifts"):
            attrs["shifts"] = tuple(scan.attrs["shifts"]) + (0,)
        args = scan.args[:nc] + tuple(acc for _, acc, _ in adds) + scan.args[nc:nc + nx] + (counter,) + \
            scan.args[nc + nx:]
        instrs[scan_slot] = scan.copy(args=args, attrs=attrs)
        old = [j for j in range(nc, len(scan.attrs["body"].outputs)) if j not in {j for j, _, _ in adds}]
        where = {j: j for j in range(nc)} | {j: nc + len(adds) + k for k, j in enumerate(old)} | \
            {j: nc + i for i, (j, _, _) in enumerate(adds)}
        for k, ins in enumerate(instrs):
            if isinstance(ins, Instr) and ins.op == LOOP_OUT.name and ins.args[0] == scan_slot:
                instrs[k] = ins.copy(attrs={"index": where[ins.attrs["index"]]})
        for i, (j, acc, add) in enumerate(adds):
            y = program.instrs[add].args[1 - program.instrs[add].donate]
            instrs[y] = None  # the stacked result's loop_out: the accumulated carry replaces it
            instrs[add] = program.instrs[add].copy(op=LOOP_OUT.name, args=(scan_slot,), attrs={"index": nc + i})
    return _renumbered(program, instrs, assign)


def _matches(program: SPMDProgram) -> dict:
    """``{scan slot: [(stacked result position j, accumulator slot, add slot), ...]}`` for each ``add`` of a
    scan's stacked result (read there only) into an accumulator of its shape that dies there, written in place,
    and read by nothing after the scan but that add."""
    instrs = program.instrs
    uses: dict[int, list[int]] = {}
    for ins in instrs:
        for a in ins.args:
            uses.setdefault(a, []).append(ins.out)
    outputs = {o.slot for o in program.outputs}
    found: dict[int, list] = {}
    for ins in instrs:
        if ins.op != ADD.name or ins.donate < 0 or ins.args[0] == ins.args[1]:
            continue
        acc, y = ins.args[ins.donate], ins.args[1 - ins.donate]
        out = instrs[y]
        if out.op != LOOP_OUT.name or uses[y] != [ins.out] or y in outputs:
            continue
        scan = instrs[out.args[0]]
        j = out.attrs["index"]
        if scan.op != SCAN.name or j < scan.attrs["num_carry"] or instrs[acc].shape != out.shape \
                or instrs[acc].dtype != out.dtype or acc in scan.args:
            continue
        if any(scan.out < u < ins.out for u in uses[acc] if u != ins.out) or acc > scan.out:
            continue  # read between the loop and the add, or made after the loop
        found.setdefault(scan.out, []).append((j, acc, ins.out))
    return found


def _accumulating_body(scan: Instr, accs: list, assign) -> SPMDProgram:
    """The body of ``scan`` with one carry per ``(j, accumulator)`` in ``accs`` (after the old carries), to which
    each iteration adds its stacked result j at the iteration's row (an ``xs`` index, after the old xs), right
    where that result is made (so it dies there); the results j no longer stacked."""
    body, a = scan.attrs["body"], scan.attrs
    nc, nx, k = a["num_carry"], a["num_xs"], len(accs)
    made: list[Instr] = []  # new instructions, keyed by negative slots until renumbered

    def emit(op, args, attrs, like, local=None, whole=None) -> Instr:
        made.append(Instr(op, -1 - len(made), tuple(args), attrs, like.shape if local is None else local, like.dtype,
                          like.sharding, like.global_shape if whole is None else whole))
        return made[-1]
    index = emit(PARAMETER.name, (), {"index": nc + k + nx}, Instr("", 0, (), {}, (), INDEX, Sharding(()), ()))
    zero = emit(CONSTANT.name, (), {"value": np.zeros((), np.int64)}, Instr("", 0, (), {}, (), "int64", Sharding(()), ()))
    heads = list(made)  # before every old instruction
    after: dict[int, list[Instr]] = {}  # old slot -> the accumulation of the stacked result it makes
    new_inputs, new_outputs = [], []
    for i, (j, acc) in enumerate(accs):
        first = len(made)
        carry = emit(PARAMETER.name, (), {"index": nc + i, "donated": True}, acc)
        heads.append(carry)
        y = body.instrs[body.outputs[j].slot]
        starts = [index.out] + [zero.out] * (len(acc.shape) - 1)
        one = ((1,) + acc.shape[1:], (1,) + acc.global_shape[1:])  # a row: local, global shape
        row = emit(DYNAMIC_SLICE.name, [carry.out] + starts, {"sizes": one[0]}, carry, *one)
        flat = emit(RESHAPE.name, [row.out], {"shape": y.shape}, y)
        total = emit(ADD.name, [y.out, flat.out], {}, y)  # written into y, which dies here
        new = emit(DYNAMIC_UPDATE_SLICE.name, [carry.out, emit(RESHAPE.name, [total.out], {"shape": one[0]}, row,
                                                               *one).out] + starts, {}, carry)
        after.setdefault(y.out, []).extend(made[first + 1:])
        new_inputs.append(IOSpec(f"acc{i}", carry.out, acc.global_shape, str(acc.dtype), acc.sharding))
        new_outputs.append(IOSpec(f"acc{i}", new.out, acc.global_shape, str(acc.dtype), acc.sharding))
    order = list(heads)
    for ins in body.instrs:
        order.append(ins.copy(attrs={**ins.attrs, "index": _moved(ins.attrs["index"], nc, nx, k)})
                     if ins.op == PARAMETER.name else ins)
        order += after.get(ins.out, [])
    slot = {ins.out: n for n, ins in enumerate(order)}
    instrs = [ins.copy(out=n, args=tuple(slot[x] for x in ins.args), free=(), donate=-1) for n, ins in enumerate(order)]
    stacked = {j for j, _ in accs}
    inputs = body.inputs[:nc] + new_inputs + body.inputs[nc:nc + nx] + \
        [IOSpec("t", index.out, (), INDEX, Sharding(()))] + body.inputs[nc + nx:]
    outputs = body.outputs[:nc] + new_outputs + [o for j, o in enumerate(body.outputs) if j >= nc and j not in stacked]
    inputs, outputs = [io.at(slot[io.slot]) for io in inputs], [io.at(slot[io.slot]) for io in outputs]
    assign(instrs, {o.slot for o in outputs})
    return SPMDProgram(body.mesh, instrs, inputs, outputs, list(body.notes), body.report, None, None,
                       {slot[s]: n for s, n in body.names.items()})


def _moved(index: int, nc: int, nx: int, k: int) -> int:
    """A body input's new position: carries stay, the old xs move past the k new carries, the invariants past
    those and the iteration index."""
    return index if index < nc else index + k if index < nc + nx else index + k + 1


def _renumbered(program: SPMDProgram, instrs: list, assign) -> SPMDProgram:
    """``instrs`` (None: dropped; an ``Instr`` with out -1: new, placed before its first reader) with slots made
    positions again, frees and donations redone."""
    order: list[Instr] = []
    new: dict[int, int] = {}
    for ins in instrs:
        if ins is None:
            continue
        for a in ins.args:
            if isinstance(a, Instr):  # a new operand (the iteration index): before its reader
                new[id(a)] = len(order)
                order.append(a.copy(out=len(order)))
        args = tuple(new[id(a)] if isinstance(a, Instr) else new[a] for a in ins.args)
        new[ins.out] = len(order)
        order.append(ins.copy(out=len(order), args=args, free=(), donate=-1))
    assign(order, {new[o.slot] for o in program.outputs})
    return SPMDProgram(program.mesh, order, [io.at(new[io.slot]) for io in program.inputs],
                       [io.at(new[io.slot]) for io in program.outputs], list(program.notes), program.report,
                       program.in_tree, program.out_tree,
                       {new[s]: n for s, n in program.names.items() if s in new})
