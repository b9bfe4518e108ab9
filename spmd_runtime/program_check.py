"""Validation of a loaded program against the op definitions, before anything runs.

The content hash of a program file is an integrity check (it catches accidental
edits and truncation), not authentication: anyone who can edit the file can
recompute it. So every instruction read from a file is checked here: the op is
one the interpreter runs (a kernel, a collective, or a rank-dependent op), its
attribute names are exactly the kernel's keyword parameters, and every value has
an allowed type and range; strings are only accepted from allow-lists (mesh axis
names, reduction kinds, dtypes, einsum specs), so no string from a file ever
selects a function by name. Slots must be defined before use. For shared
clusters, ``SPMD_PROGRAM_KEY`` adds a keyed HMAC (see ``program.py``).
"""
from __future__ import annotations

import functools
import inspect
import re

import numpy as np

from . import opdef
from .collective_kinds import BY_DONE, BY_START, KINDS
from .dtypes import LOW_PRECISION, dtype as parse_dtype
from .graph import PARAMETER
from .ops.core import CONVERT, REDUCE_KINDS, SELECT, reduction  # noqa: F401  (reduction: re-exported)
from .ops.spmd import FUSED_REDUCE, FUSION, MASK_PADDING, ROTATED_CONCAT, SHARD_INDEX, SHARD_SLICE

STRING_ATTRIBUTES = {"output": frozenset({"values", "indices"}),  # top_k: which of its two results
                     **{name: frozenset(allowed) for kind in KINDS.values() for name, allowed in kind.strings}}
BODY_ATTRIBUTES = ("body", "cond", "branches")  # control instructions (ops/control.py) hold programs
EINSUM_SPEC = re.compile(r"^[A-Za-z]*(,[A-Za-z]*)*->[A-Za-z]*$")
DTYPE_KINDS = "biufc"  # bool, ints, floats, complex: never object, string or void
# ops the interpreter binds itself (exec/interpreter.py): attribute names
INTERPRETER_OPS = {PARAMETER.name: {"index"}, SHARD_SLICE.name: {"dim", "axes"}, SHARD_INDEX.name: {"axes"},
                   ROTATED_CONCAT.name: {"dim", "axes"},
                   MASK_PADDING.name: {"dim", "axes", "size", "fill"},
                   FUSION.name: {"code", "consts", "dtypes", "shapes"},
                   FUSED_REDUCE.name: {"code", "consts", "dtypes", "shapes", "chain_shape", "kind", "axes"}}
INTERPRETER_OPTIONAL = {SHARD_SLICE.name: {"shift"}, PARAMETER.name: {"donated"}}
FUSION_STEP = re.compile(r"^t(\d+)=(\w+)\(((?:[pct]\d+)(?:,[pct]\d+)*)\)$")  # partition/fusion.py's code


class ProgramError(ValueError):
    """A program file that is not a valid program (tampered, or written by an incompatible version)."""


def check_program(program) -> None:
    """Raise ProgramError naming the first instruction, attribute or slot that breaks a rule."""
    defined: set[int] = set()
    for ins in program.instrs:
        where = f"instruction %{ins.out} = {ins.op}"
        try:
            _check_instr(ins, program, defined)
        except ProgramError as e:
            raise ProgramError(f"{where}: {e}") from None
        defined.add(ins.out)
    _check_async_pairs(program)
    params = {i.out for i in program.instrs if i.op == PARAMETER.name}
    for io in program.inputs:
        _dtype(io.dtype, f"input {io.name!r} dtype")
        if io.slot not in params:
            raise ProgramError(f"input {io.name!r} must name a parameter instruction; got slot %{io.slot}")
    for io in program.outputs:
        _dtype(io.dtype, f"output {io.name!r} dtype")
        if io.slot not in defined:
            raise ProgramError(f"output {io.name!r} must name a defined slot; got %{io.slot}")


