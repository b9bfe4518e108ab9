"""Learning-rate schedules and gradient clipping (``optim``): schedule values against nanoGPT's ``get_lr`` and
optax's formulas written here in NumPy, each optimizer stepping by its schedule, and clipping by the global norm
against PyTorch's ``clip_grad_norm_`` formula, partitioned under dp / fsdp / megatron with ONE extra reduction
(none for dp)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import pytree
from spmd_runtime.optim import (SGD, Adafactor, AdamW, ConstantSchedule, CosineSchedule, LinearSchedule,
                                clip_by_global_norm, global_norm, nanogpt_schedule)
from spmd_runtime.train import build_train_step, train_mesh

from simulated import train_simulated
from test_train import CFG, feed, run_update


def values(schedule, counts):
    """The schedule evaluated on each traced float32 count (the way the optimizers call it)."""
    graph = sr.trace(lambda c: schedule(c) + 0.0 * c, sr.TensorSpec((), "float32"))
    return np.array([float(sr.evaluate(graph, np.float32(c))[0]) for c in counts])


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):  # nanoGPT train.py, as written there
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def optax_warmup(count, init, peak, warmup, after):
    """optax's join_schedules([linear_schedule(init, peak, warmup), after], [warmup])."""
    return init + (peak - init) * count / warmup if count < warmup else after(count - warmup)


COUNTS = range(0, 30)


def test_nanogpt_schedule_is_nanogpts_get_lr():
    got = values(nanogpt_schedule(6e-4, 5, 20, 6e-5), COUNTS)
    want = [nanogpt_get_lr(it, 6e-4, 5, 20, 6e-5) for it in COUNTS]
    np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.mark.parametrize("init, peak, warmup, total, end", [(0.0, 1.0, 4, 20, 0.1), (0.2, 3e-3, 0, 10, 0.0),
                                                             (1e-4, 1e-3, 7, 8, 1e-5)])
def test_cosine_and_linear_are_optaxs_warmup_then_decay(init, peak, warmup, total, end):
    decay = total - warmup
    cosine = lambda c: end + (peak - end) * 0.5 * (1 + math.cos(math.pi * min(c, decay) / decay))
    linear = lambda c: peak + (end - peak) * min(c, decay) / decay
    for cls, after in ((CosineSchedule, cosine), (LinearSchedule, linear)):
        want = [optax_warmup(c, init, peak, warmup, after) if warmup else after(c) for c in COUNTS]
        np.testing.assert_allclose(values(cls(peak, warmup, total, end, init), COUNTS), want, rtol=2e-6, atol=1e-9,
                                   err_msg=cls.__name__)


def test_constant_schedule_warms_up_then_holds():
    np.testing.assert_allclose(values(ConstantSchedule(0.5, warmup=4), range(8)),
                               [0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5], rtol=1e-7)


@pytest.mark.parametrize("make", [lambda lr: SGD(lr=lr, momentum=0.0), lambda lr: AdamW(lr=lr, weight_decay=0.0),
                                  lambda lr: Adafactor(lr=lr, clipping_threshold=None,
                                                       multiply_by_parameter_scale=False)],
                         ids=["sgd", "adamw", "adafactor"])
def test_each_optimizer_steps_by_its_schedule_counting_its_updates(make):
    """With a gradient of ones each optimizer's first-order step is the rate (AdamW: m/sqrt(v) = 1; Adafactor
    without momentum: g/sqrt(g^2) = 1 at every step; SGD without momentum: g), so each update moves the
    parameter by the schedule's value at the count of updates before it."""
    schedule = CosineSchedule(0.1, 2, 6, 0.01, 0.02)
    opt = make(schedule)
    params = {"w": np.zeros((2, 3), np.float32)}
    state = opt.init_state(params)
    assert state["step"].shape == () and float(state["step"]) == 0
    moves = []
    for _ in range(8):
        new, state = run_update(opt, params, {"w": np.ones((2, 3), np.float32)}, state)
        moves.append(float(params["w"][0, 0] - new["w"][0, 0]))
        params = new
    np.testing.assert_allclose(moves, values(schedule, range(8)), rtol=1e-4)
    assert float(state["step"]) == 8


