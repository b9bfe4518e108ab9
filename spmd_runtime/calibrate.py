"""Measure the cost model on this machine: alpha (latency) and beta (seconds per wire byte) of every
collective, per group size, on the actual MPI (``mpiexec -n N python -m spmd_runtime calibrate``).

For each group size k dividing the world (k > 1), the world becomes a (N / k, k) mesh and each collective
runs over its k-axis on float32 messages of several sizes, bound once as the interpreter binds them; the
time of a size is the best of ``repeats`` calls (each started together after a barrier and timed on its
slowest rank), after one warm-up call; a shared, noisy machine inflates it. alpha and beta
come from a least-squares line through (wire bytes, seconds), clamped at zero. Rank 0 writes the profile
that ``partition(..., cost_profile=PATH)`` or ``$SPMD_COST_PROFILE`` then uses (cost.CostModel).
"""
from __future__ import annotations

import json
import math
import time

import numpy as np

from .collective_kinds import KINDS as TABLE, WORLD
from .comm import collectives, watchdog
from .comm.communicator import world
from .cost import PROFILE_FORMAT, CostModel, wire_bytes
from .exec.runner import communicator
from .mesh import Mesh

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
