"""Measure the cost model on this machine: alpha (latency) and beta (seconds per wire byte) of every
collective, per group size, on the actual MPI (``mpiexec -n N python -m spmd_runtime calibrate``).

For each group size k dividing the world (k > 1), the world becomes a (N / k, k) mesh and each collective
runs over its k-axis on float32 messages of several sizes, bound once as the interpreter binds them; the
time of a size is the best of ``repeats`` calls (each started together after a barrier and timed on its
slowest rank), after one warm-up call; a shared, noisy machine inflates it. alpha and beta
come from a least-squares line through (wire bytes, seconds), clamped at zero. Rank 0 writes the profile
that ``partition(..., cost_profile=PATH)`` or ``$SPMD_COST_PROFILE`` then uses (cost.CostModel).

``hardware_profile`` then describes the machine for the predictor (``hardware.Hardware``, ``estimate.py``):
GEMM FLOP/s per dtype (and the fraction of it a matmul with a small dim reaches), memory bandwidth, the
interpreter's cost per instruction, the links inside a node and between nodes from all-reduce fits split by rank
placement, and what a blocking collective costs ranks that share a core (``Hardware.sync_wait_s``)
(``--hardware FILE`` on the command line).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from .collective_kinds import ALL_REDUCE, KINDS as TABLE, WORLD
from .comm import collectives, watchdog
from .comm.communicator import world
from .cost import PROFILE_FORMAT, SECONDS_PER_BYTE, CostModel, wire_bytes
from .exec.runner import communicator, run_local
from .graph import TensorSpec
from .hardware import DEFAULT_SLICE_S, Hardware, Link
from .mesh import Mesh
from .partition import partition
from .trace import trace

KINDS = tuple(name for name, kind in TABLE.items() if not kind.exchange)  # every kind collectives.bind runs
DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20)  # bytes each rank puts in


def calibrate(comm=None, sizes=DEFAULT_SIZES, repeats: int = 5, kinds=KINDS) -> dict:
    """The profile document (same on every rank): one fit per (collective, group size)."""
    comm = world(comm)
    size = comm.Get_size()
    fits, samples = [], []
    for k in (d for d in range(2, size + 1) if size % d == 0):
        mc = communicator(Mesh((size // k, k), ("rest", "group")), comm)
        for kind in kinds:
            points = [(_wire(kind, k, n), _time(mc, comm, kind, k, n, repeats)) for n in sizes]
            alpha, beta = _fit_line(points)
            fits.append({"op": kind, "k": k, "alpha": alpha, "beta": beta})
            samples += [{"op": kind, "k": k, "wire_bytes": w, "seconds": t} for w, t in points]
    return {"format": PROFILE_FORMAT, "version": 1, "world_size": size, "repeats": repeats,
            "fits": fits, "samples": samples}


def write_profile(doc: dict, path) -> CostModel:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return CostModel.load(path)


def _elements(kind, k, nbytes) -> int:
    """float32 elements per rank: at least k, a multiple of k (the collectives cut the buffer in k blocks)."""
    return max(k, nbytes // 4 // k * k)


def _wire(kind, k, nbytes) -> float:
    """Wire bytes of one timed call: the kind's formula on its result shape (collective_kinds.py)."""
    elements, spec = _elements(kind, k, nbytes), TABLE[kind]
    out = math.prod(spec.result_shape((elements,), k, dict(spec.calibration)))
    return wire_bytes(kind, k, elements * 4, out * 4)


def _attrs(kind, mc, k):
    axes, spec = ("group",), TABLE[kind]
    if spec.group == WORLD:  # a shift by one within every group: each rank sends and receives once
        mesh = mc.mesh
        return {"pairs": [(g[i], g[(i + 1) % k]) for g in mesh.groups(axes) for i in range(k)]}
    return {"axes": axes, **dict(spec.calibration)}


@watchdog.collective(lambda frame: f"calibrate's timing of {frame.f_locals['kind']} (Barrier, allgather)")
def _time(mc, comm, kind, k, nbytes, repeats) -> float:
    x = np.ones(_elements(kind, k, nbytes), np.float32)
    run = collectives.bind(mc, kind, np, x.shape, x.dtype, **_attrs(kind, mc, k))
    run(x)  # warm-up: sub-communicator split, buffers
    mine = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        run(x)
        mine.append(time.perf_counter() - start)
    return min(max(ts) for ts in zip(*comm.allgather(mine)))


def _fit_line(points) -> tuple[float, float]:
    """(alpha, beta) of seconds = alpha + beta * bytes, least squares, each clamped at zero."""
    w = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    if len(set(w)) < 2:
        return float(t.mean()), 0.0
    beta, alpha = np.polyfit(w, t, 1)
    if beta < 0:
        return float(t.mean()), 0.0
    if alpha < 0:
        return 0.0, float((t * w).sum() / (w * w).sum())
    return float(alpha), float(beta)


