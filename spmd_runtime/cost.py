"""Cost model of collectives: bytes each rank puts on the wire (GSPMD_NOTES.md section 5).

Bandwidth-optimal algorithms over k ranks; the latency model is alpha + beta * bytes.
``CostModel`` prices one collective for the partitioner's choices (einsum strategies,
resharding plans): the ring-formula wire bytes by default, or, from a profile that
``python -m spmd_runtime calibrate`` measured on the machine, alpha + beta * wire bytes
per collective and group size, expressed in bytes of the default model's link
(``SECONDS_PER_BYTE``) so that it adds up with ``BYTES_PER_FLOP``.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

from .collective_kinds import BY_START, KINDS, WORLD
from .mesh import Mesh


def collective_kind(op: str) -> str | None:
    """The collective an instruction runs: ``op`` itself or, for a kind's start, its kind; else None (a done
    only waits for its start)."""
    kind = KINDS.get(op) or BY_START.get(op)
    return None if kind is None else kind.name


# What one local flop costs in bytes on the wire: ~10 GB/s between ranks vs ~100 GFLOP/s per rank.
# Strategies trade the two: gathering operands to skip an all-reduce replicates the matmul on every rank.
BYTES_PER_FLOP = 0.1


def strategy_cost(wire: float, flops: float) -> float:
    """Comparable cost of a partitioning strategy: bytes each rank moves plus its local compute."""
    return wire + BYTES_PER_FLOP * flops


def wire_bytes(op: str, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
    """Bytes each rank sends for one collective over ``k`` ranks (its kind's formula in ``collective_kinds.py``;
    GSPMD_NOTES.md section 5).

    An all_to_allv's bytes depend on the blocks, not on k: ``sent``, what its busiest rank sends or receives."""
    kind = KINDS.get(op)
    return 0.0 if kind is None else kind.wire_bytes(k, bytes_in, bytes_out, sent)


def group_size(step_op: str, attrs: dict, mesh: Mesh) -> int:
    kind = KINDS.get(step_op)
    return mesh.size if kind is not None and kind.group == WORLD else mesh.axis_size(attrs["axes"])


# The default model's link, ~10 GB/s (what BYTES_PER_FLOP assumes): turns measured seconds into bytes.
SECONDS_PER_BYTE = 1e-10
PROFILE_ENV = "SPMD_COST_PROFILE"  # a profile file the partitioner uses when partition() is given none
PROFILE_FORMAT = "spmd_runtime.cost_profile"


@dataclass(frozen=True)
class CostModel:
    """What one collective costs. ``fits``: measured (op, group size, alpha seconds, beta seconds per wire byte);
    empty for the ring-formula default. An all_to_allv is priced as k - 1 collective_permute rounds."""
    name: str = "ring"
    fits: tuple = ()
    _by_op: dict = field(default=None, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self):
        by_op: dict = {}
        for op, k, alpha, beta in self.fits:
            by_op.setdefault(op, []).append((int(k), float(alpha), float(beta)))
        object.__setattr__(self, "_by_op", by_op)

    def seconds(self, op: str, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
        """Predicted time of one collective: alpha + beta * wire bytes, or wire bytes over the default link."""
        wire = wire_bytes(op, k, bytes_in, bytes_out, sent)
        if wire == 0:
            return 0.0
        kind = KINDS[op]
        fit = self._fit(kind.rounds_of or op, k)
        if fit is None:
            return wire * SECONDS_PER_BYTE
        alpha, beta = fit
        return alpha * (max(k - 1, 1) if kind.exchange else 1) + beta * wire

    def collective(self, op: str, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
        """The cost the partitioner compares: wire bytes (default) or predicted seconds in bytes of the link."""
        if not self.fits:
            return wire_bytes(op, k, bytes_in, bytes_out, sent)
        return self.seconds(op, k, bytes_in, bytes_out, sent) / SECONDS_PER_BYTE

    def _fit(self, op, k):
        """(alpha, beta) measured for ``op`` at the group size nearest ``k`` (by ratio), or None."""
        rows = self._by_op.get(op)
        if not rows:
            return None
        _, alpha, beta = min(rows, key=lambda r: (abs(math.log(r[0] / k)), r[0]))
        return alpha, beta

    @classmethod
    def load(cls, path) -> "CostModel":
        """A model from a profile file written by ``python -m spmd_runtime calibrate``."""
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != PROFILE_FORMAT:
            raise ValueError(f"a cost profile must have format {PROFILE_FORMAT!r} (write one with "
                             f"`mpiexec -n N python -m spmd_runtime calibrate`); got {doc.get('format')!r} in {path}")
        return cls(f"profile:{os.path.basename(str(path))}",
                   tuple((f["op"], f["k"], f["alpha"], f["beta"]) for f in doc["fits"]))


DEFAULT_MODEL = CostModel()
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("spmd_cost_model", default=None)


def resolve_model(profile=None) -> CostModel:
    """``profile``: a CostModel, a profile path, or None (the file named by $SPMD_COST_PROFILE, else the default)."""
    if isinstance(profile, CostModel):
        return profile
    path = profile if profile is not None else os.environ.get(PROFILE_ENV)
    if not path:
        return DEFAULT_MODEL
    stat = os.stat(path)
    return _load_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _load_cached(path, mtime, size) -> CostModel:
    return CostModel.load(path)


def active_model() -> CostModel:
    """The model of the partition() call in progress (the default outside one)."""
    return _ACTIVE.get() or DEFAULT_MODEL


@contextlib.contextmanager
def using(model: CostModel):
    token = _ACTIVE.set(model)
    try:
        yield model
    finally:
        _ACTIVE.reset(token)
