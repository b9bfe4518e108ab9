"""Predict one run of an SPMD program on a hardware profile, per rank, without running it.

``program.estimate(hardware)`` walks the program as one rank would run it:

- compute: each instruction's FLOPs (einsum and conv exact: 2 x the product of every index size; fused
  elementwise chains one FLOP per operation and element) and bytes (operands read, result written) on a
  roofline: ``max(flops / peak(dtype), bytes / memory bandwidth)`` plus the profile's per-instruction overhead,
  an einsum's peak scaled by the profile's ``gemm_fraction`` of its smallest matmul dim (rows, columns or the
  summed length: attention's head dim runs a CPU's BLAS at half its rate),
  over the compute units the rank gets (``Hardware.units_of``: a node's cores over the ranks placed on it; more
  than one speeds up only the BLAS work, einsums and convolutions, on up to ``threads_per_rank`` threads);
- communication: each collective's wire bytes (``cost.wire_bytes``: the ring formulas) over the link its group
  is limited by (``Hardware.link_for``: inside a node, or between nodes when the group spans several), plus one
  latency per message of the algorithm (``CollectiveKind.messages``: logarithmic in the group size); inside a
  node, over the rank's compute units when it has under one (its CPU copies the bytes through shared memory);
- overlap as the program's schedule allows: a ``*_start`` puts its collective on the rank's one communication
  channel and compute goes on until its ``*_done``; a blocking collective waits for it. Not inside a node whose
  profile says ``overlap: false`` (a CPU host: MPI moves shared-memory messages, and reduces them, on the rank's
  own core inside its MPI calls, with no progress thread; a profiled done is where its CPU time goes);
- ranks sharing cores: where the rank blocks (a blocking collective, a ``*_done``) it also waits for the peers of
  its group that are not running (``Hardware.sync_wait_s``: zero with a core per rank; the collective cannot
  progress without them, so it is paid even where the channel had finished);
- loops: a scan's body ``length`` times (a pipeline's bubble is in its iterations: every stage computes every
  one); a while loop's body once (its trip count is known only at run time: ``notes`` says so); a cond's
  costlier branch.

Totals: ``step_s``, compute and exposed communication, FLOPs per rank, the program's peak bytes against the
device's memory (``fits``, ``verdict``), ``tokens_per_s(tokens)`` and ``mfu(model_flops)``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from .collective_kinds import BY_DONE, BY_START, KINDS, WORLD
from .cost import wire_bytes
from .graph import PARAMETER
from .hardware import Hardware, Link
from .ops.control import COND, LOOP_OUT, SCAN, WHILE
from .ops.core import RESHAPE
from .ops.einsum import EINSUM
from .ops.slicing import DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE
from .ops.spmd import FUSED_REDUCE, FUSION, SHARD_INDEX
from .ops.windows import CONV

FREE = frozenset(op.name for op in (PARAMETER, RESHAPE, LOOP_OUT, SHARD_INDEX))  # views and leaves: no work
BLAS = frozenset(op.name for op in (EINSUM, CONV))  # the work BLAS threads share


@dataclass(frozen=True)
class InstrCost:
    """One instruction's predicted cost on one rank (``trips``: times it runs per call, inside loops)."""
    op: str
    slot: int
    flops: float
    bytes: float
    compute_s: float
    comm_s: float
    link: str  # "node" / "network" for a collective, "" for compute
    trips: int = 1
    wait_s: float = 0.0  # a blocking collective's or done's wait for descheduled peers (ranks sharing cores)


