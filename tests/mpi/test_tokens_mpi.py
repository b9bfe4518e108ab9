"""The token loader and ``fit`` under real MPI, for any world size (the suite runs it at 1, 2, 4 ranks): each rank
reads its own rows of every batch (dp: batch / N rows; megatron on (N/2, 2): the rows of its "data" index), the
rows of all ranks put together are the batch a 1-rank loader draws for the same seed, and ``fit`` on the bundled
corpus follows the unpartitioned reference step on those global batches, evaluations included.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_tokens_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.data import ALPHABET
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW, LinearSchedule
from spmd_runtime.tokens import TokenLoader, prepare_corpus
from spmd_runtime.train import build_train_step_on_root, fit, token_loaders, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
CFG = LMConfig(layers=1, d=16, heads=2, ffn=32, vocab=len(ALPHABET), seq=8, batch=8, dtype="float64")
OPT = AdamW(lr=LinearSchedule(1e-2, 1, 6, 1e-3), clip_norm=0.5)


@pytest.fixture(scope="module")
def data_dir():
    where = WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    if RANK == 0:
        prepare_corpus(where, sentences=200)
    WORLD.Barrier()
    yield where
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(where, ignore_errors=True)


_built: dict = {}


def step_for(shape, preset):
    if (shape, preset) not in _built:  # built once for the module
        _built[shape, preset] = build_train_step_on_root(CFG, train_mesh(shape, preset), preset, OPT)
    return _built[shape, preset]


def presets():
    return [((N,), "dp")] + ([((N // 2, 2), "megatron")] if N % 2 == 0 else [])


@pytest.mark.parametrize("shape, preset", presets(), ids=lambda v: str(v))
def test_each_rank_reads_its_rows_and_together_they_are_the_one_rank_batch(data_dir, shape, preset):
    ts = step_for(shape, preset)
    train, val = token_loaders(ts, data_dir, RANK, seed=4)
    rows, cols = ts.batch_block(RANK)
    mine = [(next(train), next(val)) for _ in range(3)]
    every = WORLD.allgather((rows, cols, mine))
    whole = TokenLoader(os.path.join(data_dir, "train.bin"), CFG.batch, CFG.seq, CFG.vocab, seed=4)
    whole_val = TokenLoader(os.path.join(data_dir, "val.bin"), CFG.batch, CFG.seq, CFG.vocab, shuffle=False)
    want = [(next(whole), next(whole_val)) for _ in range(3)]
    per_rank = -(-CFG.batch // (N if preset == "dp" else N // 2))  # ceil: the last rank's block may be shorter
    data_index = RANK if preset == "dp" else RANK // 2  # megatron: ranks (d, 0) and (d, 1) hold the same rows
    assert (rows, cols) == (slice(data_index * per_rank, min((data_index + 1) * per_rank, CFG.batch)),
                            slice(0, CFG.seq))
    for r_rows, r_cols, batches in every:
        for ((t, l), (vt, vl)), ((wt, wl), (wvt, wvl)) in zip(batches, want):
            for got, full in ((t, wt), (l, wl), (vt, wvt), (vl, wvl)):
                np.testing.assert_array_equal(got, full[r_rows, r_cols])
    covered = sorted({i for r_rows, _, _ in every for i in range(CFG.batch)[r_rows]})
    assert covered == list(range(CFG.batch))


def test_fit_follows_the_reference_step_on_the_global_batches(data_dir):
    ts = step_for(*presets()[-1])
    train, val = token_loaders(ts, data_dir, RANK)
    result = fit(ts, train, 4, eval_loader=val, eval_every=2, eval_steps=2, log=None)
    gathered = WORLD.gather((result.losses, result.evals))
    if RANK != 0:
        return
    whole = TokenLoader(os.path.join(data_dir, "train.bin"), CFG.batch, CFG.seq, CFG.vocab)
    whole_val = TokenLoader(os.path.join(data_dir, "val.bin"), CFG.batch, CFG.seq, CFG.vocab, shuffle=False)
    state, losses, evals = ts.init(0), [], []
    for i in range(1, 5):
        state, loss = ts.reference_step(state, *next(whole))
        losses.append((i, loss))
        if i % 2 == 0:  # the loss of the current parameters on the first 2 val batches (a step reports it)
            evals.append((i, np.mean([ts.reference_step(state, *whole_val.batch_at(k))[1] for k in range(2)])))
    for got_losses, got_evals in gathered:
        assert got_losses == gathered[0][0] and got_evals == gathered[0][1]  # every rank the same
        np.testing.assert_allclose([v for _, v in got_losses], [v for _, v in losses], rtol=1e-10)
        np.testing.assert_allclose([v for _, v in got_evals], [v for _, v in evals], rtol=1e-10)
        assert [i for i, _ in got_evals] == [2, 4]
