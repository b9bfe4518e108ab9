"""The op-definition floor: every op is ONE record, ``OpDef``, registered once.

A record holds everything the layers above need to know about one op:

- ``propagation``: how shardings flow through it (level, forward, backward), read by
  ``partition/propagation.py``;
- ``partition``: ``fn(ctx, node) -> LocalValue``, which proposes strategies and emits the local op,
  read by ``partition/partitioner.py``;
- ``kernel``: ``fn(xp, *operands, **attrs)``, the local computation shared by the reference
  evaluator and the interpreter, or ``bind``: ``fn(interpreter, instr) -> callable`` for ops whose
  behaviour depends on the rank (collectives, layout ops), read by ``exec/interpreter.py``;
- ``vjp``: ``fn(node, cotangent, operands, result) -> [cotangent | None | thunk]``, read by
  ``autodiff.py``;
- ``fresh`` / ``read_only``: whether its result is a buffer no other value shares, or the caller's or
  the program's own array (buffer donation in the partitioner, buffer reuse in the interpreter);
  ``fresh_if``: ``fn(instr, operand instrs) -> bool`` for an op whose results are fresh for some
  instructions only (a scan's stacked results, not its carries; read through ``fresh_result``);
  ``in_place``: it may write its result into an operand whose buffer dies there; ``ufunc``: the
  array-module ufunc of an elementwise op (it takes ``out=``); ``collective``: it moves data between
  ranks; ``cheap``: pointwise with no transcendental and no division, so cheaper to recompute in each
  consumer than to store (fusion's duplicated producers, the scan backward's recomputed values).

The shape/dtype rule of a graph op is its traced constructor (e.g. ``ops.core.add``), the one
function that emits it. ``kind`` says which parts an op must have: a ``"graph"`` op (traced) has a
propagation rule, a partition rule, a kernel and a VJP; a ``"program"`` op (emitted only by the
partitioner) has a kernel or a binder. ``tests/unit/test_opdef.py`` checks every record.

Op families (``spmd_runtime/ops/*.py``) each define their records in ONE file: ``define`` the
record, then attach its parts with the decorators below. This module imports nothing from the
package: it is the floor every layer stands on. Identity is the record; graphs and programs store
its ``name`` (JSON-able), and ``lookup`` maps a name back, refusing names never defined.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

ELEMENTWISE_LEVEL, BROADCAST_LEVEL, DOT_LEVEL = 0, 1, 2  # propagation levels (GSPMD 3.5), run in order
KINDS = ("graph", "program")


@dataclass(frozen=True)
class PropagationRule:
    level: int
    forward: Callable  # (node, operand shardings (None = unknown), graph, mesh) -> Sharding | None
    backward: Callable  # (node, result sharding, operand shardings, graph, mesh) -> [Sharding | None]


@dataclass(eq=False)
class OpDef:
    name: str
    kind: str = "graph"
    module: str = ""  # the module that defined it: the one place its name may be written as a string
    fresh: bool = False
    fresh_if: Callable | None = None
    read_only: bool = False
    in_place: bool = False
    ufunc: str | None = None
    collective: bool = False
    cheap: bool = False
    propagation: PropagationRule | None = None
    partition: Callable | None = None
    kernel: Callable | None = None
    bind: Callable | None = None
    vjp: Callable | None = None

    def __repr__(self):
        return f"OpDef({self.name!r}, {self.kind})"

    def __str__(self):
        return self.name

    def missing_parts(self) -> list[str]:
        """The parts this op's kind requires that it lacks (empty when complete)."""
        if self.kind == "program":
            return [] if self.kernel or self.bind else ["kernel or bind"]
        need = {"propagation": self.propagation, "partition": self.partition, "vjp": self.vjp,
                "kernel": self.kernel or self.bind}
        return [part for part, value in need.items() if value is None]


_OPS: dict[str, OpDef] = {}
OPS = MappingProxyType(_OPS)  # name -> record, read-only


def define(name: str, kind: str = "graph", **flags) -> OpDef:
    """Register the record of a new op; each name is defined once."""
    if name in _OPS:
        raise ValueError(f"an op is defined once; got a second definition of {name!r}")
    if kind not in KINDS:
        raise ValueError(f"an op's kind is one of {KINDS}; got {kind!r} for {name!r}")
    _OPS[name] = OpDef(name, kind, sys._getframe(1).f_globals.get("__name__", ""), **flags)
    return _OPS[name]


def lookup(op) -> OpDef:
    """The record of ``op`` (a record or its name)."""
    if isinstance(op, OpDef):
        return op
    try:
        return _OPS[op]
    except KeyError:
        raise NotImplementedError(f"every op needs a definition (spmd_runtime.opdef.define); got none for op "
                                  f"{op!r}") from None


def fresh_result(ins, producer) -> bool:
    """Whether instruction ``ins`` makes a buffer no other value shares: its record's ``fresh``, or its
    ``fresh_if`` given the instructions of its operands (``producer``: slot -> instruction)."""
    record = lookup(ins.op)
    return record.fresh or (record.fresh_if is not None and record.fresh_if(ins, [producer(a) for a in ins.args]))


class RuleTable:
    """One layer's rules for the ops, keyed by the op record: the layer that transforms programs (partition,
    autodiff, exec) owns its table, in its own folder, and fills it with ``register``; the records never
    know their rules (JAX's per-transformation tables keyed by primitive). ``get`` is the one read."""

    def __init__(self, part: str):
        self.part = part
        self._rules: dict[OpDef, object] = {}

    def __repr__(self):
        return f"RuleTable({self.part!r}, {len(self._rules)} ops)"

    def register(self, *ops, value=None):
        """Decorate ``fn`` as the rule of ``ops`` (records or names); each op has one rule per table.
        ``value=`` registers it directly (no decorator)."""
        def add(rule):
            for op in ops:
                record = lookup(op)
                if record in self._rules or getattr(record, self.part, None) is not None:
                    raise ValueError(f"an op has one {self.part} rule; got a second one for {record.name!r}")
                self._rules[record] = rule
            return rule
        return add if value is None else add(value)

    def get(self, op):
        """The rule of ``op`` (a record or its name), or None (an op still carrying its rule on the record
        counts until every family has moved its rules to its layer)."""
        record = lookup(op)
        return self._rules.get(record, getattr(record, self.part, None))

    def __contains__(self, op) -> bool:
        return self.get(op) is not None

    def ops(self) -> list[OpDef]:
        return [r for r in _OPS.values() if r in self]


def _attach(part: str, ops, value):
    for op in ops:
        record = lookup(op)
        if getattr(record, part) is not None:
            raise ValueError(f"an op has one {part}; got a second one for {record.name!r}")
        setattr(record, part, value)


def propagation(*ops, level: int):
    """Decorate ``pair() -> (forward, backward)`` as the propagation rule of ``ops`` at ``level``."""
    def register(pair):
        forward, backward = pair()
        _attach("propagation", ops, PropagationRule(level, forward, backward))
        return pair
    return register


def _part(part: str):
    def decorator(*ops):
        def register(fn):
            _attach(part, ops, fn)
            return fn
        return register
    decorator.__name__ = part
    decorator.__doc__ = f"Decorate a function as the {part} of ``ops`` (records or names)."
    return decorator


partition = _part("partition")  # fn(ctx, node) -> LocalValue
kernel = _part("kernel")  # fn(xp, *operands, **attrs) -> array
bind = _part("bind")  # fn(interpreter, instr) -> fn(*operands) -> array
vjp = _part("vjp")  # fn(node, cotangent, operands, result) -> [cotangent | None | thunk]
