"""Hardware profiles: what a cluster's devices and links can do, for predicting a program's step before running it.

A profile is a small JSON file (format ``spmd_runtime.hardware``)::

    {"format": "spmd_runtime.hardware", "name": "dgx-a100-80gb",
     "device":  {"flops": {"bfloat16": 312e12, "float32": 19.5e12, ...},   # dense peak FLOP/s per dtype
                 "memory_bytes": 85899345920, "memory_bandwidth": 2.039e12, "source": "..."},
                 # optional "gemm_efficiency": {"32": 0.6, "128": 0.9, ...}: the fraction of "flops" a matmul
                 # reaches when its smallest dim (rows, columns or the summed length) is that (default: 1)
     "node":    {"ranks": 8, "link": {"bandwidth": 300e9, "latency": 3e-6}, "source": "..."},  # inside a node
                 # optional "cores": compute units a node runs at once (default: "ranks", one device each)
                 # optional "slice_s": how long a computing rank keeps a shared core (default DEFAULT_SLICE_S)
                 # optional "slice_s_by_ranks_per_core": {"2": 2e-5, "4": [[4e-4, 2e-4], [0.008, 3.7e-3]]}:
                 # slice_s as measured with that many ranks per core (calibrate, as the job placed them), a
                 # number or [compute since the last sync, slice_s] points; interpolated between; over "slice_s"
                 # optional "overlap": false where a node's messages move only inside the ranks' MPI calls,
                 # on their own cores (default: false when "cores" is given, a CPU host; else true)
     "network": {"bandwidth": 25e9, "latency": 5e-6, "source": "..."},   # between nodes, per rank, each way
     "nodes": 16,            # optional: the cluster's node count (a mesh must then have nodes x ranks devices)
     "overhead_s": 5e-6,     # what one instruction costs beyond its FLOPs and bytes (a launch, a dispatch)
     "overhead_s_by_ranks_per_core": {"4": 6e-6}}  # optional: as measured with ranks sharing cores (calibrate
                             # --sharing-only), per core's turn; interpolated from overhead_s at one per core

Bandwidths are bytes per second one rank sends (each way); ``source`` strings say where each value comes from.
Shipped profiles (``spmd_runtime/hardware_profiles/``): ``dgx-a100-80gb``, ``dgx-h100``, ``tpu-v3``;
``python -m spmd_runtime calibrate --hardware FILE`` writes one for the machine it runs on. Ranks are placed on
nodes in rank order (ranks 0..R-1 on the first node), as MPI launchers place them by default.

``device.flops`` is one compute unit's rate. A node has ``node.cores`` units (a GPU each on a DGX, where it is
``node.ranks``; a CPU core on a CPU host). A rank on a node holding R ranks gets cores / R units: under one
(ranks share cores, as 8 ranks on a 2-core laptop) every instruction of it runs that much slower; over one
(fewer ranks than cores) its einsums and convolutions run on up to ``threads_per_rank`` of them (BLAS threads).
When ranks share a core, a rank that blocks at a collective often waits for a peer that is not running: the peer
runs only once the scheduler takes its core from the rank holding it, after ``node.slice_s`` at most
(``sync_wait_s``: the cost of one blocking collective for the rank's placement, group size and compute since its
last sync: the longer the ranks compute apart, the further their turns on the shared cores drift). How long that is
depends on the machine's other load more than on its kernel: a rank blocked in MPI that hands its core to a
core-mate of its own job costs nothing (calibrate measured 0 on a quiet 2-core host), a foreign process that
takes the core keeps it to the scheduler's next tick (4 ms); calibrate measures it as the job sees it.
On a CPU host (``node.overlap`` false) a collective inside a node does not overlap the rank's compute: its own
core copies and reduces the bytes, inside its MPI calls.
A matmul whose smallest dim is small (attention's head dim, a gradient's narrow side) runs below the peak: the
profile's ``gemm_efficiency`` points say how far, interpolated in the dim's logarithm (``gemm_fraction``).
``with_placement(ranks, threads)`` says how a job places its ranks and threads (``scripts/bench_train.py
--predict`` gives its own); a profile file holds neither.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import numpy as np

FORMAT = "spmd_runtime.hardware"
# The worst case, for a profile without "node.slice_s": a process computing on a shared core keeps it until the
# scheduler's next tick (Linux's EEVDF base slice, 0.75 ms x (1 + log2 cores), is enforced at ticks: 4 ms at
# CONFIG_HZ=250, common distribution kernels' and this VM's). calibrate measures the job's own (calibrate.py
# ``shared_core_slice``: ranks sharing cores as placed, or two on one core).
DEFAULT_SLICE_S = 4e-3
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware_profiles")


@dataclass(frozen=True)
class Link:
    """A link: ``bandwidth`` bytes/s one rank sends each way, ``latency`` seconds per message."""
    bandwidth: float
    latency: float

    def __repr__(self):
        return f"Link({self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us)"

    def seconds(self, wire_bytes: float, messages: int) -> float:
        return messages * self.latency + wire_bytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """One cluster: its devices (FLOP/s per dtype, memory), ``ranks_per_node``, the links inside a node
    (``intra``) and between nodes (``inter``), and optionally how many ``nodes`` it has."""
    name: str
    flops: tuple  # ((dtype name, FLOP/s), ...): a tuple so the profile stays hashable
    memory_bytes: int
    memory_bandwidth: float
    ranks_per_node: int
    intra: Link
    inter: Link
    nodes: int | None = None
    overhead_s: float = 0.0
    sources: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    cores_per_node: int | None = None  # compute units per node; None: ranks_per_node (one device per rank)
    threads_per_rank: int = 1  # a job's BLAS threads per rank (placement, not in the file)
    slice_s: float = DEFAULT_SLICE_S  # how long a computing rank keeps a core its peers share (module doc)
    overlap: bool = True  # messages inside a node move while the rank computes (False: only in its MPI calls)
    gemm_efficiency: tuple = ()  # ((smallest dim, fraction of the peak), ...) ascending; () : the peak at any size
    slices: tuple = ()  # ((ranks per core, ((compute since the last sync, slice_s), ...)), ...) ascending, as
    # measured so; (): slice_s at any sharing and compute
    overheads: tuple = ()  # ((ranks per core, overhead_s measured so), ...) ascending; (): overhead_s at any

    def __repr__(self):
        nodes = f" x {self.nodes} nodes" if self.nodes else ""
        return f"Hardware({self.name}: {self.ranks_per_node} per node{nodes}, {self.memory_bytes / 2**30:g} GiB)"

    @property
    def devices(self) -> int | None:
        return None if self.nodes is None else self.nodes * self.ranks_per_node

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (a dtype without its own rate runs at float32's)."""
        rates = dict(self.flops)
        rate = rates.get(str(dtype)) or rates.get("float32")
        if rate is None:
            raise ValueError(f"hardware profile {self.name!r} gives no FLOP/s for {dtype} nor float32; got rates "
                             f"for {sorted(rates)}")
        return rate

    def gemm_fraction(self, smallest: int) -> float:
        """The fraction of the peak a matmul reaches whose smallest dim is ``smallest``: the profile's points
        interpolated in log(dim), the end points' values beyond them (1.0 without points)."""
        logs = tuple((math.log(d), f) for d, f in self.gemm_efficiency)
        return _interpolated(logs, math.log(max(smallest, 1))) if logs else 1.0

    @property
    def cores(self) -> int:
        return self.ranks_per_node if self.cores_per_node is None else self.cores_per_node

    def units_of(self, rank: int, world: int) -> float:
        """Compute units ``rank`` gets in a job of ``world`` ranks: its node's cores over the ranks placed there."""
        node = self.node_of(rank)
        placed = min(self.ranks_per_node, world - node * self.ranks_per_node)
        return self.cores / max(placed, 1)

    def sync_wait_s(self, rank: int, world: int, k: int, since_s: float = 0.0) -> float:
        """Expected seconds ``rank`` waits at one blocking collective over a group of ``k`` for a peer that shares a
        core and is not running, ``since_s`` seconds of the rank's compute after its last sync: 0 with a core per
        rank (or no peer). The collective ends once its last peer gets there; with p ranks per core that peer is
        off its core with probability (p - 1) / p, behind a computing core-mate that keeps the core up to
        ``slice_at(p, since_s)`` (calibrate: the wait per all-reduce of ranks sharing cores, over the (p - 1) / p
        of the sharing it was timed at; the ticks of a node's cores are aligned, so peers off several cores come
        back together)."""
        p = 1.0 / self.units_of(rank, world)
        if p <= 1.0 or k <= 1:
            return 0.0
        return self.slice_at(p, since_s) * (p - 1.0) / p

    def slice_at(self, per_core: float, since_s: float = 0.0) -> float:
        """``slice_s`` for ``per_core`` ranks per core, ``since_s`` seconds of compute after the last sync: the
        measured ``slices`` interpolated (linear in the compute since the sync, then in the ranks per core; the end
        points' values beyond them), else ``slice_s``. The wait grows with both: the ranks drift apart on their
        shared cores while they compute (at four per core ~0.3 of the compute's wall time up to ~8 ms of it, less
        beyond), and faster than the (p - 1) / p of ``sync_wait_s`` (docs/BENCHMARKS.md, sessions 16 and 18)."""
        if not self.slices:
            return self.slice_s
        return _interpolated(tuple((q, _interpolated(curve, since_s)) for q, curve in self.slices), per_core)

    def overhead_at(self, per_core: float) -> float:
        """``overhead_s`` for ``per_core`` ranks per core: ranks taking turns on a core each run an instruction
        slower than alone beyond their share of it (the interpreter's state evicted by its core-mates: 4.4 us of CPU
        alone, 5.1 at two per core, 6.1 at four, here); interpolated between ``overhead_s`` at one per core and the measured
        ``overheads``, the last held beyond them."""
        if not self.overheads or per_core <= 1:
            return self.overhead_s
        return _interpolated(((1.0, self.overhead_s),) + self.overheads, per_core)

    def with_sharing(self, per_core: float, slice_s, overhead_s: float | None = None) -> "Hardware":
        """The profile with what ``per_core`` ranks per core were measured to cost added (replacing any measured at
        the same sharing): the slice (seconds, or ``((compute since the last sync, seconds), ...)``) to ``slices``,
        the per-instruction overhead to ``overheads``."""
        def put(points, value):
            kept = [(q, v) for q, v in points if q != per_core]
            return tuple(sorted(kept + [(float(per_core), value)]))
        return replace(self, slices=put(self.slices, _curve(slice_s)),
                       overheads=self.overheads if overhead_s is None else put(self.overheads, float(overhead_s)))

    def with_placement(self, ranks_per_node: int, threads_per_rank: int = 1) -> "Hardware":
        """The same machine (its cores unchanged) with a job's placement: ``ranks_per_node`` ranks on each node,
        ``threads_per_rank`` BLAS threads each."""
        if ranks_per_node < 1 or threads_per_rank < 1:
            raise ValueError(f"with_placement needs at least 1 rank per node and 1 thread per rank; got "
                             f"{ranks_per_node} and {threads_per_rank}")
        return replace(self, ranks_per_node=int(ranks_per_node), cores_per_node=self.cores,
                       threads_per_rank=int(threads_per_rank))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link_for(self, ranks) -> Link:
        """The link a collective among ``ranks`` is limited by: inside one node, or between nodes."""
        return self.intra if len({self.node_of(r) for r in ranks}) <= 1 else self.inter

    def check_mesh(self, mesh) -> None:
        """A mesh must have the profile's device count when the profile says how many nodes it has."""
        if self.devices is not None and mesh.size != self.devices:
            raise ValueError(f"a mesh on hardware {self.name!r} has its {self.nodes} nodes x {self.ranks_per_node} "
                             f"ranks = {self.devices} devices; got a mesh of {mesh.size} ({mesh}) (use "
                             f"hardware.with_nodes(n), or a profile without 'nodes')")

    def with_nodes(self, nodes: int | None) -> "Hardware":
        return replace(self, nodes=nodes)

    # ------------------------------------------------------------ files
    @classmethod
    def load(cls, name_or_path) -> "Hardware":
        """A shipped profile by name (``"dgx-a100-80gb"``) or a profile file's path."""
        path = str(name_or_path)
        if not os.path.exists(path):
            shipped = os.path.join(SHIPPED, f"{path}.json")
            if not os.path.exists(shipped):
                raise ValueError(f"a hardware profile is a file or a shipped name ({', '.join(shipped_names())}); "
                                 f"got {name_or_path!r}")
            path = shipped
        with open(path) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"hardware profile {path} must be JSON; got {e}") from None
        return cls.from_json(doc, path)

    @classmethod
    def from_json(cls, doc: dict, where: str = "the profile") -> "Hardware":
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"a hardware profile has format {FORMAT!r}; got "
                             f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r} in {where}")
        read = _Reader(doc, where)
        flops = read.section("device.flops")
        if not flops:
            raise ValueError(f"hardware profile field device.flops needs at least one dtype's FLOP/s; got {{}} in "
                             f"{where}")
        nodes = doc.get("nodes")
        return cls(name=str(read.value("name", str)),
                   flops=tuple(sorted((str(k), read.positive(f"device.flops.{k}")) for k in flops)),
                   memory_bytes=int(read.positive("device.memory_bytes")),
                   memory_bandwidth=read.positive("device.memory_bandwidth"),
                   ranks_per_node=read.count("node.ranks"),
                   intra=Link(read.positive("node.link.bandwidth"), read.non_negative("node.link.latency")),
                   inter=Link(read.positive("network.bandwidth"), read.non_negative("network.latency")),
                   nodes=None if nodes is None else read.count("nodes"),
                   overhead_s=read.non_negative("overhead_s") if "overhead_s" in doc else 0.0,
                   sources=read.sources(),
                   cores_per_node=read.count("node.cores") if "cores" in doc.get("node", {}) else None,
                   slice_s=read.non_negative("node.slice_s") if "slice_s" in doc.get("node", {}) else DEFAULT_SLICE_S,
                   overlap=read.flag("node.overlap") if "overlap" in doc.get("node", {}) else
                   "cores" not in doc.get("node", {}),
                   gemm_efficiency=read.efficiency("device.gemm_efficiency")
                   if "gemm_efficiency" in doc.get("device", {}) else (),
                   slices=read.slice_curves("node.slice_s_by_ranks_per_core")
                   if "slice_s_by_ranks_per_core" in doc.get("node", {}) else (),
                   overheads=read.per_core("overhead_s_by_ranks_per_core")
                   if "overhead_s_by_ranks_per_core" in doc else ())

    def to_json(self) -> dict:
        doc = {"format": FORMAT, "name": self.name,
               "device": {"flops": dict(self.flops), "memory_bytes": self.memory_bytes,
                          "memory_bandwidth": self.memory_bandwidth},
               "node": {"ranks": self.ranks_per_node,
                        "link": {"bandwidth": self.intra.bandwidth, "latency": self.intra.latency}},
               "network": {"bandwidth": self.inter.bandwidth, "latency": self.inter.latency},
               "overhead_s": self.overhead_s}
        if self.nodes is not None:
            doc["nodes"] = self.nodes
        if self.cores_per_node is not None:
            doc["node"]["cores"] = self.cores_per_node
        if self.slice_s != DEFAULT_SLICE_S:
            doc["node"]["slice_s"] = self.slice_s
        doc["node"]["overlap"] = self.overlap
        if self.gemm_efficiency:
            doc["device"]["gemm_efficiency"] = {str(d): f for d, f in self.gemm_efficiency}
        if self.slices:
            doc["node"]["slice_s_by_ranks_per_core"] = {f"{q:g}": curve[0][1] if len(curve) == 1 else
                                                        [list(point) for point in curve] for q, curve in self.slices}
        if self.overheads:
            doc["overhead_s_by_ranks_per_core"] = {f"{q:g}": v for q, v in self.overheads}
        for where, text in self.sources.items():
            _at(doc, where)["source"] = text
        return doc

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")