@dataclass
class Estimate:
    """The predicted call of a program on ``hardware``, for ``rank``."""
    hardware: Hardware
    rank: int
    step_s: float
    compute_s: float
    comm_s: float
    flops: float
    peak_bytes: int
    instrs: list = field(repr=False)
    notes: list = field(default_factory=list)
    wait_s: float = 0.0  # waits for descheduled peers at blocking collectives (ranks sharing cores), in step_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication not hidden behind compute."""
        return max(self.step_s - self.compute_s, 0.0)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hardware.memory_bytes

    @property
    def verdict(self) -> str:
        need, have = _gib(self.peak_bytes), _gib(self.hardware.memory_bytes)
        return f"fits: needs {need} of {have}" if self.fits else f"does not fit: needs {need} of {have}"

    def tokens_per_s(self, tokens: int) -> float:
        """Throughput for ``tokens`` processed per call (the global batch's tokens)."""
        return tokens / self.step_s

    def mfu(self, model_flops: float, dtype: str = "bfloat16") -> float:
        """Model FLOPs utilisation: ``model_flops`` (the whole model's, all ranks, per call; e.g. 6 N T for a
        training step) over the step time and every rank's ``dtype`` peak."""
        ranks = self.hardware.ranks_per_node if self.hardware.devices is None else self.hardware.devices
        return model_flops / (self.step_s * self.hardware.peak_flops(dtype) * max(ranks, 1))

    def by_op(self) -> dict[str, float]:
        """Predicted seconds per op (compute and communication), costliest first."""
        totals: dict[str, float] = {}
        for c in self.instrs:
            totals[c.op] = totals.get(c.op, 0.0) + (c.compute_s + c.comm_s + c.wait_s) * c.trips
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def __str__(self):
        lines = [f"predicted on {self.hardware.name} (rank {self.rank}): step {self.step_s * 1e3:.3f} ms = compute "
                 f"{self.compute_s * 1e3:.3f} ms + exposed communication {self.exposed_comm_s * 1e3:.3f} ms (of "
                 f"{self.comm_s * 1e3:.3f} ms{self._waits()}); {self.flops / 1e9:.3f} GFLOP per rank; {self.verdict}"]
        lines += [f"  {op:24s} {s * 1e3:10.3f} ms" for op, s in list(self.by_op().items())[:8]]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


    def _waits(self) -> str:
        return f", plus {self.wait_s * 1e3:.3f} ms waiting for descheduled peers" if self.wait_s else ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def estimate(program, hardware: Hardware, rank: int = 0) -> Estimate:
    """``program``'s predicted call on ``hardware`` as ``rank`` runs it (see the module doc)."""
    hardware.check_mesh(program.mesh)
    if not 0 <= rank < program.mesh.size:
        raise ValueError(f"estimate's rank must be one of the mesh's 0..{program.mesh.size - 1}; got {rank}")
    walk = _Walk(program.mesh, hardware, rank)
    step = walk.run(program, 1)
    return Estimate(hardware, rank, step, walk.compute_s, walk.comm_s, walk.flops, program.peak_bytes(),
                    walk.costs, walk.notes, walk.wait_s)


