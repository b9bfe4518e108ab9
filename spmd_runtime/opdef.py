"""The op-definition floor: every op is ONE record, ``OpDef``, registered once, and ``RuleTable``, the shape
of every layer's rules for the ops.

A record holds what an op is, not what the layers do with it:

- ``name`` (what graphs and programs store: JSON-able), ``kind`` and ``module`` (where it was defined: the
  one module where its name may be written as a string, ``tests/unit/test_layers.py``);
- ``kernel``: ``fn(xp, *operands, **attrs)``, the local computation shared by the reference evaluator and the
  interpreter;
- buffer flags: ``fresh`` / ``read_only``: whether its result is a buffer no other value shares, or the
  caller's or the program's own array (buffer donation in the partitioner, buffer reuse in the interpreter);
  ``fresh_if``: ``fn(instr, operand instrs) -> bool`` for an op whose results are fresh for some instructions
  only (a scan's stacked results, not its carries; read through ``fresh_result``); ``in_place``: it may write
  its result into an operand whose buffer dies there; ``ufunc``: the array-module ufunc of an elementwise op
  (it takes ``out=``); ``collective``: it moves data between ranks; ``cheap``: pointwise with no
  transcendental and no division, so cheaper to recompute in each consumer than to store (fusion's
  duplicated producers, the scan backward's recomputed values).

The shape/dtype rule of a graph op is its traced constructor (e.g. ``ops.core.add``), the one function that
emits it. Each layer that transforms programs keeps its rules for the ops in its own ``RuleTable`` keyed by
the record, in its own ``rules/`` folder (JAX's per-transformation rule tables keyed by primitive):
``autodiff/rules`` (``VJP``), ``partition/rules`` (``PROPAGATION``, ``PARTITION``), ``exec/rules`` (``BIND``:
binders of rank-dependent ops). ``kind`` says which an op needs: a ``"graph"`` op (traced) has a propagation
rule, a partition rule, a VJP and a kernel; a ``"program"`` op (emitted only by the partitioner) has a kernel
or a binder. ``tests/unit/test_opdef.py`` checks every record against the tables.

This module imports nothing from the package: it is the floor every layer stands on. Identity is the record;
``lookup`` maps a stored name back, refusing names never defined.
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
    kernel: Callable | None = None

    def __repr__(self):
        return f"OpDef({self.name!r}, {self.kind})"

    def __str__(self):
        return self.name


_OPS: dict[str, OpDef] = {}
OPS = MappingProxyType(_OPS)  # name -> record, read-only


def define(name: str, kind: str = "graph", **flags) -> OpDef:
    """Register the record of a new op; each name is defined once."""
    if name in _OPS:
        raise ValueError(f"an op is defined once; got a second definition of {name!r}")
    if kind not in KINDS:
        raise ValueError(f"an op's kind is one of {KINDS}; got {kind!r} for {name!r}")
    module = flags.pop("module", None) or sys._getframe(1).f_globals.get("__name__", "")  # a table's records: the table
    _OPS[name] = OpDef(name, kind, module, **flags)
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
                if record in self._rules:
                    raise ValueError(f"an op has one {self.part} rule; got a second one for {record.name!r}")
                self._rules[record] = rule
            return rule
        return add if value is None else add(value)

    def get(self, op):
        """The rule of ``op`` (a record or its name), or None."""
        return self._rules.get(lookup(op))

    def __contains__(self, op) -> bool:
        return self.get(op) is not None

    def ops(self) -> list[OpDef]:
        return [r for r in _OPS.values() if r in self]


def kernel(*ops):
    """Decorate ``fn(xp, *operands, **attrs) -> array`` as the kernel of ``ops`` (records or names)."""
    def register(fn):
        for op in ops:
            record = lookup(op)
            if record.kernel is not None:
                raise ValueError(f"an op has one kernel; got a second one for {record.name!r}")
            record.kernel = fn
        return fn
    return register