def _check_instr(ins, program, defined: set) -> None:
    if not isinstance(ins.op, str):
        raise ProgramError(f"an op must be a string; got {ins.op!r}")
    required, optional = _attribute_names(ins.op, len(ins.args))
    if ins.out in defined:
        raise ProgramError(f"every instruction must define a new slot; got %{ins.out} twice")
    undefined = [a for a in ins.args if a not in defined]
    if undefined:
        raise ProgramError(f"operands must be defined before use; got undefined slot(s) {undefined}")
    if any(s not in defined and s != ins.out for s in ins.free):
        raise ProgramError(f"freed slots must be defined; got {list(ins.free)}")
    _dtype(ins.dtype, "dtype")
    _ints(ins.shape, "shape", low=0)
    _ints(ins.global_shape, "global_shape", low=0)
    if not isinstance(ins.donate, int) or not -1 <= ins.donate < len(ins.args):
        raise ProgramError(f"donate must be -1 or an operand position in [0, {len(ins.args)}); got {ins.donate!r}")
    got = set(ins.attrs)
    if not required <= got <= required | optional:
        raise ProgramError(f"attributes must be {sorted(required)}" + (f" (optional {sorted(optional)})" if optional
                           else "") + f"; got {sorted(got)}")
    for name, value in ins.attrs.items():
        _check_value(name, value, program)


def _async_half(op: str) -> str | None:
    """'start' / 'done' for the halves of a split collective (partition/schedule.py), else None."""
    return "start" if op in BY_START else "done" if op in BY_DONE else None


def _check_async_pairs(program) -> None:
    """Every ``<kind>_start`` is waited for by exactly one ``<kind>_done(%start, %operand)`` of its kind."""
    by_slot = {i.out: i for i in program.instrs}
    waited: set[int] = set()
    for ins in program.instrs:
        if _async_half(ins.op) != "done":
            continue
        start = by_slot.get(ins.args[0]) if len(ins.args) == 2 else None
        if start is None or BY_START.get(start.op) is not BY_DONE[ins.op] or start.args[0] != ins.args[1] \
                or start.out in waited:
            raise ProgramError(f"instruction %{ins.out} = {ins.op}: a done takes (its own start, the start's "
                               f"operand), each start waited for once; got operands {list(ins.args)}")
        waited.add(start.out)
        if ins.donate not in (-1, 1) or (ins.donate == 1 and not BY_START[start.op].in_place):
            raise ProgramError(f"instruction %{ins.out} = {ins.op}: only an all-reduce's done may donate, and only "
                               f"its operand (position 1); got donate={ins.donate}")
    unwaited = [i.out for i in program.instrs if _async_half(i.op) == "start" and i.out not in waited]
    if unwaited:
        raise ProgramError(f"every collective start must have its done; got none for slot(s) {unwaited}")


@functools.lru_cache(maxsize=None)
def _attribute_names(op: str, n_args: int) -> tuple[frozenset, frozenset]:
    """(required, optional) attribute names of ``op``: a collective's (or its start's) from its kind, else its
    kernel's keyword parameters."""
    if op in INTERPRETER_OPS:
        return frozenset(INTERPRETER_OPS[op]), frozenset(INTERPRETER_OPTIONAL.get(op, ()))
    if op in BY_DONE:
        return frozenset(), frozenset()
    kind = KINDS.get(op) or BY_START.get(op)
    if kind is not None:
        return frozenset(kind.attrs), frozenset(kind.optional)
    try:
        fn, skip = opdef.lookup(op).kernel, 1 + n_args  # (xp, *operands)
    except NotImplementedError:
        fn = None
    if fn is None:
        raise ProgramError(f"the op must be one the interpreter runs (a kernel or a collective); got {op!r}")
    params = list(inspect.signature(fn).parameters.values())
    star = [i for i, p in enumerate(params) if p.kind == p.VAR_POSITIONAL]
    attrs = params[star[0] + 1:] if star else params[skip:]  # (xp, *operands, attr, ...): keyword-only attrs
    return (frozenset(p.name for p in attrs if p.default is p.empty),
            frozenset(p.name for p in attrs if p.default is not p.empty))