# ------------------------------------------------------------ a hardware profile of this machine
GEMM_SIZE = 512  # square matmuls: large enough for BLAS to reach its rate, small enough to take ~1 ms
GEMM_RING_BYTES = 64 << 20  # distinct operands the GEMMs cycle through: far beyond a core's caches, so each
#                             reads its operands from memory as a step's do (the instruction before wrote other
#                             data); one pair of operands, repeated, stays cached and runs ~1.3x faster here
GEMM_DIMS = (16, 32, 64, 128, 256)  # smallest dims timed for the profile's gemm_efficiency (the rest GEMM_SIZE)
COPY_BYTES = 64 << 20  # a copy far larger than the caches: the memory bandwidth


def hardware_profile(doc: dict, comm=None, repeats: int = 5, name: str = "this-machine") -> Hardware:
    """A ``Hardware`` profile of the machine the job runs on (collective; every rank gets it): every rank at
    once (as in a step) times float32 / float64 GEMMs on operands beyond its caches (and float32 ones with a
    small dim, for ``gemm_efficiency``), a copy of ``COPY_BYTES`` and the interpreter's cost of one small
    instruction, the slowest rank counting; the links come from ``doc``'s all-reduce fits, inside a node from the
    groups of node-local ranks and between nodes from an all-reduce over one rank per node."""
    comm = world(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())  # the ranks sharing this rank's memory
    per_node = node.Get_size()
    cores = _cores(node)
    node.Free()
    slowest = lambda seconds: max(comm.allgather(seconds))  # noqa: E731  (every rank's best, the slowest of them)
    with _one_blas_thread():  # one core's rate: the profile's compute unit (hardware.py)
        sharing = max(1.0, per_node / cores)  # ranks taking turns on a core each get 1 / sharing of it
        rate = lambda dtype, dims: sharing * _gemm_flops(dims) / slowest(_best(_gemm(dtype, dims), repeats))  # noqa
        square = (GEMM_SIZE,) * 3
        flops = {d: rate(d, square) for d in ("float32", "float64")}
        efficiency = tuple((d, min(1.0, float(np.mean([rate("float32", _narrow(d, i)) for i in range(3)]))
                                / flops["float32"])) for d in GEMM_DIMS) + ((GEMM_SIZE, 1.0),)
    # per compute unit, as the flops: the predictor charges a rank with 1 / sharing of a core sharing x each of
    # these inside a node (estimate.py), so a job with more ranks than cores must not count the turns twice
    bandwidth = sharing * 2 * COPY_BYTES / slowest(_best(_copy(), repeats))
    overhead = slowest(_instruction_overhead(comm, repeats)) / sharing
    node_link = _link(doc, min(per_node, comm.Get_size()))
    intra = Link(node_link.bandwidth * sharing, node_link.latency / sharing)
    nodes = comm.Get_size() // per_node
    inter = _inter_link(comm, per_node, nodes, repeats) if nodes > 1 else intra
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node
    per_core, curve = shared_core_slice(comm)
    sources = {"": f"measured by `python -m spmd_runtime calibrate --hardware` on {comm.Get_size()} rank(s), "
                   f"{per_node} per node", "device": f"{GEMM_SIZE}^3 GEMMs over {GEMM_RING_BYTES >> 20} MiB of "
                   f"operands (gemm_efficiency: one dim {'/'.join(map(str, GEMM_DIMS))}, the mean of it as rows, "
                   f"columns and summed length) and a {COPY_BYTES >> 20} MiB copy on every rank at once (the slowest "
                   f"rank); memory: the node's RAM over its ranks",
               "node": "the all-reduce fit of a group of node-local ranks", "network":
               "an all-reduce over one rank per node" if nodes > 1 else "one node only: the node's link"}
    sources["device"] += f"; one BLAS thread, {cores} cores per node"
    placement = f"as placed, {per_node} on {cores} cores" if per_node > cores else "two on one core"
    sources["node"] += (f"; slice_s: the wait per all-reduce of ranks computing {placement}, over (p - 1) / p, "
                        f"after chunks of {'/'.join(f'{c * 1e3:g}' for c in SLICE_CHUNKS_S)} ms of CPU each (the "
                        f"longest's slice as slice_s)" if per_core else
                        "; slice_s: the default (one rank: no peer to time)")
    measured = Hardware(name, tuple(sorted(flops.items())), int(memory), bandwidth, per_node, intra, inter,
                        nodes if nodes > 1 else None, overhead, sources, cores,
                        overlap=False,  # MPI over shared memory, no progress thread: messages move in the ranks' calls
                        gemm_efficiency=efficiency)
    if not per_core:
        return measured  # one rank: the default slice
    return replace(measured, slice_s=curve[-1][1]).with_sharing(per_core, curve)


