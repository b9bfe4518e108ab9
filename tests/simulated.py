"""Helpers for tests in the in-process simulated world (every rank a thread, real data movement)."""
import numpy as np

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated


def run_everywhere(program, *args):
    """Every rank's global outputs of ``sr.run(program, *args)``."""
    return run_simulated(program.mesh.size, lambda comm: sr.run(program, *args, comm=comm))


def assert_all_ranks(program, args, expected, tol=0.0):
    """Every rank returns ``expected`` (same count, shapes and dtypes; values within ``tol``)."""
    for rank, outs in enumerate(run_everywhere(program, *args)):
        assert len(outs) == len(expected), f"rank {rank}"
        for got, want in zip(outs, expected):
            assert got.shape == want.shape and got.dtype == want.dtype, f"rank {rank}"
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"rank {rank}")


def train_simulated(ts, state, batches):
    """Every rank: slice the global state once, step a TrainStep on local blocks, gather; returns rank 0's
    (global state, losses) after checking every rank saw the same losses."""
    def body(comm):
        local, losses = ts.shard_state(state, comm.Get_rank()), []
        for x, y in batches:
            local, loss = ts.step(local, x, y, comm=comm)
            losses.append(loss)
        return ts.gather(local, comm), losses
    results = run_simulated(ts.mesh.size, body)
    for _, losses in results[1:]:
        assert losses == results[0][1], "every rank must see the same loss"
    return results[0]


def errors_on_every_rank(n, fn):
    """Each simulated rank's error message from ``fn(comm)`` ("Type: message"), or None where it returned."""
    def body(comm):
        try:
            fn(comm)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None
    return run_simulated(n, body)


def collectives(program):
    """(kind, axes) of every collective, in program order."""
    return [(c["kind"], c["axes"]) for c in program.comm_summary()]


def assert_trains_like_reference(ts, state, batches, rtol=1e-9, atol=1e-12, reference=None):
    """A TrainStep's steps in the simulated world end where its unpartitioned reference (``sr.evaluate`` of the
    traced step; of ``reference``'s, another TrainStep, e.g. the plain 1-rank one) does: the same losses, the
    same state."""
    want, want_losses = state, []
    for x, y in batches:
        want, loss = (reference or ts).reference_step(want, x, y)
        want_losses.append(loss)
    got, losses = train_simulated(ts, state, batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    got, want = sr.pytree.named_leaves(got), sr.pytree.named_leaves(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
