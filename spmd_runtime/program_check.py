"""Validation of a loaded program against the op definitions, before anything runs.

The content hash of a program file is an integrity check (it catches accidental
edits and truncation), not authentication: anyone who can edit the file can
recompute it. So every instruction read from a file is checked here: the op is
one the interpreter runs (a kernel, a collective, or a rank-dependent op), its
attribute names are exactly the kernel's keyword parameters, and every value has
an allowed type and range; strings are only accepted from allow-lists (mesh axis
names, reduction kinds, dtypes, einsum specs), so no string from a file ever
selects a function by name. Slots must be defined before use. Every
instruction's local shape and dtype must be what its op's rule derives from its
operands (``RESULT_RULES`` and the kinds table: see "result shapes" below), and
a donation must be of the result's exact buffer, so a file that loads cannot
make the runtime write out of bounds, key or no key. For shared clusters,
``SPMD_PROGRAM_KEY`` adds a keyed HMAC (authenticity; see ``program.py``).
"""
from __future__ import annotations

import functools
import inspect
import re

import numpy as np

from . import opdef
from .collective_kinds import BY_DONE, BY_START, KINDS, WORLD
from .cost import group_size
from .dtypes import LOW_PRECISION, dtype as parse_dtype
from .graph import PARAMETER
from .ops.decompositions import ROUTINES as MATRIX_ROUTINES
from .ops.fft import ONE_D as FFT_ONE_D, N_D as FFT_N_D
from .ops.core import (BROADCAST_IN_DIM, CONSTANT, CONVERT, REDUCE, REDUCE_KINDS, RESHAPE, SELECT, STOP_GRADIENT,
                       TRANSPOSE, reduction)  # noqa: F401  (reduction: re-exported)
from .ops.einsum import EINSUM
from .ops.gather import SCATTER_KINDS
from .ops.slicing import CONCATENATE, DYNAMIC_UPDATE_SLICE, REVERSE, SLICE
from .ops.spmd import RESIZE
from .ops.windows import WINDOW_EDGE
from .ops.spmd import FUSED_REDUCE, FUSION, MASK_PADDING, ROTATED_CONCAT, SHARD_INDEX, SHARD_SLICE

