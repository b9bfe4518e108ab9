"""Megatron-SP (the ``megatron_sp`` preset) under real MPI: two training steps on a (2, N/2) mesh (or (N,) when N
is odd or 2) equal the unpartitioned reference, and the step moves the activation by all-gathers and
reduce-scatters over "model", never by an all-reduce of it.

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


def test_two_sequence_parallel_steps_match_the_reference():
    shape = (2, N // 2) if N % 2 == 0 and N > 2 else (N,)
    ts = build_train_step_on_root(CFG, train_mesh(shape, "megatron_sp"), "megatron_sp", AdamW(lr=1e-2), WORLD)
    state = ts.init(seed=1)
    rng = np.random.default_rng(0)
    data = [tuple(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)) for _ in range(2)) for _ in range(2)]
    want, want_losses = state, []
    if WORLD.Get_rank() == 0:
        for x, y in data:
            want, loss = ts.reference_step(want, x, y)
            want_losses.append(loss)
    want, want_losses = WORLD.bcast((want, want_losses), root=0)
    local, losses = ts.shard_state(state, WORLD.Get_rank()), []
    for x, y in data:
        local, loss = ts.step(local, x, y, comm=WORLD)
        losses.append(loss)
    got, want = ts.named(ts.gather(local, WORLD)), ts.named(want)
    activation = CFG.batch // (shape[0] if len(shape) == 2 else 1) * CFG.seq * CFG.d * 8
    reduced = [c for c in ts.program.comm_summary()
               if c["kind"] == "all_reduce" and c["axes"] == ("model",) and c["bytes_in"] == activation]
    assert N == 1 or not reduced
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)