class _Walk:
    """One rank's timeline: a compute clock and one communication channel."""

    def __init__(self, mesh, hardware: Hardware, rank: int):
        self.mesh, self.hw, self.rank = mesh, hardware, rank
        self.units = hardware.units_of(rank, mesh.size)
        self.overhead = hardware.overhead_at(1.0 / self.units)  # ranks taking turns on a core: measured per turn
        self.compute_s = self.comm_s = self.flops = self.wait_s = 0.0
        self.since_sync = 0.0  # this rank's compute seconds since it last synced with a peer (sync_wait_s)
        self.costs: list[InstrCost] = []
        self.notes: list[str] = []

    def run(self, program, trips: int) -> float:
        """Seconds of one pass over ``program`` (its costs recorded ``trips`` times)."""
        shapes = {i.out: (i.shape, i.dtype) for i in program.instrs}
        clock = channel = 0.0
        pending: dict[int, tuple[float, int]] = {}  # a start's slot -> (its channel finish, the ranks it syncs)
        for ins in program.instrs:
            kind = KINDS.get(ins.op) or BY_START.get(ins.op)
            if kind is not None:
                seconds, link, k = self._collective(kind, ins, shapes)
                blocking = ins.op not in BY_START
                wait = self._sync(k) if blocking else 0.0
                self._record(InstrCost(ins.op, ins.out, 0.0, 0.0, 0.0, seconds, link, trips, wait), trips)
                channel = max(clock, channel) + seconds
                if blocking:
                    clock = channel = channel + wait
                else:
                    if link == "node" and not self.hw.overlap:  # the rank's own core moves it, in its MPI calls
                        clock = channel
                    pending[ins.out] = (channel, k)
            elif ins.op in BY_DONE:
                done, k = pending.pop(ins.args[0], (clock, 1))
                wait = self._sync(k)
                if wait:
                    self._record(InstrCost(ins.op, ins.out, 0.0, 0.0, 0.0, 0.0, "", trips, wait), trips)
                clock = max(clock, done) + wait
            else:
                seconds = self._compute(ins, shapes, trips)
                clock += seconds
                self.since_sync += seconds
        return max(clock, channel)

    def _sync(self, k: int) -> float:
        """The wait at a sync with ``k`` ranks (a blocking collective, a start's done), which ends the rank's
        compute since its last one. A loop's body is walked once, so its first sync is charged as on the first
        trip (after the compute before the loop), not as later trips see it (after the body's tail)."""
        wait = self.hw.sync_wait_s(self.rank, self.mesh.size, k, self.since_sync) if k > 1 else 0.0
        if k > 1:
            self.since_sync = 0.0
        return wait

    def _record(self, cost: InstrCost, trips: int) -> None:
        self.costs.append(cost)
        self.compute_s += cost.compute_s * trips
        self.comm_s += cost.comm_s * trips
        self.flops += cost.flops * trips
        self.wait_s += cost.wait_s * trips

    def _compute(self, ins, shapes, trips: int) -> float:
        bodies = [v for v in ins.attrs.values() if hasattr(v, "instrs")]
        bodies += [b for v in ins.attrs.values() if isinstance(v, tuple) for b in v if hasattr(b, "instrs")]
        if bodies:
            return self._control(ins, bodies, trips)
        if ins.op in FREE:
            return 0.0
        flops, nbytes = _flops_and_bytes(ins, shapes)
        threaded = min(self.units, self.hw.threads_per_rank) if self.units > 1 and ins.op in BLAS else 1.0
        rate = self.hw.peak_flops(ins.dtype) * threaded
        if ins.op == EINSUM.name:
            rate *= self.hw.gemm_fraction(_smallest_matmul_dim(ins.attrs["spec"], [shapes[a][0] for a in ins.args]))
        seconds = max(flops / rate, nbytes / self.hw.memory_bandwidth) + self.overhead
        seconds /= min(self.units, 1.0)  # ranks sharing a core take turns on it
        self._record(InstrCost(ins.op, ins.out, flops, nbytes, seconds, 0.0, "", trips), trips)
        return seconds

    def _control(self, ins, bodies, trips: int) -> float:
        if ins.op == SCAN.name:
            n = int(ins.attrs.get("length", 1))
            return n * sum(self.run(b, trips * n) for b in bodies)
        if ins.op == WHILE.name:
            self.notes.append(f"while loop %{ins.out}: its body counted once (the trip count is known only at run "
                              f"time)")
        if ins.op == COND.name:
            return max(self.run(b, trips) for b in bodies)
        return sum(self.run(b, trips) for b in bodies)

    def _collective(self, kind, ins, shapes) -> tuple[float, str, int]:
        """(seconds, "node" | "network", the ranks it syncs with this one) of one collective for this rank."""
        if kind.group == WORLD:
            pairs = [p for p in ins.attrs.get("pairs", ()) if self.rank in p]
            ranks = {r for p in pairs for r in p} or {self.rank}
            k, messages = self.mesh.size, max(len(pairs), 1)
        else:
            axes = tuple(ins.attrs.get("axes", ()))
            ranks = self._group(axes)
            k = len(ranks)
            messages = kind.messages(k)
        arg_bytes = _nbytes(*shapes[ins.args[0]]) if ins.args else 0
        wire = wire_bytes(kind.name, k, arg_bytes, _nbytes(ins.shape, ins.dtype), ins.attrs.get("wire_bytes"))
        link: Link = self.hw.link_for(ranks)
        inside = link is self.hw.intra
        # inside a node the ranks' CPUs copy the bytes (shared memory): ranks sharing a core take turns at it
        shared = min(self.units, 1.0) if inside else 1.0
        seconds = link.seconds(wire, messages) / shared if wire else 0.0
        return seconds, ("node" if inside else "network"), len(ranks)

    def _group(self, axes: tuple) -> list[int]:
        """The ranks of this rank's group over mesh ``axes``."""
        coords = self.mesh.coords(self.rank)
        sizes = [self.mesh.shape[self.mesh.axis_index(a)] for a in axes]
        return [self.mesh.rank_at({**coords, **dict(zip(axes, idx))}) for idx in itertools.product(*map(range, sizes))]


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def _flops_and_bytes(ins, shapes) -> tuple[float, float]:
    """An instruction's FLOPs and the bytes it reads and writes."""
    nbytes = _nbytes(ins.shape, ins.dtype) + sum(_nbytes(*shapes[a]) for a in ins.args if a in shapes)
    if ins.op == DYNAMIC_SLICE.name:  # reads its window only
        return 0.0, 2.0 * _nbytes(ins.shape, ins.dtype)
    if ins.op == DYNAMIC_UPDATE_SLICE.name and ins.donate == 0:  # in place: the update read, its window written
        return 0.0, 2.0 * _nbytes(*shapes[ins.args[1]]) if ins.args[1] in shapes else nbytes
    if ins.op == EINSUM.name:
        return _einsum_flops(ins.attrs["spec"], [shapes[a][0] for a in ins.args]), nbytes
    if ins.op == CONV.name:  # kernel (out, in / groups, *window): a multiply-add per output, input channel, tap
        return 2.0 * math.prod(ins.shape) * math.prod(shapes[ins.args[1]][0][1:]), nbytes
    if ins.op in (FUSION.name, FUSED_REDUCE.name):  # "t0=mul(p0,p1);t1=exp(t0)": one FLOP per op and element
        elements = math.prod(ins.attrs.get("chain_shape", ins.shape))
        return float(ins.attrs.get("code", "").count("(") * elements), nbytes
    return float(math.prod(ins.shape)), nbytes


