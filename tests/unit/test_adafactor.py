"""Adafactor against a NumPy reference of Mesh TensorFlow's update (written here), its factored state slots,
and the partitioned training step with them laid out by the presets."""
from __future__ import annotations

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import pytree
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import Adafactor
from spmd_runtime.train import build_train_step, train_mesh

from simulated import train_simulated


def numpy_adafactor(params, grads_seq, lr=None, beta1=0.0, decay_rate=0.8, eps1=1e-30, eps2=1e-3, clip=1.0,
                    scale=True, min_dim=128, weight_decay=0.0, factor="last"):
    """Mesh TF's AdafactorOptimizer, one parameter dict over a sequence of gradient dicts."""
    rms = lambda x: np.sqrt(np.mean(x * x))
    params = {k: v.copy() for k, v in params.items()}
    state = {}
    for step, grads in enumerate(grads_seq):
        t = step + 1.0
        decay = 1.0 - t ** -decay_rate
        step_size = min(1e-2, 1 / np.sqrt(t)) if lr is None else lr
        for name, p in params.items():
            g = grads[name]
            sq = g * g + eps1
            two = sorted(range(p.ndim), key=lambda d: -p.shape[d])[:2] if factor == "largest" else [-2, -1]
            if p.ndim >= 2 and min(p.shape[d] for d in two) >= min_dim:
                r, c = sorted(d % p.ndim for d in two)
                vr = decay * state.get(("vr", name), 0.0) + (1 - decay) * sq.mean(axis=c)
                vc = decay * state.get(("vc", name), 0.0) + (1 - decay) * sq.mean(axis=r)
                state["vr", name], state["vc", name] = vr, vc
                r_factor = 1 / np.sqrt(vr / vr.mean(axis=r, keepdims=True))
                x = g * np.expand_dims(r_factor, c) * np.expand_dims(1 / np.sqrt(vc), r)
            else:
                v = state["v", name] = decay * state.get(("v", name), 0.0) + (1 - decay) * sq
                x = g / np.sqrt(v)
            if clip:
                x = x / max(1.0, rms(x) / clip)
            step_lr = step_size * max(rms(p), eps2) if scale else step_size
            sub = step_lr * x
            if beta1:
                sub = state["m", name] = beta1 * state.get(("m", name), 0.0) + (1 - beta1) * sub
            if weight_decay and p.ndim >= 2:
                sub = sub + step_lr * weight_decay * p
            params[name] = p - sub
    return params, state


SHAPES = {"matrix": (160, 136), "stacked": (3, 130, 140), "apart": (140, 2, 130), "small": (20, 30),
          "vector": (150,)}


def run_steps(opt, params, grads_seq):
    state = opt.init_state(params)
    for grads in grads_seq:
        graph = sr.trace(opt.update, params, grads, state)
        params, state = graph.out_tree.unflatten(sr.evaluate(graph, *pytree.flatten((params, grads, state))[0]))
    return params, state


@pytest.mark.parametrize("hyper", [{}, {"lr": 0.05, "beta1": 0.9}, {"clipping_threshold": None, "weight_decay": 0.1},
                                   {"multiply_by_parameter_scale": False, "min_dim_size_to_factor": 16},
                                   {"factor": "largest"}],
                         ids=["t5_defaults", "lr_beta1", "no_clip_decay", "unscaled_factor_small", "largest_dims"])
def test_adafactor_matches_numpy_for_three_steps(hyper):
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s) * 0.1 for k, s in SHAPES.items()}
    grads_seq = [{k: rng.standard_normal(s) * 10.0 ** -k2 for k, s in SHAPES.items()} for k2 in range(3)]
    opt = Adafactor(**hyper)
    got, state = run_steps(opt, params, grads_seq)
    names = {"lr": "lr", "beta1": "beta1", "clipping_threshold": "clip", "weight_decay": "weight_decay",
             "multiply_by_parameter_scale": "scale", "min_dim_size_to_factor": "min_dim", "factor": "factor"}
    want, want_state = numpy_adafactor(params, grads_seq, **{names[k]: v for k, v in hyper.items()})
    for name in SHAPES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
        assert not np.allclose(got[name], params[name])
    for (kind, name), value in want_state.items():
        np.testing.assert_allclose(state[kind][name], value, rtol=1e-10, err_msg=f"{kind}.{name}")
    assert float(state["step"]) == 3.0


