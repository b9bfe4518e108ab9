"""Learning-rate schedules and gradient clipping inside the partitioned training step under real MPI, for any world
size: under dp, fsdp and megatron, clipping adds one all-reduce of the summed squares where gradients are split
(none under dp) and its update is PyTorch's ``clip_grad_norm_`` arithmetic in NumPy; a schedule's rate, read off
three SGD updates, is its NumPy formula.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_optim_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import SGD, LinearSchedule
from spmd_runtime.train import build_train_step_on_root, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
CFG = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
PLAIN = SGD(lr=1.0, momentum=0.0)


def cases():
    out = [((N,), "dp"), ((N,), "fsdp")]
    return out + [((N // 2, 2), "megatron")] if N % 2 == 0 else out


_built: dict = {}


def step_for(shape, preset, optimizer):
    """The train step, built once per (mesh, preset, optimizer) for the module."""
    key = (shape, preset, optimizer)
    if key not in _built:
        _built[key] = build_train_step_on_root(CFG, train_mesh(shape, preset), preset, optimizer)
    return _built[key]


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)), rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq))


def gradient(plain, params, tokens, labels) -> dict:
    """The step's gradient at ``params``: p - p' of a plain SGD step with lr 1 (the unpartitioned graph)."""
    state = {"params": params, "opt_state": PLAIN.init_state(params)}
    new, _ = plain.reference_step(state, tokens, labels)
    return {k: params[k] - new["params"][k] for k in params}


def step_and_gather(ts, state, batches):
    local = ts.shard_state(state, RANK)
    for tokens, labels in batches:
        local, _ = ts.step_local(local, *_block(ts, tokens, labels))
    return ts.gather(local)


def _block(ts, tokens, labels):
    rows, cols = ts.batch_block(RANK)
    return tokens[rows, cols], labels[rows, cols]


@pytest.mark.parametrize("shape, preset", cases(), ids=lambda v: str(v))
def test_clipping_adds_one_reduction_and_matches_numpy(shape, preset):
    plain = step_for(shape, preset, PLAIN)
    state, (tokens, labels) = plain.init(seed=2), batch(2)
    g = gradient(plain, state["params"], tokens, labels)
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g.values()))
    clip = step_for(shape, preset, SGD(lr=1.0, momentum=0.0, clip_norm=0.3 * norm))
    added = Counter(c["kind"] for c in clip.program.comm_summary()) - Counter(
        c["kind"] for c in plain.program.comm_summary())
    got = step_and_gather(clip, state, [(tokens, labels)])
    coef = min(0.3 * norm / (norm + 1e-6), 1.0)
    split = preset != "dp" and N > 1  # some gradient is split over the mesh
    assert dict(added) == ({"all_reduce": 1} if split else {})
    for k, x in g.items():
        np.testing.assert_allclose(got["params"][k], state["params"][k] - coef * x, rtol=1e-9, atol=1e-12, err_msg=k)


def test_a_schedule_sets_each_update_of_the_partitioned_step():
    shape, preset = cases()[-1]
    plain = step_for(shape, preset, PLAIN)
    ts = step_for(shape, preset, SGD(lr=LinearSchedule(0.5, 1, 3, 0.1, 0.2), momentum=0.0))
    batches = [batch(10 + k) for k in range(3)]
    got = step_and_gather(ts, ts.init(seed=1), batches)
    params = plain.init(seed=1)["params"]
    for count, (tokens, labels) in enumerate(batches):  # 0.2 (warm-up start), 0.5 (peak), 0.3 (half-way to 0.1)
        lr = 0.2 if count == 0 else 0.5 + (0.1 - 0.5) * min(count - 1, 2) / 2
        params = {k: params[k] - lr * g for k, g in gradient(plain, params, tokens, labels).items()}
    for k in params:
        np.testing.assert_allclose(got["params"][k], params[k], rtol=1e-9, atol=1e-12, err_msg=k)
    assert float(got["opt_state"]["step"]) == 3