def sharing_costs(comm, repeats: int = 5) -> tuple:
    """Collective: what sharing cores costs this job as placed, for ``Hardware.with_sharing``: (ranks per core,
    the slice's points, the per-instruction overhead per core's turn, or None where the ranks do not share cores as placed:
    then the slice is two ranks' on one core and the overhead is the profile's own)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    sharing = node.Get_size() / _cores(node)
    node.Free()
    per_core, slice_s = shared_core_slice(comm)
    overhead = max(comm.allgather(_instruction_overhead(comm, repeats, typical=True))) if sharing > 1 else None
    return per_core, slice_s, overhead


SLICE_CHUNKS_S = (1e-4, 5e-4, 2e-3, 8e-3)  # each rank's CPU between two all-reduces: a step's compute between syncs
SLICE_BLOCK_CPU_S = 0.04  # each rank's CPU per timed block: the rounds per block (4..100) at each chunk
SLICE_BLOCKS = 5  # blocks timed (the median kept): ~3.5 s in all at four ranks per core, ~1.7 s at two


@watchdog.collective(lambda frame: "calibrate's timing of ranks sharing a core (Barrier, Allreduce, bcast)")
def shared_core_slice(comm, chunks=SLICE_CHUNKS_S) -> tuple:
    """What a blocking collective costs ranks that share a core, as ``Hardware.sync_wait_s`` charges it: ranks
    sharing cores each compute a chunk of each length in ``chunks`` and all-reduce, many times. A round beyond
    their compute over the cores they share is their wait for each other (a rank polling in MPI on the core its
    peer needs; a loaded machine's other processes taking it). It grows with the chunk (the ranks drift apart
    while they compute), so each chunk gives a point (the compute's wall time per round, the slice):
    ``sync_wait_s`` charges (p - 1) / p slices at p ranks per core, so the slice is the wait over that. Where the
    job placed more ranks on the node than it has cores, the node's ranks are timed as placed (p as the job will
    run; the wait grows faster than (p - 1) / p: with four per core it is several times what two on one core
    show); else ranks 0 and 1 move onto one core (p = 2). Every rank gets rank 0's (ranks per core, the points);
    one rank: (None, ``DEFAULT_SLICE_S``)."""
    if comm.Get_size() < 2:
        return None, DEFAULT_SLICE_S
    rank, mask = comm.Get_rank(), os.sched_getaffinity(0)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cores = _cores(node)
    placed = node.Get_size() > cores
    group = node if placed else comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    try:
        if group != MPI.COMM_NULL:
            if not placed:
                os.sched_setaffinity(0, {min(set().union(*group.allgather(mask)))})
            used = cores if placed else 1
            p = group.Get_size() / used
            measured = (p, tuple((since, wait * p / (p - 1)) for since, wait in
                                 (_shared_wait(group, used, chunk) for chunk in chunks)))
            if group is not node:
                group.Free()
        else:
            measured = None
    finally:
        node.Free()
        os.sched_setaffinity(0, mask)
    return comm.bcast(measured if rank == 0 else None, root=0)


def _shared_wait(group, cores: int, chunk_s: float) -> tuple:
    """(seconds of compute per round, seconds per round beyond it) for ranks computing ``chunk_s`` of CPU each
    between all-reduces, both over the ``cores`` the group shares (the compute's CPU time only: a rank that
    polls in MPI while a core-mate needs the core is part of the wait)."""
    a, buf = np.ones((64, 64), np.float32), np.zeros(1, np.float32)
    trips = max(4, min(100, round(SLICE_BLOCK_CPU_S / chunk_s)))
    computes, waits = [], []
    with _one_blas_thread():
        per_chunk = _matmuls_in(a, chunk_s)
        for _ in range(SLICE_BLOCKS):  # the median block: one block's wait moves ~1.5x between runs
            group.Barrier()
            start, cpu = time.perf_counter(), 0.0
            for _ in range(trips):
                begun = time.process_time()
                for _ in range(per_chunk):
                    a @ a
                cpu += time.process_time() - begun
                group.Allreduce(MPI.IN_PLACE, buf)
            wall = max(group.allgather(time.perf_counter() - start))
            compute = sum(group.allgather(cpu)) / cores
            computes.append(compute / trips)
            waits.append(max(0.0, wall - compute) / trips)
    return float(np.median(computes)), float(np.median(waits))


def _matmuls_in(a, seconds: float) -> int:
    """How many ``a @ a`` take ``seconds`` of this process's CPU."""
    count, start = 0, time.process_time()
    while time.process_time() - start < 0.02:
        a @ a
        count += 1
    return max(1, int(count * seconds / (time.process_time() - start)))


