"""A zoo model (GPT-2 from ``models.gpt2``, tiny) trained by ``build_train_step_on_root`` under real MPI, for any
world size (the suite runs it at 1, 2, 4 ranks): dp, fsdp and megatron steps follow the unpartitioned reference
step (``TrainStep.reference_step``: the 1-rank run of the same traced step) to float32 rounding, dropout on too.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_train_model_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.models import gpt2
from spmd_runtime.optim import AdamW, CosineSchedule
from spmd_runtime.train import Model, build_train_step_on_root, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
CFG = gpt2.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
OPT = AdamW(lr=CosineSchedule(1e-2, 1, 6, 1e-3), clip_norm=1.0)
MODEL = Model(lambda p, b, key: gpt2.loss(CFG, p, b["tokens"], b["labels"], key, train=True),
              params=gpt2.param_shapes(CFG), roles=gpt2.param_roles(CFG), batch=4, seq=8, vocab=CFG.vocab_size,
              init=lambda seed: gpt2.init_params(CFG, seed), dropout_seed=1, name="gpt2")


def presets():
    return [((N,), "dp"), ((N,), "fsdp")] + ([((N // 2, 2), "megatron")] if N % 2 == 0 else [])


@pytest.mark.parametrize("shape, preset", presets(), ids=str)
def test_gpt2_with_dropout_follows_the_reference_step(shape, preset):
    with warnings.catch_warnings():  # megatron's c_attn reshapes warn (models/gpt2.py's own business)
        warnings.simplefilter("ignore", UserWarning)
        ts = build_train_step_on_root(MODEL, train_mesh(shape, preset), preset, OPT)
    rng = np.random.default_rng(0)
    state = ts.init(0)
    local = ts.shard_state(state, RANK)
    for _ in range(3):
        tokens, labels = rng.integers(0, CFG.vocab_size, (2, 4, 8))
        local, loss = ts.step(local, tokens, labels)
        state, want = ts.reference_step(state, tokens, labels)
        np.testing.assert_allclose(loss, want, rtol=2e-6)
    for name, got in ts.named(ts.gather(local)).items():
        want = ts.named(state)[name]
        if name.endswith("c_attn.bias"):  # the key bias (row 1): a zero gradient in exact arithmetic (softmax
            # ignores it), so only rounding noise, which Adam normalises to steps of up to lr: 3 steps of lr <= 1e-2
            np.testing.assert_allclose(got[1], want[1], rtol=0, atol=3e-2, err_msg=name)
            got, want = got[[0, 2]], want[[0, 2]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