def test_factored_slots_keep_all_dims_but_one():
    slots = {s.name: s for s in Adafactor(factor="largest").state_layout(SHAPES, "float32")}
    assert (slots["vr_matrix"].shape, slots["vr_matrix"].dims) == ((160,), (0,))
    assert (slots["vc_matrix"].shape, slots["vc_matrix"].dims) == ((136,), (1,))
    assert (slots["vr_stacked"].shape, slots["vc_stacked"].shape) == ((3, 130), (3, 140))
    assert (slots["vr_apart"].shape, slots["vc_apart"].shape) == ((140, 2), (2, 130))  # dims 0 and 2 factored
    assert slots["v_small"].shape == (20, 30) and slots["v_vector"].shape == (150,)  # below 128: full moments
    state = Adafactor(factor="largest").init_state({k: sr.TensorSpec(s) for k, s in SHAPES.items()})
    assert state["vr"]["matrix"] == sr.TensorSpec((160,)) and "matrix" not in state["v"]
    # 2 * (rows + columns) floats instead of Adam's 2 * rows * columns
    assert sum(np.prod(s.shape) for s in slots.values() if s.param == "matrix") == 160 + 136


CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
OPT = Adafactor(min_dim_size_to_factor=16, lr=0.02, beta1=0.5)  # the small test model's matrices factored


@pytest.mark.parametrize("preset,shape", [("megatron", (2, 2)), ("wus", (4,)), ("megatron_wus", (2, 2)),
                                          ("fsdp", (3,)), ("dp", (1,))], ids=lambda v: str(v))
def test_the_partitioned_step_with_adafactor_matches_the_reference(preset, shape):
    ts = build_train_step(CFG, train_mesh(shape, preset), preset, OPT)
    factored = [n for n in ts.state_names if n.startswith("opt_state.vr.")]
    assert factored, "the test model's matrices must be factored"
    if preset == "megatron":  # a column-parallel weight's column means split over "model" like its columns
        assert ts.layout.specs["opt_state.vc.layers_wq"] == (None, ("model",))  # (layers, columns)
        assert ts.layout.specs["opt_state.vr.layers_wq"] == (None, None)
    state = ts.init(seed=1)
    rng = np.random.default_rng(3)
    data = [tuple(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)) for _ in range(2)) for _ in range(2)]
    want, want_losses = state, []
    for x, y in data:
        want, loss = ts.reference_step(want, x, y)
        want_losses.append(loss)
    got, losses = train_simulated(ts, state, data)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for name, value in pytree.named_leaves(want).items():
        np.testing.assert_allclose(pytree.named_leaves(got)[name], value, rtol=1e-8, atol=1e-12, err_msg=name)


def test_factor_last_keeps_leading_dims_and_refuses_unknown_rules():
    expert = {"we1": (64, 16, 256)}  # (experts, d, hidden): "largest" would factor the expert dim away
    dims = lambda rule: {s.name: s.dims for s in Adafactor(min_dim_size_to_factor=16, factor=rule).state_layout(
        expert, "float32")}
    largest, last = dims("largest"), dims("last")
    assert largest == {"step": None, "vr_we1": (0, 1), "vc_we1": (1, 2)}
    assert last == {"step": None, "vr_we1": (0, 1), "vc_we1": (0, 2)}
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((20, 2, 18)), "e": rng.standard_normal((30, 20, 18))}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(2)]
    got, state = run_steps(Adafactor(factor="last", min_dim_size_to_factor=16), params, grads)
    want, _ = numpy_adafactor(params, grads, factor="last", min_dim=16)
    assert "w" in state["v"] and state["vr"]["e"].shape == (30, 20)  # (.., 2, 18): 2 < 16, not factored
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, err_msg=name)
    with pytest.raises(ValueError, match="factor must be 'largest' or 'last'; got 'rows'"):
        Adafactor(factor="rows")
