"""``sr.autotune``: time autoshard's front-runners on the job's own ranks and take the fastest measured (issue 27).

``autoshard`` ranks layouts by prediction; where predictions are close, or the machine does what the model leaves
out (four ranks to a core polling in MPI: docs/BENCHMARKS.md, session 16), the fastest is found by running them,
as XLA's and cuDNN's autotuners choose among kernels they have timed. ``autotune(found, cfg, comm)`` takes
autoshard's list, keeps the best-predicted fitting candidate of each preset (at most ``limit``; the same program
reached by two presets is timed once), builds each on rank 0 and times ``steps`` steps of each in ``rounds``
interleaved rounds (candidate A, B, ..., A, B, ...: a machine's drift falls on all alike), each round's median step
the slowest rank's, on a fixed random batch. Returns ``Timed`` rows, the fastest minimum over rounds first; rank 0
prints the table with every round. Collective: every rank of a job of the candidates' device count calls it. The
steps run for real, so the model must fit the job's machine: a tuning run at the size of the real one.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from .autoshard import Candidate
from .comm.communicator import world
from .models.lm import LMConfig
from .train import build_train_step_on_root, train_mesh


@dataclass(frozen=True)
class Timed:
    """A candidate and its measured rounds (each the median step of a round, seconds)."""
    candidate: Candidate
    rounds: tuple

    @property
    def best_s(self) -> float:
        return min(self.rounds)

    def __repr__(self):
        c = self.candidate
        return f"Timed({c.preset} {c.mesh_shape} M={c.microbatches}: {self.best_s * 1e3:.2f} ms measured)"


def autotune(found: list[Candidate], cfg: LMConfig, comm=None, *, optimizer=None, limit: int = 8, rounds: int = 3,
             steps: int = 4, warmup: int = 1, threads: int | None = None, verbose: bool = True) -> list[Timed]:
    """The best-predicted candidate of each preset in ``found`` (autoshard's list), timed on ``comm``'s ranks,
    the fastest measured first (module doc). ``threads``: BLAS threads per rank (default: the cores the rank may
    use over the ranks on its node, as the training scripts run)."""
    comm = world(comm)
    picks = front_runners(found, limit)
    devices = {int(np.prod(c.mesh_shape)) for c in picks}
    if devices != {comm.Get_size()}:
        raise ValueError(f"autotune times candidates on the job's own ranks: their meshes must have {comm.Get_size()} "
                         f"devices; got {sorted(devices)} (run it under mpiexec -n <autoshard's device count>)")
    if min(rounds, steps) < 1 or warmup < 0:
        raise ValueError(f"autotune needs at least 1 round and 1 step, and no negative warm-up; got rounds={rounds}, "
                         f"steps={steps}, warmup={warmup}")
    built, seen = [], set()
    for c in picks:
        step = build_train_step_on_root(dataclasses.replace(cfg, remat=c.remat), train_mesh(c.mesh_shape, c.preset),
                                        c.preset, optimizer, comm, c.microbatches)
        if step.program.hash not in seen:  # megatron (1, n) and megatron_wus (1, n) are one program
            seen.add(step.program.hash)
            built.append((c, step))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
    times: list[list[float]] = [[] for _ in built]
    with threadpool_limits(threads or _threads_per_rank(comm), user_api="blas"):
        for _ in range(rounds):
            for i, (_, step) in enumerate(built):
                times[i].append(_median_step(step, tokens, comm, steps, warmup))
    timed = sorted((Timed(c, tuple(t)) for (c, _), t in zip(built, times)), key=lambda t: t.best_s)
    if verbose and comm.Get_rank() == 0:
        print(format_timed(timed), flush=True)
    return timed


def front_runners(found: list[Candidate], limit: int) -> list[Candidate]:
    """The best-predicted fitting candidate of each preset, in predicted order, at most ``limit``."""
    if limit < 1:
        raise ValueError(f"autotune times at least one candidate; got limit={limit}")
    picks, presets = [], set()
    for c in sorted((c for c in found if c.fits and c.step_s is not None), key=lambda c: c.step_s):
        if c.preset not in presets:
            presets.add(c.preset)
            picks.append(c)
    if not picks:
        raise ValueError(f"autotune needs a candidate that fits; got none among {len(found)}")
    return picks[:limit]


def _threads_per_rank(comm) -> int:
    """This node's cores (the rank's affinity) over the job's ranks on the node: a thread per core, none shared."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ranks = node.Get_size()
    node.Free()
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def _median_step(step, tokens, comm, steps: int, warmup: int) -> float:
    """One round: the median over ``steps`` of the slowest rank's step, after ``warmup`` steps, from fresh state."""
    local = step.shard_state(step.init(0), comm.Get_rank())
    x, y = tokens[:, :-1], tokens[:, 1:]
    seconds = []
    for i in range(warmup + steps):
        comm.Barrier()
        start = time.perf_counter()
        local, _ = step.step(local, x, y, comm=comm)
        elapsed = max(comm.allgather(time.perf_counter() - start))
        if i >= warmup:
            seconds.append(elapsed)
    return float(np.median(seconds))


def format_timed(timed: list[Timed]) -> str:
    best = timed[0].best_s
    rows = [f"autotune: {len(timed)} layouts timed, fastest measured first",
            f"{'preset':14s} {'mesh':12s} {'M':>3s} {'predicted ms':>12s} {'measured ms':>11s} {'/ best':>7s}  rounds"]
    for t in timed:
        c = t.candidate
        rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.step_s * 1e3:12.3f} "
                    f"{t.best_s * 1e3:11.3f} {t.best_s / best:7.3f}  "
                    + " / ".join(f"{s * 1e3:.2f}" for s in t.rounds))
    return "\n".join(rows)