def _einsum_sizes(spec: str, operands) -> tuple[list[str], str, dict[str, int]]:
    """(the input terms, the output term, each index's size) of an einsum on operands of these shapes."""
    inputs, output = spec.split("->")
    terms = inputs.split(",")
    sizes: dict[str, int] = {}
    for labels, shape in zip(terms, operands):
        sizes.update(zip(labels, shape))
    return terms, output, sizes


def _einsum_flops(spec: str, operands) -> float:
    """2 x the product of every index's size when some index is summed (a multiply-add each), else the product."""
    _, output, sizes = _einsum_sizes(spec, operands)
    total = float(math.prod(sizes.values()))
    return 2 * total if set(sizes) - set(output) else total


def _smallest_matmul_dim(spec: str, operands) -> int:
    """The smallest of the stacked matmul's rows (a's free letters), columns (b's) and summed length an einsum
    runs as (ops/einsum.py); an einsum without one of them (a product, a dot per element) is no matmul: it gets
    the full rate, and the roofline's bytes term prices it."""
    terms, output, sizes = _einsum_sizes(spec, operands)
    if len(terms) != 2:
        return 1 << 30
    a, b = terms
    groups = ([c for c in a if c not in b], [c for c in b if c not in a], [c for c in a if c in b and c not in output])
    if not all(groups):
        return 1 << 30
    return min(math.prod(sizes[c] for c in g) for g in groups)
