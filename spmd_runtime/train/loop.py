"""The training loop: ``fit`` steps a ``TrainStep`` on the blocks a ``TokenLoader`` reads, logs the loss,
evaluates every N steps, saves periodic checkpoints (parameters, optimizer state, step, loader position in ONE
atomic save) and resumes from the last one exactly: the same batches, the same state, the same losses to the bit.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint import checkpoint_info
from ..exec.runner import Runtime
from ..tokens import TokenLoader
from .runtime import TrainStep

LOADER = ("loader.position", "loader.seed")  # the extra values a checkpoint of fit holds


@dataclass
class FitResult:
    """What ``fit`` did: ``losses`` and ``evals`` as (step number, loss) for the steps this call ran (step
    numbers count from 1 over the whole run, resumed or not), the final local ``state``, the ``step`` reached
    and the step it started from (``resumed_from``: 0 for a fresh run)."""
    losses: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    state: dict | None = None
    step: int = 0
    resumed_from: int = 0


def token_loaders(ts: TrainStep, data_dir, rank: int, seed: int = 0) -> tuple[TokenLoader, TokenLoader]:
    """(train, eval) loaders of ``data_dir``'s ``train.bin`` (shuffled windows from ``seed``) and ``val.bin``
    (consecutive windows from its start) reading ``rank``'s block of each of ``ts``'s batches."""
    rows, cols = ts.batch_block(rank)
    make = lambda name, shuffle: TokenLoader(os.path.join(data_dir, name), ts.cfg.batch, ts.cfg.seq, ts.cfg.vocab,
                                             seed=seed, shuffle=shuffle, rows=rows, cols=cols)
    return make("train.bin", True), make("val.bin", False)


def evaluate(ts: TrainStep, local_state: dict, loader: TokenLoader, steps: int, comm=None) -> float:
    """The mean loss over the first ``steps`` batches of ``loader`` (read from position 0 each time, so every
    evaluation sees the same tokens; the loader's position is left as it was)."""
    return float(np.mean([ts.eval_loss(local_state, *loader.batch_at(k), comm=comm) for k in range(steps)]))


def fit(ts: TrainStep, loader: TokenLoader, steps: int, *, state: dict | None = None, seed: int = 0,
        eval_loader: TokenLoader | None = None, eval_every: int = 0, eval_steps: int = 1, checkpoint_every: int = 0,
        directory=None, resume: bool = True, log_every: int = 10, log=print, comm=None) -> FitResult:
    """Collective: train ``ts`` up to step ``steps`` on ``loader``'s batches (this rank's blocks).

    Starts from ``directory``'s checkpoint when there is one and ``resume`` (parameters, optimizer state, step and
    the loader's position come back), else from ``state`` (local blocks) or ``ts.init(seed)``. Every
    ``eval_every`` steps the mean loss of ``eval_steps`` batches of ``eval_loader``; every ``checkpoint_every``
    steps, and after the last, a checkpoint in ``directory``. Rank 0 calls ``log`` with a line every
    ``log_every`` steps and after each evaluation (``log=None``: silent)."""
    rank = Runtime.of(comm).rank
    _check_fit(ts, rank, loader, steps, eval_loader, eval_every, eval_steps, checkpoint_every, directory)
    say = log if log is not None and rank == 0 else (lambda line: None)
    result = FitResult()
    if resume and directory is not None and _has_checkpoint(directory):
        state, extra = ts.load(directory, comm=comm, extra=True)
        missing = [k for k in LOADER if k not in extra]
        if missing:
            raise ValueError(f"fit resumes from checkpoints that fit saved (with the loader's position); got "
                             f"{directory} without {missing}")
        loader.load_state_dict({"position": int(extra["loader.position"]), "seed": int(extra["loader.seed"])})
        result.resumed_from = int(checkpoint_info(directory)["step"])
        say(f"resumed from {directory} at step {result.resumed_from} (loader position {loader.position})")
    elif state is None:
        state = ts.shard_state(ts.init(seed), rank)
    saved = result.step = result.resumed_from
    for i in range(result.resumed_from + 1, steps + 1):
        t0 = time.perf_counter()
        position = loader.position
        state, loss = ts.step_local(state, *next(loader), comm=comm, position=position)
        result.losses.append((i, loss))
        result.step = i
        if log_every and (i % log_every == 0 or i == steps):
            say(f"step {i}/{steps}  loss {loss:.4f}  {(time.perf_counter() - t0) * 1e3:.1f} ms")
        if eval_every and i % eval_every == 0:
            result.evals.append((i, evaluate(ts, state, eval_loader, eval_steps, comm)))
            say(f"step {i}/{steps}  eval loss {result.evals[-1][1]:.4f} ({eval_steps} batches)")
        if checkpoint_every and i % checkpoint_every == 0:
            saved = _save(ts, directory, state, i, loader, comm)
    if directory is not None and saved != result.step:
        _save(ts, directory, state, result.step, loader, comm)
    result.state = state
    return result


def _save(ts: TrainStep, directory, state: dict, step: int, loader: TokenLoader, comm) -> int:
    ts.save(directory, state, step=step, comm=comm,
            extra={"loader.position": np.int64(loader.position), "loader.seed": np.int64(loader.seed)})
    return step


def _has_checkpoint(directory) -> bool:
    try:
        checkpoint_info(directory)
    except (OSError, ValueError):
        return False
    return True


def _check_fit(ts, rank, loader, steps, eval_loader, eval_every, eval_steps, checkpoint_every, directory) -> None:
    for name, value in (("steps", steps), ("eval_every", eval_every), ("eval_steps", eval_steps),
                        ("checkpoint_every", checkpoint_every)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"fit {name} must be an int >= 0; got {value!r}")
    if eval_every and eval_loader is None:
        raise ValueError(f"fit eval_every={eval_every} needs an eval_loader (token_loaders makes one of val.bin)")
    if checkpoint_every and directory is None:
        raise ValueError(f"fit checkpoint_every={checkpoint_every} needs a directory to save into")
    rows, cols = ts.batch_block(rank)
    mine = (range(ts.cfg.batch)[rows], range(ts.cfg.seq)[cols])
    for what, ld in (("loader", loader), ("eval_loader", eval_loader)):
        if ld is not None and (ld.batch, ld.seq) != (ts.cfg.batch, ts.cfg.seq):
            raise ValueError(f"fit {what} must draw the step's (batch, seq) = {(ts.cfg.batch, ts.cfg.seq)}; got "
                             f"{(ld.batch, ld.seq)}")
        if ld is not None and (ld.rows, ld.cols) != mine:
            raise ValueError(f"fit {what} must read rank {rank}'s block of the batch, rows {rows.start}:{rows.stop} "
                             f"and cols {cols.start}:{cols.stop} (token_loaders makes such loaders); got rows "
                             f"{ld.rows.start}:{ld.rows.stop}, cols {ld.cols.start}:{ld.cols.stop}")


__all__ = ["fit", "FitResult", "evaluate", "token_loaders"]
