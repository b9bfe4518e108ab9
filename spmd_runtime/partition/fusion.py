"""Loop fusion: chains of elementwise ops become one ``fusion`` instruction (XLA's loop fusion), and a
reduction over the trailing dims of a chain only it reads one ``fused_reduce``.

Runs once after partitioning. Walking the program backwards, every elementwise
instruction not yet taken roots a group and absorbs each elementwise producer of
the same shape whose users all lie inside the group and that is no program
output: the producer's buffer then never exists. A cheap producer (no
transcendental, no division: ``OpDef.cheap``) read by several elementwise consumers is
instead computed again inside each consumer's group (XLA duplicates such producers
into every consumer fusion), so its buffer need not exist either: GELU's ``0.5 * x``
and ``1 + tanh(...)``, read by the forward and by the backward, cost no pass of
their own. Scalar constants and
``broadcast_in_dim`` operands (dims in order) are inlined as the leaves they
are: a constant becomes a typed literal, a broadcast operand a parameter seen
through a reshape that NumPy/numexpr/CUDA broadcasting expands. Instructions
left without users by that are dropped and slots renumbered; the partitioner then
recomputes frees and in-place donations (``partitioner.fused_program``).

A fusion's ``code`` is straight-line SSA over parameters ``p<i>`` (the
instruction's operands, in order), literals ``c<i>`` (``consts``: (value, dtype) pairs) and earlier
steps ``t<i>``; the last step is the result, and ``dtypes`` gives each step's
dtype. ``exec/fused.py`` runs it as one kernel.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache

import numpy as np

from ..opdef import lookup
from ..ops.core import BROADCAST_IN_DIM, CONSTANT, CONVERT, MUL, PARAMETER, REDUCE, SELECT
from ..ops.einsum import EINSUM
from ..ops.spmd import FUSED_REDUCE, FUSION  # noqa: F401  (also re-exported: the records of this pass)
from ..program import IOSpec, Instr, SPMDProgram

FUSE_ENV = "SPMD_FUSE"
REDUCIBLE = ("sum", "max", "min")
# Recomputed in every consumer's fusion rather than stored: cheaper than the memory pass that stores and
# rereads them (XLA's InstructionFusion duplicates all but its "expensive" ops: exp, log, tanh, divide, ...).
DUPLICATE_ENV = "SPMD_FUSE_DUPLICATE"
MAX_DUPLICATES = 16  # cheap producers recomputed per group: bounds the work a long shared chain can add


@lru_cache(maxsize=None)  # per op name: a record's ufunc is fixed when it is defined
def fusible(op: str) -> bool:
    """Computed pointwise, same shape in and out: the ufunc ops, select and convert."""
    return lookup(op).ufunc is not None or op in (SELECT.name, CONVERT.name)


def pointwise(ins: Instr, instrs) -> str | None:
    """The op ``ins`` computes element by element at its own shape, or None: its own for the ufunc ops, select
    and convert; ``mul`` for a broadcast product (``product_operands``)."""
    if fusible(ins.op):
        return ins.op
    return MUL.name if product_operands(ins, instrs) is not None else None


def product_operands(ins: Instr, instrs) -> tuple | None:
    """For an einsum that sums nothing and reads each operand's letters in the output's order (LayerNorm's
    gain and bias in models/lm.py, einsums so that their gradients partition as contractions): each operand's
    shape spread over the output's dims (1 where its letters lack one), so that the einsum is a broadcasting
    multiply. None for any other instruction, and for operands of another dtype (no rounding changes)."""
    letters = _product_letters(ins.attrs["spec"]) if ins.op == EINSUM.name else None
    if letters is None or ins.dtype not in ("float32", "float64") or any(instrs[a].dtype != ins.dtype
                                                                          for a in ins.args):
        return None
    return tuple(tuple(n if keep else 1 for n, keep in zip(ins.shape, mask)) for mask in letters)


@lru_cache(maxsize=None)
def _product_letters(spec: str) -> tuple | None:
    """Per operand, which output letters it has, when ``spec`` is a product: two operands, no letter summed or
    repeated, each operand's letters in the output's order. Else None."""
    terms, out = spec.split("->")[0].split(","), spec.split("->")[1]
    if len(terms) != 2 or "." in spec or len(set(out)) != len(out) or set(out) != set("".join(terms)):
        return None
    for term in terms:
        where = [out.find(c) for c in term]
        if len(set(term)) != len(term) or -1 in where or where != sorted(where):
            return None
    return tuple(tuple(c in term for c in out) for term in terms)


def fusion_enabled(fuse: bool | None) -> bool:
    """``fuse`` itself, or for None whether ``$SPMD_FUSE`` allows fusion (anything but 0; default on)."""
    return os.environ.get(FUSE_ENV, "1") != "0" if fuse is None else bool(fuse)
STEP = re.compile(r"t(\d+)=(\w+)\(([^)]*)\)")


def duplicate_enabled() -> bool:
    """Whether cheap producers of several chains are recomputed in each (``$SPMD_FUSE_DUPLICATE``: anything but 0;
    default on)."""
    return os.environ.get(DUPLICATE_ENV, "1") != "0"


def fuse_elementwise(program: SPMDProgram):
    """``(instrs, inputs, outputs)`` of ``program`` with elementwise chains fused, slots renumbered; frees and
    donations left for the partitioner to recompute. None when nothing fuses."""
    instrs = program.instrs
    walk = _Walk(instrs, [pointwise(i, instrs) for i in instrs], {o.slot for o in program.outputs},
                 duplicate_enabled())
    fused: dict[int, Instr] = {}
    for ins in reversed(instrs):
        if walk.ops[ins.out] and ins.out not in walk.taken:
            members, copies = _group(walk, ins)
            fusion = _fusion(ins, members | copies, instrs)
            if fusion is not None:
                walk.taken |= members
                fused[ins.out] = fusion
    kept = [fused.get(i.out, i) for i in instrs if i.out not in walk.taken or i.out in fused]
    reduced = _fuse_reductions(kept, walk.users, walk.outputs, instrs)
    if not fused and not reduced:
        return None
    return _rebuild(program, kept)


def row_reduction(ins: Instr, operand: Instr) -> bool:
    """Whether ``ins`` is a float sum/max/min over the trailing dims (C order: rows) of ``operand``, of its
    dtype: what a ``fused_reduce`` (and a compiled row loop, exec/fused.py) computes."""
    if ins.op != REDUCE.name or ins.attrs["kind"] not in REDUCIBLE or ins.dtype not in ("float32", "float64"):
        return False
    axes, rank = sorted(ins.attrs["axes"]), len(operand.shape)
    return bool(axes) and axes == list(range(rank - len(axes), rank)) and operand.dtype == ins.dtype


def _fuse_reductions(kept: list[Instr], users, outputs, instrs) -> int:
    """Each row reduction (``row_reduction``) whose operand (a fusion, or one elementwise op) only it reads
    and that is no program output becomes a ``fused_reduce`` of that chain, in place in ``kept`` (the chain is
    left unread: dropped by the rebuild). Returns how many."""
    by_slot, count = {i.out: i for i in kept}, 0
    for k, ins in enumerate(kept):
        src = by_slot.get(ins.args[0]) if ins.op == REDUCE.name else None
        if (src is None or not row_reduction(ins, src) or src.out in outputs or users[src.out] != [ins.out]
                or 0 in src.shape):
            continue
        chain = src if src.op == FUSION.name else _fusion(src, {src.out}, instrs, single=True) \
            if pointwise(src, instrs) else None
        if chain is None:
            continue
        kept[k] = ins.copy(op=FUSED_REDUCE.name, args=chain.args, attrs={**chain.attrs, "chain_shape": tuple(src.shape),
                                                                        "kind": ins.attrs["kind"],
                                                                        "axes": tuple(ins.attrs["axes"])})
        count += 1
    return count


def parse_code(code: str) -> list[tuple[str, list[str]]]:
    """``[(op, [operand refs])]`` of a fusion's ``code``, in order."""
    steps = []
    for k, text in enumerate(code.split("; ")):
        m = STEP.fullmatch(text)
        if m is None or int(m.group(1)) != k:
            raise ValueError(f"a fusion step reads 't{k}=op(refs)'; got {text!r} in {code!r}")
        steps.append((m.group(2), m.group(3).split(",")))
    return steps