def _curve(slice_s) -> tuple:
    """A slice as ``slices`` holds it: ``((compute since the last sync, seconds), ...)`` ascending; a number is
    one point, the same after any compute."""
    if isinstance(slice_s, (int, float)):
        return ((0.0, float(slice_s)),)
    return tuple(sorted((float(since), float(seconds)) for since, seconds in slice_s))


def _interpolated(points: tuple, x: float) -> float:
    """The piecewise-linear value at ``x`` of ascending ``(x, y)`` points, the end points' values beyond them."""
    return float(np.interp(x, [a for a, _ in points], [b for _, b in points]))


def shipped_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(SHIPPED) if f.endswith(".json"))


def _at(doc: dict, where: str) -> dict:
    node = doc
    for key in where.split(".") if where else []:
        node = node[key]
    return node


def _seconds(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < math.inf


def _ascending_points(v) -> bool:
    return (isinstance(v, list) and bool(v) and all(isinstance(p, list) and len(p) == 2 and all(map(_seconds, p))
                                                    for p in v) and all(a[0] < b[0] for a, b in zip(v, v[1:])))


class _Reader:
    """Fields of a profile document by dotted path, each checked, the error naming the field and the file."""

    def __init__(self, doc: dict, where: str):
        self.doc, self.where = doc, where

    def _at(self, path: str):
        node = self.doc
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"hardware profile field {path} is required; got none in {self.where}")
            node = node[key]
        return node

    def value(self, path: str, kind=(int, float)):
        node = self._at(path)
        if not isinstance(node, kind) or isinstance(node, bool):
            raise ValueError(f"hardware profile field {path} must be a {getattr(kind, '__name__', 'number')}; got "
                             f"{node!r} in {self.where}")
        return node

    def flag(self, path: str) -> bool:
        v = self._at(path)
        if not isinstance(v, bool):
            raise ValueError(f"hardware profile field {path} must be true or false; got {v!r} in {self.where}")
        return v

    def section(self, path: str) -> dict:
        return self.value(path, dict)

    def positive(self, path: str) -> float:
        v = float(self.value(path))
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"hardware profile field {path} must be a positive number; got {v!r} in {self.where}")
        return v

    def non_negative(self, path: str) -> float:
        v = float(self.value(path))
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"hardware profile field {path} must be zero or more; got {v!r} in {self.where}")
        return v

    def efficiency(self, path: str) -> tuple:
        """{"dim": fraction, ...}: whole dims of at least 1, fractions above 0 and at most 1, ascending by dim."""
        points = []
        for key in self.section(path):
            if not (key.isdigit() and int(key) >= 1):
                raise ValueError(f"hardware profile field {path} is keyed by a matmul's smallest dim, a whole "
                                 f"number of at least 1; got key {key!r} in {self.where}")
            f = self.positive(f"{path}.{key}")
            if f > 1:
                raise ValueError(f"hardware profile field {path}.{key} is a fraction of the peak, at most 1; got "
                                 f"{f!r} in {self.where}")
            points.append((int(key), f))
        return tuple(sorted(points))

    def per_core(self, path: str) -> tuple:
        """{"ranks per core": seconds, ...}: ranks per core a number above 1, seconds zero or more."""
        points = []
        for key, seconds in self.section(path).items():  # keys such as "1.5": not dotted paths
            if not _seconds(seconds):
                raise ValueError(f"hardware profile field {path}[{key!r}] must be zero or more seconds; got "
                                 f"{seconds!r} in {self.where}")
            points.append((self._per_core_key(path, key), float(seconds)))
        return tuple(sorted(points))

    def slice_curves(self, path: str) -> tuple:
        """{"ranks per core": seconds or [[compute since the last sync, seconds], ...], ...}: as ``per_core``, a
        curve's points pairs of zero or more seconds, their compute ascending."""
        curves = []
        for key, value in self.section(path).items():
            if not (_seconds(value) or _ascending_points(value)):
                raise ValueError(f"hardware profile field {path}[{key!r}] must be zero or more seconds, or a list of "
                                 f"[compute since the last sync, seconds] pairs of zero or more, the compute "
                                 f"ascending; got {value!r} in {self.where}")
            curves.append((self._per_core_key(path, key), _curve(value)))
        return tuple(sorted(curves))

    def _per_core_key(self, path: str, key: str) -> float:
        try:
            per_core = float(key)
        except ValueError:
            per_core = math.nan
        if not per_core > 1:
            raise ValueError(f"hardware profile field {path} is keyed by ranks per core, a number above 1; got "
                             f"key {key!r} in {self.where}")
        return per_core

    def count(self, path: str) -> int:
        v = self.value(path)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"hardware profile field {path} must be a whole number of at least 1; got {v!r} in "
                             f"{self.where}")
        return v

    def sources(self) -> dict:
        return {where: _at(self.doc, where)["source"] for where in ("", "device", "node", "network")
                if isinstance(_at(self.doc, where).get("source"), str)}
