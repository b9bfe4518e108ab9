"""scripts/bench_gpt2.py and scripts/gpt2_loss_curves.py: the FLOP count against nanoGPT's published parameter
count, the shared training step at one rank against the NumPy GPT-2's loss and the memory model's parameter bytes,
the loss curves' batches. The scripts' runs against PyTorch are left to them (the suite needs no torch)."""
import importlib.util
import os
import sys

import numpy as np

import gpt2_reference as ref
import spmd_runtime.random as srandom
from spmd_runtime.models import gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # gpt2_loss_curves imports bench_gpt2 as a sibling


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench, curves = _load("bench_gpt2"), _load("gpt2_loss_curves")


def test_model_flops_count_nanogpts_parameters():
    args = bench.parse_args([])  # the defaults: GPT-2 124M at vocab 50304, 4 x 256 tokens
    n = 123.69e6  # nanoGPT prints "number of parameters: 123.69M" for this config (position table left out)
    tokens = 4 * 256
    assert abs(bench.model_flops(args) - (6 * n + 12 * 12 * 768 * 256) * tokens) < 6 * 0.01e6 * tokens


def test_the_training_step_at_one_rank_starts_from_the_models_loss_and_learns():
    args = bench.parse_args(["--layers", "1", "--d", "16", "--heads", "4", "--vocab", "40", "--seq", "8"])
    cfg = gpt2.GPTConfig(**bench.gpt_config(args))
    optimizer = bench.adamw()
    step, place, batch, layout, mesh, preset = bench.build_step(cfg, "dp", 1, optimizer)
    weights = gpt2.init_params(cfg, 0)
    idx, targets = bench.batch_of(args, 1)
    want = ref.loss(cfg, weights, idx, targets)
    params, state = place(weights, optimizer.init_state(weights))
    losses = []
    for _ in range(3):
        params, state, loss = step(params, state, *batch(idx, targets), srandom.key(0))
        losses.append(float(np.asarray(loss)))
    np.testing.assert_allclose(losses[0], want, rtol=2e-6)
    assert losses[2] < losses[1] < losses[0]  # AdamW on one batch: the loss falls
    computed = bench.computed_bytes(args, layout, mesh, preset)
    assert computed["params"] == 4 * sum(int(np.prod(s)) for s in gpt2.param_shapes(cfg).values())


def test_loss_curve_batches_are_windows_of_one_stream():
    args = curves.parse_args(["--steps", "3", "--vocab", "50", "--seq", "8"])
    inputs, targets = curves.make_batches(args)
    assert inputs.shape == targets.shape == (3, 4, 8) and inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[..., 1:], targets[..., :-1])  # targets are the next tokens
    assert 0 <= inputs.min() and inputs.max() < 50
    np.testing.assert_array_equal(curves.make_batches(args)[0], inputs)  # seeded