class _Walk:
    """What the fusion walk knows of the program (slots are positions in ``instrs``): per slot the op it
    computes pointwise or None (``ops``), its readers (``users``), the program's outputs, the members of groups
    formed so far (``taken``) and the values copied producers read (``pinned``: they stay stored)."""

    def __init__(self, instrs, ops: list, outputs: set, duplicate: bool):
        self.instrs, self.ops, self.outputs, self.duplicate = instrs, ops, outputs, duplicate
        self.users: dict[int, list[int]] = {}
        for ins in instrs:
            for a in ins.args:
                self.users.setdefault(a, []).append(ins.out)
        self.taken: set[int] = set()
        self.pinned: set[int] = set()


def _group(walk: _Walk, root: Instr) -> tuple[set[int], set[int]]:
    """``root`` and every producer that may join it, and the cheap producers read elsewhere too that it
    computes again (``_duplicates``). A producer joins once all its users are members, i.e. when its last
    user joins: so each new member's operands are the only ones to (re)consider."""
    instrs, members, todo = walk.instrs, {root.out}, [root.out]
    while todo:
        for a in instrs[todo.pop()].args:
            if (a not in members and a not in walk.taken and a not in walk.outputs and a not in walk.pinned
                    and walk.ops[a] and instrs[a].shape == root.shape and all(u in members for u in walk.users[a])):
                members.add(a)
                todo.append(a)
    return members, (_duplicates(walk, root, members) if walk.duplicate else set())