def _check_value(name: str, value, program) -> None:
    what = f"attribute {name!r}"
    if name == "axes":
        items = value if isinstance(value, tuple) else None
        if items is None:
            raise ProgramError(f"{what} must be a tuple of mesh axis names or of dims; got {value!r}")
        if all(isinstance(a, str) for a in items):
            unknown = [a for a in items if a not in program.mesh.axis_names]
            if unknown or len(set(items)) != len(items):
                raise ProgramError(f"{what} must be distinct axes of {program.mesh}; got {items}")
        else:
            _ints(items, what)
    elif name == "kind":
        _one_of(value, REDUCE_KINDS, what)
    elif name in STRING_ATTRIBUTES:
        _one_of(value, STRING_ATTRIBUTES[name], what)
    elif name == "dtype":
        _dtype(value, what)
    elif name == "spec":
        if not isinstance(value, str) or not EINSUM_SPEC.match(value):
            raise ProgramError(f"{what} must be an einsum spec like 'ab,bc->ac'; got {value!r}")
    elif name == "value":
        if isinstance(value, np.ndarray):
            _dtype(value.dtype, f"{what} dtype")
        elif not isinstance(value, (bool, int, float, complex)):
            raise ProgramError(f"{what} must be an array or a number; got {type(value).__name__}")
    elif name in BODY_ATTRIBUTES:  # a loop's body, a while's cond, a cond's branches: programs, checked alike
        for body in value if isinstance(value, tuple) else (value,):
            if not hasattr(body, "instrs") or body.mesh != program.mesh:
                raise ProgramError(f"{what} must be a program on {program.mesh}; got {type(body).__name__}")
            check_program(body)
    elif name == "code":
        _fusion_code(value, what)
    elif name == "consts":
        if not isinstance(value, tuple) or not all(isinstance(c, tuple) and len(c) == 2 for c in value):
            raise ProgramError(f"{what} must be (number, dtype) pairs; got {value!r}")
        for number, dt in value:
            if not isinstance(number, (bool, int, float)):
                raise ProgramError(f"{what} values must be numbers; got {number!r}")
            _dtype(dt, what)
    elif name == "dtypes":
        if not isinstance(value, tuple):
            raise ProgramError(f"{what} must be a tuple of dtypes; got {value!r}")
        for dt in value:
            _dtype(dt, what)
    elif name == "pairs":
        if not isinstance(value, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in value):
            raise ProgramError(f"{what} must be (source, dest) rank pairs; got {value!r}")
        for p in value:
            _ints(p, what, low=0, high=program.mesh.size)
    else:
        _plain(value, what, program.mesh.axis_names)


def _fusion_code(value, what: str) -> None:
    """A fusion's steps: 't<k>=op(refs)', k counting from 0, ops from the pointwise allow-list, temps defined."""
    if not isinstance(value, str):
        raise ProgramError(f"{what} must be fusion steps 't0=op(p0,c0); ...'; got {value!r}")
    for k, text in enumerate(value.split("; ")):
        m = FUSION_STEP.match(text)
        op = m and m.group(2)
        pointwise = bool(m) and op in opdef.OPS and (opdef.OPS[op].ufunc is not None or op in (SELECT.name, CONVERT.name))
        if not pointwise or int(m.group(1)) != k or any(r[0] == "t" and int(r[1:]) >= k for r in m.group(3).split(",")):
            raise ProgramError(f"{what} steps must read 't<k>=op(refs)' with a pointwise op and earlier temps; got "
                               f"{text!r}")


def _plain(value, what: str, axis_names) -> None:
    """Numbers, None, mesh axis names, or tuples of them: anything else (another string, an array) needs a rule."""
    if value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and value in axis_names):
        return
    if isinstance(value, tuple):
        for v in value:
            _plain(v, what, axis_names)
        return
    raise ProgramError(f"{what} must be numbers, mesh axis names {list(axis_names)} or tuples of them; got "
                       f"{type(value).__name__} {value!r}")


def _ints(values, what: str, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(values, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ProgramError(f"{what} must be a tuple of ints; got {values!r}")
    if any((low is not None and v < low) or (high is not None and v >= high) for v in values):
        raise ProgramError(f"{what} must be in [{low}, {high if high is not None else 'inf'}); got {values}")


def _one_of(value, allowed, what: str) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ProgramError(f"{what} must be one of {sorted(allowed)}; got {value!r}")


def _dtype(value, what: str) -> None:
    try:
        dtype = parse_dtype(value)
    except (TypeError, ValueError) as e:
        raise ProgramError(f"{what} must be a numeric dtype; got {value!r} ({e})") from None
    if dtype.kind not in DTYPE_KINDS and dtype not in LOW_PRECISION:
        raise ProgramError(f"{what} must be a numeric dtype (bool, int, float incl. bfloat16, complex); got {dtype}")


__all__ = ["check_program", "ProgramError", "REDUCE_KINDS", "reduction"]
