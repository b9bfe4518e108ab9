"""Megatron-SP (the ``megatron_sp`` preset) under real MPI: two training steps on a (2, N/2) mesh (or (N,) when N
is odd or 2) equal the unpartitioned reference, and the step moves the activation by all-gathers and
reduce-scatters over "model", never by an all-reduce of it.

At 4 and 8 ranks also fsdp_megatron_sp, pipeline_sp and pipeline_1f1b_sp against the plain 1-rank step.

Run: ``mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_sequence_parallel_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step_on_root, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=2 * N, batch=4, dtype="float64")


def two_steps(ts, reference):
    """(losses, gathered named state) of two steps of ``ts`` under MPI, and ``reference``'s (``sr.evaluate`` of its
    unpartitioned step, on rank 0) from the same state."""
    state = ts.init(seed=1)
    rng = np.random.default_rng(0)
    data = [tuple(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)) for _ in range(2)) for _ in range(2)]
    want, want_losses = state, []
    if WORLD.Get_rank() == 0:
        for x, y in data:
            want, loss = reference.reference_step(want, x, y)
            want_losses.append(loss)
    want, want_losses = WORLD.bcast((want, want_losses), root=0)
    local, losses = ts.shard_state(state, WORLD.Get_rank()), []
    for x, y in data:
        local, loss = ts.step(local, x, y, comm=WORLD)
        losses.append(loss)
    return (losses, ts.named(ts.gather(local, WORLD))), (want_losses, ts.named(want))


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-9, atol=1e-12, err_msg=name)


def test_two_sequence_parallel_steps_match_the_reference():
    shape = (2, N // 2) if N % 2 == 0 and N > 2 else (N,)
    ts = build_train_step_on_root(CFG, train_mesh(shape, "megatron_sp"), "megatron_sp", AdamW(lr=1e-2), WORLD)
    got, want = two_steps(ts, ts)
    activation = CFG.batch // (shape[0] if len(shape) == 2 else 1) * CFG.seq * CFG.d * 8
    reduced = [c for c in ts.program.comm_summary()
               if c["kind"] == "all_reduce" and c["axes"] == ("model",) and c["bytes_in"] == activation]
    assert N == 1 or not reduced
    assert_same(got, want)


@pytest.mark.skipif(N not in (4, 8), reason="the 2 x N/2 and 2 x (data) x (model) meshes need 4 or 8 ranks")
@pytest.mark.parametrize("preset,shape", [("fsdp_megatron_sp", (2, N // 2)), ("pipeline_sp", (2, max(N // 4, 1), 2)),
                                          ("pipeline_1f1b_sp", (2, 1, N // 2))], ids=["fsdp", "gpipe", "1f1b"])
def test_sequence_parallel_with_fsdp_and_pipelines_matches_the_plain_step(preset, shape):
    """Megatron-SP inside the pipeline stages and beside FSDP's sharded weights: two steps equal the plain
    (unpipelined, 1-rank) step's losses, parameters and optimizer state."""
    mb = 2 if len(shape) == 3 else 1
    ts = build_train_step_on_root(CFG, train_mesh(shape, preset), preset, AdamW(lr=1e-2), WORLD, mb)
    plain = build_train_step_on_root(CFG, train_mesh((1,), "dp"), "dp", AdamW(lr=1e-2), WORLD)
    assert_same(*two_steps(ts, plain))