def _cores(node) -> int:
    """The cores the node's ranks may run on: the union of their affinity masks (a launcher that binds each rank
    to one core gives each a mask of one)."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return len(set().union(*node.allgather(mine)))


def _one_blas_thread():
    """GEMMs on one thread each: without it every rank's OpenBLAS starts a thread per core and the ranks of a
    node oversubscribe it (2 ranks x 2 threads on 2 cores measured 11 GFLOP/s a rank instead of ~99)."""
    return threadpool_limits(limits=1, user_api="blas")


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gemm_flops(dims) -> float:
    """FLOPs of one pass of ``_gemm(dtype, dims)``: the ring's matmuls."""
    m, k, n = dims
    return 2.0 * m * k * n * _ring(dims)


def _ring(dims) -> int:
    m, k, n = dims
    return max(2, GEMM_RING_BYTES // (4 * (m * k + k * n + m * n)))


def _narrow(d: int, which: int) -> tuple:
    """(m, k, n) with dim ``which`` (rows, summed length, columns) ``d``, the others ``GEMM_SIZE``."""
    return tuple(d if i == which else GEMM_SIZE for i in range(3))


def _gemm(dtype: str, dims):
    """One pass over a ring of distinct (a, b, out) triples, each matmul reading operands no cache holds."""
    m, k, n = dims
    ring = [(np.ones((m, k), dtype), np.ones((k, n), dtype), np.empty((m, n), dtype)) for _ in range(_ring(dims))]

    def chain():
        for a, b, out in ring:
            np.matmul(a, b, out=out)
    return chain


def _copy():
    src, dst = np.ones(COPY_BYTES // 8), np.empty(COPY_BYTES // 8)
    return lambda: np.copyto(dst, src)


def _instruction_overhead(comm, repeats: int, n: int = 200, typical: bool = False) -> float:
    """Seconds the interpreter spends on one instruction beyond its work: a chain of ``n`` adds of 8 floats, the
    best of ``repeats``; ``typical``: the median of the rank's own CPU time per chain instead, the ranks' chains
    started together (ranks taking turns on a core: a chain is shorter than the scheduler's slice, so its wall
    time says which rank the core ran first; its CPU time is what a turn costs)."""
    def chain(x):
        for _ in range(n):
            x = x + 1.0
        return x
    mesh = Mesh((comm.Get_size(),), ("x",))
    program = partition(trace(chain, TensorSpec((8 * comm.Get_size(),))), mesh, in_specs=[("x",)], fuse=False,
                        overlap=False)
    block = np.ones(8, np.float32)
    if not typical:
        return _best(lambda: run_local(program, block, comm=comm), repeats) / n
    run_local(program, block, comm=comm)  # warm-up
    seconds = []
    for _ in range(max(repeats, 5)):
        comm.Barrier()
        start = time.process_time()
        run_local(program, block, comm=comm)
        seconds.append(time.process_time() - start)
    return float(np.median(seconds)) / n


def _link(doc: dict, k: int) -> Link:
    """The link of an all-reduce fit over ``k`` ranks (the nearest measured group size): an all-reduce sends
    ``ALL_REDUCE.messages(k)`` messages in sequence, so latency = alpha / that, bandwidth = 1 / beta."""
    fits = [f for f in doc["fits"] if f["op"] == ALL_REDUCE.name]
    if not fits or k < 2:
        return Link(SECONDS_PER_BYTE ** -1, 0.0)  # one rank: no link measured, the default model's
    fit = min(fits, key=lambda f: (abs(math.log(f["k"] / k)), f["k"]))
    beta = fit["beta"] or SECONDS_PER_BYTE
    return Link(1 / beta, fit["alpha"] / ALL_REDUCE.messages(fit["k"]))


@watchdog.collective(lambda frame: "calibrate's timing of an all-reduce between nodes (Barrier, allgather)")
def _inter_link(comm, per_node: int, nodes: int, repeats: int) -> Link:
    """An all-reduce over one rank per node (ranks in rank order per node), fitted as ``_link`` does."""
    mc = communicator(Mesh((nodes, per_node), ("node", "local")), comm)
    points = []
    for nbytes in DEFAULT_SIZES:
        x = np.ones(_elements(ALL_REDUCE.name, nodes, nbytes), np.float32)
        run = collectives.bind(mc, ALL_REDUCE.name, np, x.shape, x.dtype, axes=("node",), op="sum")
        comm.Barrier()
        seconds = max(comm.allgather(_best(lambda: run(x), repeats)))
        points.append((wire_bytes(ALL_REDUCE.name, nodes, x.nbytes, x.nbytes), seconds))
    alpha, beta = _fit_line(points)
    return _link({"fits": [{"op": ALL_REDUCE.name, "k": nodes, "alpha": alpha, "beta": beta}]}, nodes)