def test_sgd_keeps_its_state_without_a_schedule_and_schedule_errors_name_the_value():
    assert sorted(SGD(lr=0.1).init_state({"w": np.zeros(2)})) == ["mom"]  # old SGD checkpoints still load
    with pytest.raises(ValueError, match="total must be an int > warmup=5 .*; got total=5"):
        CosineSchedule(1.0, warmup=5, total=5)
    with pytest.raises(ValueError, match="warmup must be an int >= 0; got -1"):
        LinearSchedule(1.0, warmup=-1, total=3)
    with pytest.raises(ValueError, match="give the Schedule its warmup instead; got warmup=3"):
        AdamW(lr=ConstantSchedule(1.0), warmup=3)


def torch_clip(grads: dict, max_norm: float) -> dict:
    """torch.nn.utils.clip_grad_norm_'s arithmetic, in float64."""
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    return {k: np.asarray(g, np.float64) * coef for k, g in grads.items()}


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_by_global_norm_matches_torchs_formula(max_norm):
    rng = np.random.default_rng(1)
    grads = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5), "c": rng.standard_normal((2, 2, 2))}
    graph = sr.trace(lambda g: (clip_by_global_norm(g, max_norm, groups=[["b"], ["a", "c"]]),
                                global_norm(g)), grads)
    clipped, norm = graph.out_tree.unflatten(sr.evaluate(graph, *pytree.flatten(grads)[0]))
    want = torch_clip(grads, max_norm)
    for k in grads:
        np.testing.assert_allclose(clipped[k], want[k], rtol=1e-12, err_msg=k)
    np.testing.assert_allclose(norm, math.sqrt(sum(np.sum(g ** 2) for g in grads.values())), rtol=1e-12)
    with pytest.raises(ValueError, match="groups must hold every key of the tree; got \\['c'\\] in none"):
        sr.trace(lambda g: global_norm(g, groups=[["a", "b"]]), grads)


PLAIN = SGD(lr=1.0, momentum=0.0)


@pytest.fixture(scope="module")
def gradients():
    """The first step's gradients of CFG from seed 3 (p - p' of a plain SGD step with lr 1) and the batch."""
    ts = build_train_step(CFG, train_mesh((1,), "dp"), "dp", PLAIN)
    state, data = ts.init(seed=3), feed(1, seed=3)
    new, _ = ts.reference_step(state, *data[0])
    return state, data, {k: state["params"][k] - new["params"][k] for k in state["params"]}


# preset -> the collectives clipping adds to its step on a 2 x 2 mesh: one all-reduce of the summed squares of the
# split gradients (over the axes splitting them), none where every gradient is replicated; one per group of
# gradients split over the same axes in the same order where the layout has several (fsdp_megatron: 3)
CLIP_COLLECTIVES = {"dp": [], "fsdp": [("all_reduce", ("data", "model"))], "megatron": [("all_reduce", ("model",))],
                    "fsdp_megatron": [("all_reduce", ("data",)), ("all_reduce", ("data", "model")),
                                      ("all_reduce", ("model", "data"))]}


@pytest.mark.parametrize("preset", sorted(CLIP_COLLECTIVES))
def test_clipping_under_a_preset_matches_numpy_with_one_reduction(preset, gradients):
    state, data, grads = gradients
    max_norm = 0.25 * math.sqrt(sum(np.sum(g ** 2) for g in grads.values()))  # clipping is active
    mesh = train_mesh((2, 2), preset)
    clip = build_train_step(CFG, mesh, preset, SGD(lr=1.0, momentum=0.0, clip_norm=max_norm))
    plain = build_train_step(CFG, mesh, preset, PLAIN)
    count = lambda ts: Counter((c["kind"], c["axes"]) for c in ts.program.comm_summary())
    assert sorted((count(clip) - count(plain)).elements()) == CLIP_COLLECTIVES[preset]
    assert not count(plain) - count(clip)
    got, _ = train_simulated(clip, state, data)
    for k, g in torch_clip(grads, max_norm).items():
        np.testing.assert_allclose(got["params"][k], state["params"][k] - g, rtol=1e-9, atol=1e-12, err_msg=k)