STRING_ATTRIBUTES = {"output": frozenset({"values", "indices"}),  # top_k: which of its two results
                     "combine": frozenset(SCATTER_KINDS), "mode": frozenset({"clip", "wrap", "reduced", "complete"}),
                     # scatter, take; qr's: which Q and R
                     "fn": frozenset(MATRIX_ROUTINES) | frozenset(FFT_ONE_D) | frozenset(FFT_N_D),  # linalg, fft
                     "norm": frozenset({"backward", "ortho", "forward"}),  # fft's scaling
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
    by_slot: dict = {}
    freed: set[int] = set()
    starts: set[int] = set()
    for ins in program.instrs:
        where = f"instruction %{ins.out} = {ins.op}"
        try:
            _check_instr(ins, program, defined)
            _check_live(ins, freed)
            _check_handles(ins, starts)
            _check_result(ins, program, by_slot)
        except ProgramError as e:
            raise ProgramError(f"{where}: {e}") from None
        defined.add(ins.out)
        by_slot[ins.out] = ins
        freed.update(ins.free)
        if _async_half(ins.op) == "start":
            starts.add(ins.out)
    _check_async_pairs(program)
    params = {i.out for i in program.instrs if i.op == PARAMETER.name}
    for io in program.inputs:
        _dtype(io.dtype, f"input {io.name!r} dtype")
        if io.slot not in params:
            raise ProgramError(f"input {io.name!r} must name a parameter instruction; got slot %{io.slot}")
    for io in program.outputs:
        _dtype(io.dtype, f"output {io.name!r} dtype")
        if io.slot not in defined or io.slot in freed:
            raise ProgramError(f"output {io.name!r} must name a defined slot not freed; got %{io.slot}")


def _check_handles(ins, starts: set) -> None:
    """A collective start's value is an MPI request handle, not an array: only its done (first operand) takes it."""
    if any(a in starts for a in (ins.args[1:] if _async_half(ins.op) == "done" else ins.args)):
        raise ProgramError(f"a collective start's value is taken only by its done (first operand); got operands "
                           f"{list(ins.args)}")


def _check_live(ins, freed: set) -> None:
    """An operand is read, and a slot freed, only while its buffer is held: not after an earlier instruction
    freed it."""
    gone = [a for a in ins.args if a in freed]
    if gone:
        raise ProgramError(f"operands must not have been freed by an earlier instruction; got slot(s) {gone}")
    again = [s for s in ins.free if s in freed]
    if again or len(set(ins.free)) != len(ins.free):
        raise ProgramError(f"a slot is freed once; got {list(ins.free)} (freed before: {again})")


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
            if not isinstance(number, (bool, int, float, complex)):
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
    if value is None or isinstance(value, (bool, int, float, complex)) or (isinstance(value, str) and value in axis_names):
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


# ------------------------------------------------------------------------------------------- result shapes
# Every instruction's local result shape and dtype follows from its operands' and its attributes by its op's
# rule (below): a file that names another shape is refused, so every shape the runtime sizes a buffer by (a
# planned or donated buffer, a compiled loop's bounds, an MPI receive buffer, a persistent request) is the
# shape the instruction's kernel makes. An op without a rule here (``derives``) keeps the shape its file
# says; what reads such a result where sizes matter checks it at bind or per call (``exec/rules/spmd.py``:
# a collective's operand; ``exec/backends/numpy_c.py``: a compiled loop's operands), and it may not donate.


def derives(op: str) -> bool:
    """Whether the check derives ``op``'s result shape and dtype (else the file's are taken as they are)."""
    return op in RESULT_RULES or op in KINDS or op in BY_START or op in BY_DONE or op in UFUNC_OPS


def _check_result(ins, program, by_slot) -> None:
    """The instruction's shape and dtype are its op's rule applied to its operands (``RESULT_RULES``), and a
    donated operand's buffer is exactly the result's (same shape and dtype): the result is written into it."""
    operands = [by_slot[a] for a in ins.args]
    rule = _rule(ins.op)
    if rule is not None:
        shape, dtype = rule(ins, operands, program)
        if tuple(shape) != tuple(ins.shape):
            raise ProgramError(f"the local shape must be what the {ins.op} rule gives for operand shape(s) "
                               f"{[tuple(o.shape) for o in operands]}, {tuple(shape)}; got {tuple(ins.shape)}")
        if dtype is not None and np.dtype(parse_dtype(dtype)) != np.dtype(parse_dtype(ins.dtype)):
            raise ProgramError(f"the dtype must be what the {ins.op} rule gives for operand dtype(s) "
                               f"{[str(o.dtype) for o in operands]}, {np.dtype(parse_dtype(dtype))}; got {ins.dtype}")
    if ins.donate >= 0:
        x = operands[ins.donate]
        if not derives(ins.op) or tuple(x.shape) != tuple(ins.shape) or \
                np.dtype(parse_dtype(x.dtype)) != np.dtype(parse_dtype(ins.dtype)):
            raise ProgramError(f"a donated operand's buffer receives the result, so it must be of the result's "
                               f"shape and dtype {_ty(ins)} (and the op's shape derived: {derives(ins.op)}); got "
                               f"operand {ins.donate} (%{x.out}) {_ty(x)}")


def _ty(ins) -> str:
    return f"{ins.dtype}{list(ins.shape)}"


def _rule(op: str):
    if op in RESULT_RULES:
        return RESULT_RULES[op]
    if op in UFUNC_OPS:
        return _elementwise
    if op in KINDS or op in BY_START:
        return _collective
    if op in BY_DONE:
        return _done
    return None


def _probe(ins, operands, **attrs):
    """The dtype the op's own kernel gives for operands of these dtypes and ranks (arrays of ones of extent 1:
    exact, as NumPy's type rules depend on dtypes alone). Cached per (op, dtypes, ranks, attrs)."""
    try:
        return _probe_cached(ins.op, tuple((str(parse_dtype(o.dtype)), len(o.shape)) for o in operands),
                             tuple(sorted(attrs.items())))
    except ProgramError:
        raise
    except Exception as e:  # the op's kernel refused these dtypes: name it
        raise ProgramError(f"the {ins.op} kernel must take operands of dtype(s) "
                           f"{[str(o.dtype) for o in operands]}; got {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=1024)
def _probe_cached(op: str, operands: tuple, attrs: tuple):
    arrays = [np.ones((1,) * rank, parse_dtype(d)) for d, rank in operands]
    with np.errstate(all="ignore"):
        return np.asarray(opdef.lookup(op).kernel(np, *arrays, **dict(attrs))).dtype


def _broadcast(shapes, what: str) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise ProgramError(f"{what} must broadcast together; got {[tuple(s) for s in shapes]}") from None


def _elementwise(ins, operands, program):
    return _broadcast([o.shape for o in operands], "operand shapes"), _probe(ins, operands)


def _select(ins, operands, program):
    if len(operands) != 3:
        raise ProgramError(f"a select takes (condition, a, b); got {len(operands)} operands")
    return _broadcast([o.shape for o in operands], "operand shapes"), _probe(ins, operands)


def _same_as_operand(ins, operands, program):
    _arity(ins, operands, 1)
    return tuple(operands[0].shape), operands[0].dtype


def _convert(ins, operands, program):
    _arity(ins, operands, 1)
    return tuple(operands[0].shape), ins.attrs["dtype"]


def _arity(ins, operands, n: int) -> None:
    if len(operands) != n:
        raise ProgramError(f"{ins.op} takes {n} operand(s); got {len(operands)}")


def _dims(values, rank: int, what: str, distinct: bool = True) -> tuple:
    """Dims in [0, rank) (distinct unless told): the rule an axes / perm / dims attribute must meet."""
    if not isinstance(values, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values) \
            or any(not 0 <= v < rank for v in values) or (distinct and len(set(values)) != len(values)):
        raise ProgramError(f"{what} must be distinct dims in [0, {rank}); got {values!r}")
    return values


def _reduce(ins, operands, program):
    _arity(ins, operands, 1)
    x = operands[0]
    axes = _dims(ins.attrs["axes"], len(x.shape), "attribute 'axes'")
    return tuple(n for d, n in enumerate(x.shape) if d not in axes), _probe(ins, operands, kind=ins.attrs["kind"],
                                                                           axes=axes)


def _reshape(ins, operands, program):
    _arity(ins, operands, 1)
    shape = ins.attrs["shape"]
    _ints(shape, "attribute 'shape'", low=0)
    if int(np.prod(shape)) != int(np.prod(operands[0].shape)):
        raise ProgramError(f"a reshape keeps the element count {int(np.prod(operands[0].shape))}; got attribute "
                           f"'shape' {shape}")
    return shape, operands[0].dtype


def _transpose(ins, operands, program):
    _arity(ins, operands, 1)
    x = operands[0]
    perm = ins.attrs["perm"]
    if len(perm) != len(x.shape):
        raise ProgramError(f"attribute 'perm' must be a permutation of the operand's {len(x.shape)} dims; got {perm}")
    _dims(perm, len(x.shape), "attribute 'perm'")
    return tuple(x.shape[p] for p in perm), x.dtype


def _broadcast_in_dim(ins, operands, program):
    _arity(ins, operands, 1)
    x, shape, dims = operands[0], ins.attrs["shape"], ins.attrs["dims"]
    _ints(shape, "attribute 'shape'", low=0)
    if len(dims) != len(x.shape):
        raise ProgramError(f"attribute 'dims' must place each of the operand's {len(x.shape)} dims; got {dims}")
    _dims(dims, len(shape), "attribute 'dims'")
    if any(x.shape[i] not in (1, shape[d]) for i, d in enumerate(dims)):
        raise ProgramError(f"each operand dim must be 1 or its target's extent; got operand {tuple(x.shape)} into "
                           f"{shape} at dims {dims}")
    return shape, x.dtype


def _einsum(ins, operands, program):
    _arity(ins, operands, 2)
    lhs, out = ins.attrs["spec"].split("->")
    specs = lhs.split(",")
    if len(specs) != 2:
        raise ProgramError(f"attribute 'spec' must name two operands; got {ins.attrs['spec']!r}")
    size: dict = {}
    for k, (letters, x) in enumerate(zip(specs, operands)):
        if len(letters) != len(x.shape) or len(set(letters)) != len(letters):
            raise ProgramError(f"attribute 'spec' must name each dim of operand {k} {tuple(x.shape)} once; got "
                               f"{letters!r}")
        for letter, n in zip(letters, x.shape):
            if size.setdefault(letter, n) != n:
                raise ProgramError(f"attribute 'spec' letter {letter!r} must have one extent; got {size[letter]} "
                                   f"and {n}")
    if len(set(out)) != len(out) or any(c not in size for c in out):
        raise ProgramError(f"attribute 'spec' output letters must be distinct operand letters; got {out!r}")
    return tuple(size[c] for c in out), _probe(ins, operands, spec=ins.attrs["spec"])


def _parameter(ins, operands, program):
    index = ins.attrs["index"]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(program.inputs):
        raise ProgramError(f"attribute 'index' must be an input position in [0, {len(program.inputs)}); got "
                           f"{index!r}")
    io = program.inputs[index]
    if io.slot != ins.out:
        raise ProgramError(f"input {index} ({io.name!r}) must be this parameter's; got it at slot %{io.slot}")
    return _io_local(io, program), io.dtype


def _io_local(io, program) -> tuple:
    _ints(io.shape, f"{io.name!r} shape", low=0)
    if len(io.sharding.dims) != len(io.shape):
        raise ProgramError(f"{io.name!r}'s sharding must name each of its {len(io.shape)} dims; got {io.sharding}")
    return tuple(io.sharding.local_shape(tuple(io.shape), program.mesh))


def _constant(ins, operands, program):
    value = ins.attrs["value"]
    array = np.asarray(value)
    return array.shape, array.dtype


def _group(op: str, attrs: dict, program) -> int:
    return group_size(op, attrs, program.mesh)


def _collective(ins, operands, program):
    """A collective's (or its start's) result: its kind's rule (collective_kinds.CollectiveKind.result) over the
    group; an exchange (all_to_allv) makes a buffer of the shape it is given."""
    kind = KINDS.get(ins.op) or BY_START[ins.op]
    if kind.result is None:  # the exchange's result: a buffer of its shape, the operand's pieces copied in
        if not operands or any(o.dtype != operands[0].dtype for o in operands):
            raise ProgramError(f"an exchange takes its operand (and what it updates), of one dtype; got "
                               f"{[_ty(o) for o in operands]}")
        if len(operands) > 2:
            raise ProgramError(f"an exchange takes its operand and at most the array it updates; got "
                               f"{len(operands)} operands")
        if len(operands) == 2:  # into a copy of the array it updates
            return tuple(operands[1].shape), operands[0].dtype
        _ints(ins.global_shape, "global_shape", low=0)
        if len(ins.sharding.dims) != len(ins.global_shape):
            raise ProgramError(f"the sharding must name each of the {len(ins.global_shape)} dims; got {ins.sharding}")
        return tuple(ins.sharding.local_shape(tuple(ins.global_shape), program.mesh)), operands[0].dtype
    _arity(ins, operands, 1)
    x = operands[0]
    k = _group(kind.name, ins.attrs, program)
    for attr, change in kind.result:
        _dims((ins.attrs[attr],), len(x.shape), f"attribute {attr!r}")
        if change == "/k" and x.shape[ins.attrs[attr]] % k:
            raise ProgramError(f"attribute {attr!r}: dim {ins.attrs[attr]} of {tuple(x.shape)} must divide by the "
                               f"group size {k}")
    if kind.group == WORLD:
        _permute_pairs(ins.attrs["pairs"], program.mesh.size)
    return kind.result_shape(x.shape, k, ins.attrs), x.dtype


def _permute_pairs(pairs, size: int) -> None:
    sources, dests = [p[0] for p in pairs], [p[1] for p in pairs]
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ProgramError(f"attribute 'pairs' must send from and to each rank once; got {pairs}")


def _done(ins, operands, program):
    _arity(ins, operands, 2)
    return tuple(operands[0].shape), operands[0].dtype


def _shard_slice(ins, operands, program):
    _arity(ins, operands, 1)
    x, dim = operands[0], ins.attrs["dim"]
    _dims((dim,), len(x.shape), "attribute 'dim'")
    if len(ins.shape) != len(x.shape):
        raise ProgramError(f"a shard_slice keeps the operand's rank {len(x.shape)}; got shape {tuple(ins.shape)}")
    return tuple(ins.shape[d] if d == dim else n for d, n in enumerate(x.shape)), x.dtype


def _rotated_concat(ins, operands, program):
    if not operands:
        raise ProgramError("a rotated_concat takes its blocks; got none")
    x, dim = operands[0], ins.attrs["dim"]
    _dims((dim,), len(x.shape), "attribute 'dim'")
    if len(operands) != program.mesh.axis_size(ins.attrs["axes"]) or any(
            len(o.shape) != len(x.shape) or any(a != b for d, (a, b) in enumerate(zip(o.shape, x.shape)) if d != dim)
            or o.dtype != x.dtype for o in operands):
        raise ProgramError(f"a rotated_concat joins one block per shard of {ins.attrs['axes']}, alike but along "
                           f"dim {dim}; got {[_ty(o) for o in operands]}")
    return tuple(sum(o.shape[dim] for o in operands) if d == dim else n for d, n in enumerate(x.shape)), x.dtype


def _shard_index(ins, operands, program):
    _arity(ins, operands, 0)
    return (), "int64"


def _mask_padding(ins, operands, program):
    _arity(ins, operands, 1)
    _dims((ins.attrs["dim"],), len(operands[0].shape), "attribute 'dim'")
    return tuple(operands[0].shape), operands[0].dtype


def _fusion(ins, operands, program):
    """A fusion's operands match its ``shapes`` (element counts: the loop reads that many) and broadcast to its
    result; its steps' refs name operands, literals and earlier steps, one dtype per step, the last the result's."""
    shape = _chain(ins, operands)
    return shape, ins.attrs["dtypes"][-1]


def _chain(ins, operands) -> tuple:
    shapes, steps = ins.attrs["shapes"], ins.attrs["code"].split("; ")
    if len(shapes) != len(operands):
        raise ProgramError(f"attribute 'shapes' must give one shape per operand ({len(operands)}); got {len(shapes)}")
    for k, (s, x) in enumerate(zip(shapes, operands)):
        _ints(s, "attribute 'shapes'", low=0)
        if int(np.prod(s)) != int(np.prod(x.shape)):
            raise ProgramError(f"attribute 'shapes'[{k}] must view operand {k} {tuple(x.shape)} (the same element "
                               f"count); got {s}")
    if len(ins.attrs["dtypes"]) != len(steps):
        raise ProgramError(f"attribute 'dtypes' must give one dtype per step ({len(steps)}); got "
                           f"{len(ins.attrs['dtypes'])}")
    limits = {"p": len(operands), "c": len(ins.attrs["consts"])}
    for text in steps:
        refs = FUSION_STEP.match(text).group(3).split(",")
        bad = [r for r in refs if r[0] in limits and int(r[1:]) >= limits[r[0]]]
        if bad:
            raise ProgramError(f"attribute 'code' refs must name operands p0..p{len(operands) - 1} and literals "
                               f"c0..c{len(ins.attrs['consts']) - 1}; got {bad} in {text!r}")
    return _broadcast(shapes, "attribute 'shapes'")


def _fused_reduce(ins, operands, program):
    """The chain (``_chain``) must give ``chain_shape``; the result drops the reduced dims ``axes``, trailing ones."""
    chain, want = _chain(ins, operands), ins.attrs["chain_shape"]
    _ints(want, "attribute 'chain_shape'", low=0)
    if chain != tuple(want):
        raise ProgramError(f"attribute 'chain_shape' must be the chain's broadcast shape {chain}; got {want}")
    axes = _dims(ins.attrs["axes"], len(chain), "attribute 'axes'")
    if sorted(axes) != list(range(len(chain) - len(axes), len(chain))):
        raise ProgramError(f"a fused_reduce reduces trailing dims of {chain}; got attribute 'axes' {axes}")
    probe = _probe_cached(REDUCE.name, ((str(parse_dtype(ins.attrs["dtypes"][-1])), len(chain)),),
                          (("axes", axes), ("kind", ins.attrs["kind"])))
    return chain[:len(chain) - len(axes)], probe



def _slice_length(n: int, start, stop, step=1) -> int:
    """Elements of a dim of ``n`` that Python's slice [start:stop:step] keeps (what the kernels index with)."""
    if any(not isinstance(v, int) or isinstance(v, bool) for v in (start, stop, step)) or step == 0:
        raise ProgramError(f"slice bounds must be ints and a step nonzero; got {start}:{stop}:{step}")
    return len(range(*slice(start, stop, step).indices(n)))


def _window_edge(ins, operands, program):
    _arity(ins, operands, 1)
    x, dim = operands[0], ins.attrs["dim"]
    _dims((dim,), len(x.shape), "attribute 'dim'")
    n = _slice_length(x.shape[dim], ins.attrs["start"], ins.attrs["stop"])
    return tuple(n if d == dim else e for d, e in enumerate(x.shape)), x.dtype


def _resize(ins, operands, program):
    _arity(ins, operands, 1)
    x, dim, size = operands[0], ins.attrs["dim"], ins.attrs["size"]
    _dims((dim,), len(x.shape), "attribute 'dim'")
    _ints((size,), "attribute 'size'", low=0)
    return tuple(size if d == dim else e for d, e in enumerate(x.shape)), x.dtype


def _slice(ins, operands, program):
    _arity(ins, operands, 1)
    x, a = operands[0], ins.attrs
    if not len(a["start"]) == len(a["limit"]) == len(a["strides"]) == len(x.shape):
        raise ProgramError(f"attributes 'start', 'limit', 'strides' must give one bound per dim of "
                           f"{tuple(x.shape)}; got {a['start']}, {a['limit']}, {a['strides']}")
    return tuple(_slice_length(n, *bounds) for n, bounds in zip(x.shape, zip(a["start"], a["limit"], a["strides"]))), \
        x.dtype


def _reverse(ins, operands, program):
    _arity(ins, operands, 1)
    _dims(ins.attrs["axes"], len(operands[0].shape), "attribute 'axes'")
    return tuple(operands[0].shape), operands[0].dtype


def _dynamic_update_slice(ins, operands, program):
    """x's shape and dtype; the update of x's rank and dtype, no larger than x on any dim (the kernel writes it
    in place into a donated x), one 0-d start per dim."""
    if len(operands) < 2:
        raise ProgramError(f"a dynamic_update_slice takes x, the update and one start per dim; got {len(operands)} operand(s)")
    x, update, starts = operands[0], operands[1], operands[2:]
    if len(update.shape) != len(x.shape) or any(u > n for u, n in zip(update.shape, x.shape)) \
            or np.dtype(parse_dtype(update.dtype)) != np.dtype(parse_dtype(x.dtype)):
        raise ProgramError(f"a dynamic_update_slice's update must be of x's rank and dtype and fit in it: x "
                           f"{_ty(x)}; got update {_ty(update)}")
    if len(starts) != len(x.shape) or any(tuple(st.shape) != () for st in starts):
        raise ProgramError(f"a dynamic_update_slice takes one 0-d start per dim of x {_ty(x)}; got "
                           f"{[_ty(st) for st in starts]}")
    return tuple(x.shape), x.dtype


def _concatenate(ins, operands, program):
    if not operands:
        raise ProgramError("a concatenate takes at least one operand; got none")
    x, axis = operands[0], ins.attrs["axis"]
    _dims((axis,), len(x.shape), "attribute 'axis'")
    if any(len(o.shape) != len(x.shape) or any(a != b for d, (a, b) in enumerate(zip(o.shape, x.shape)) if d != axis)
           for o in operands):
        raise ProgramError(f"concatenated operands must agree but along axis {axis}; got {[_ty(o) for o in operands]}")
    dtype = np.result_type(*[parse_dtype(o.dtype) for o in operands])
    return tuple(sum(o.shape[axis] for o in operands) if d == axis else n for d, n in enumerate(x.shape)), dtype

UFUNC_OPS = frozenset(name for name, record in opdef.OPS.items() if record.ufunc is not None)
RESULT_RULES = {PARAMETER.name: _parameter, CONSTANT.name: _constant, SELECT.name: _select, CONVERT.name: _convert,
                STOP_GRADIENT.name: _same_as_operand, REDUCE.name: _reduce, RESHAPE.name: _reshape,
                TRANSPOSE.name: _transpose, BROADCAST_IN_DIM.name: _broadcast_in_dim, EINSUM.name: _einsum,
                SHARD_SLICE.name: _shard_slice, ROTATED_CONCAT.name: _rotated_concat, SHARD_INDEX.name: _shard_index,
                MASK_PADDING.name: _mask_padding, FUSION.name: _fusion, FUSED_REDUCE.name: _fused_reduce,
                WINDOW_EDGE.name: _window_edge, RESIZE.name: _resize, SLICE.name: _slice, REVERSE.name: _reverse,
                CONCATENATE.name: _concatenate, DYNAMIC_UPDATE_SLICE.name: _dynamic_update_slice}


__all__ = ["check_program", "derives", "ProgramError", "REDUCE_KINDS", "reduction"]