def _duplicates(walk: _Walk, root: Instr, members: set[int]) -> set[int]:
    """Cheap producers of ``members`` (and theirs) that every reader consumes pointwise at the root's
    shape: each such reader's group computes its own copy, so the producer's buffer is never stored. They are
    not taken (the other readers' groups copy them too); what nothing reads any more is dropped by the
    rebuild. A copy's operands that are not copied too are read by every group holding it: they are
    ``pinned``, never absorbed into a group of their own readers."""
    instrs, copies, todo = walk.instrs, set(), list(members)
    while todo and len(copies) < MAX_DUPLICATES:
        for a in instrs[todo.pop()].args:
            if (a in members or a in copies or a in walk.taken or a in walk.outputs or a in walk.pinned
                    or not (walk.ops[a] and lookup(walk.ops[a]).cheap) or instrs[a].shape != root.shape
                    or not all(walk.ops[u] and instrs[u].shape == instrs[a].shape for u in walk.users[a])):
                continue
            copies.add(a)
            todo.append(a)
    walk.pinned.update(a for c in copies for a in instrs[c].args if a not in members and a not in copies)
    return copies


def _fusion(root: Instr, members: set[int], instrs, single: bool = False) -> Instr | None:
    """The fused instruction for ``members`` (rooted at ``root``), or None when fusing would save nothing
    (unless ``single``: one op as a chain, for a reduction to absorb)."""
    params: list[int] = []
    shapes: list[tuple] = []
    consts: list = []
    literal: dict[tuple, str] = {}
    refs: dict[int, str] = {}
    steps: list[str] = []
    dtypes: list[str] = []
    leaves = 0

    def ref(slot: int, spread: tuple | None = None) -> str:
        """The step, literal or parameter that gives ``slot``; ``spread``: its shape seen at the fusion's
        rank (a broadcast product's operand)."""
        nonlocal leaves
        if slot in refs:
            return refs[slot]
        src = instrs[slot]
        value = _scalar_constant(src, instrs)
        if value is not None:
            leaves += 1
            key = (repr(value), src.dtype)  # one literal per value; by repr, as -0.0 == 0.0
            if key not in literal:
                literal[key] = f"c{len(consts)}"
                consts.append((value, src.dtype))
            return literal[key]
        shape = src.shape if spread is None else spread
        if spread is None and src.op == BROADCAST_IN_DIM.name and list(src.attrs["dims"]) == sorted(src.attrs["dims"]):
            slot, shape, leaves = src.args[0], _expanded(src, instrs), leaves + 1
        key = (slot, shape)
        if key not in params_index:
            params.append(slot)
            shapes.append(shape)
            params_index[key] = f"p{len(params) - 1}"
        return params_index[key]

    params_index: dict = {}
    computed: dict[tuple, str] = {}  # one step per distinct (op, operands, dtype): the program may repeat one
    for slot in sorted(members):
        ins = instrs[slot]
        op, spread = pointwise(ins, instrs), product_operands(ins, instrs) or (None,) * len(ins.args)
        operands = ",".join(ref(a, s) for a, s in zip(ins.args, spread))
        key = (op, operands, ins.dtype)
        if key in computed and slot != root.out:  # the root stays the last step
            refs[slot] = computed[key]
            continue
        refs[slot] = computed[key] = f"t{len(steps)}"
        steps.append(f"{refs[slot]}={op}({operands})")
        dtypes.append(ins.dtype)
    if len(steps) < 2 and not leaves and not single:
        return None
    if _broadcast_shape(shapes) != tuple(root.shape):  # absorbed broadcasts would leave the result smaller
        return None  # than the instruction (program_check's fusion rule; the generic chain returns the chain's)
    attrs = {"code": "; ".join(steps), "consts": tuple(consts), "dtypes": tuple(dtypes),
             "shapes": tuple(tuple(s) for s in shapes)}
    return root.copy(op=FUSION.name, args=tuple(params), attrs=attrs, free=(), donate=-1)


def _scalar_constant(src: Instr, instrs):
    """A constant's value (or a broadcast one's) as a typed NumPy scalar, else None."""
    if src.op == BROADCAST_IN_DIM.name:
        inner = instrs[src.args[0]]
        return _scalar_constant(inner, instrs) if inner.dtype == src.dtype else None
    if src.op == CONSTANT.name and np.ndim(src.attrs["value"]) == 0:
        return np.dtype(src.dtype).type(np.asarray(src.attrs["value"]).item()).item()
    return None


def _expanded(bcast: Instr, instrs) -> tuple:
    """The shape a broadcast operand is reshaped to so that array broadcasting gives ``bcast.shape``."""
    shape = [1] * len(bcast.shape)
    for i, d in enumerate(bcast.attrs["dims"]):
        shape[d] = instrs[bcast.args[0]].shape[i]
    return tuple(shape)


def _rebuild(program: SPMDProgram, kept: list[Instr]):
    """Drop instructions nothing uses any more and renumber slots densely."""
    by_slot = {i.out: i for i in kept}
    live, stack = set(), [o.slot for o in program.outputs] + [i.out for i in kept if i.op == PARAMETER.name]
    while stack:
        s = stack.pop()
        if s not in live:
            live.add(s)
            stack += by_slot[s].args
    order = [i for i in kept if i.out in live]
    new = {i.out: k for k, i in enumerate(order)}
    instrs = [i.renumbered(new) for i in order]
    inputs = [i.at(new[i.slot]) for i in program.inputs]
    outputs: list[IOSpec] = [o.at(new[o.slot]) for o in program.outputs]
    return instrs, inputs, outputs


def _broadcast_shape(shapes) -> tuple | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None
