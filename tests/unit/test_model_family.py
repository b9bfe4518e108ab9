"""The model family of the published configs: optional biases, a head dim independent of d / heads, gated FFNs
(GEGLU, SwiGLU): the loss against a NumPy reference written here, and the partitioned step against the
unpartitioned one on several meshes and presets."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.models.lm import LMConfig, init_params, lm_loss, param_roles, param_shapes
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step, train_mesh

from simulated import train_simulated


def numpy_loss(cfg: LMConfig, p, tokens, labels):
    """The loss of ``cfg``'s model, in NumPy (unrolled or stacked layers)."""
    def ln(x, g, b):
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    def layer(i, k):
        return p[f"l{i}_{k}"] if f"l{i}_{k}" in p else p[f"layers_{k}"][i]

    def linear(i, x, k):
        bias = f"l{i}_{k}_b" in p or f"layers_{k}_b" in p
        return x @ layer(i, k) + (layer(i, k + "_b") if bias else 0.0)

    x = p["embed"][tokens] + p["pos"]
    b, s, d = x.shape
    h = cfg.heads
    hd = cfg.head_dim or d // h
    for i in range(cfg.layers):
        a = ln(x, layer(i, "ln1_g"), layer(i, "ln1_b"))
        q, k, v = (linear(i, a, n).reshape(b, s, h, hd) for n in ("wq", "wk", "wv"))
        scores = np.where(np.tril(np.ones((s, s), bool)), np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(i, np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * hd), "wo")
        a = ln(x, layer(i, "ln2_g"), layer(i, "ln2_b"))
        hidden = linear(i, a, "w1")
        if cfg.ffn_kind == "gelu":
            hidden = gelu(hidden)
        elif cfg.ffn_kind == "geglu":
            hidden = gelu(hidden) * linear(i, a, "w3")
        else:  # swiglu
            hidden = hidden / (1 + np.exp(-hidden)) * linear(i, a, "w3")
        x = x + linear(i, hidden, "w2")
    z = ln(x, p["lnf_g"], p["lnf_b"]) @ (p["embed"].T if cfg.tied else p["unembed"])
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1).mean()


BASE = dict(layers=2, d=16, heads=2, ffn=24, vocab=20, seq=6, batch=4, dtype="float64")
VARIANTS = {
    "bias": dict(bias=True),
    "head_dim": dict(heads=4, head_dim=6),  # 4 x 6 = 24 != d = 16
    "geglu": dict(ffn_kind="geglu"),
    "swiglu_bias_head_dim": dict(ffn_kind="swiglu", bias=True, heads=3, head_dim=4),  # d = 16 not a multiple of 3
}


def perturbed(cfg, seed=0):
    """Initial parameters moved off their special values (unit gains, zero biases), so every term counts."""
    rng = np.random.default_rng(seed)
    return OrderedDict((k, v + 0.1 * rng.standard_normal(v.shape)) for k, v in init_params(cfg, seed).items())


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lm_loss_matches_numpy(variant, scan):
    cfg = LMConfig(**{**BASE, **VARIANTS[variant]}, scan_layers=scan)
    params = perturbed(cfg)
    rng = np.random.default_rng(1)
    tokens, labels = (rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32) for _ in range(2))
    graph = sr.trace(lambda *a: lm_loss(cfg, a[:-2], a[-2], a[-1]), *params.values(), tokens, labels)
    got = sr.evaluate(graph, *params.values(), tokens, labels)[0]
    assert got == pytest.approx(numpy_loss(cfg, params, tokens, labels), rel=1e-12)


def test_shapes_and_roles_of_the_new_parameters():
    cfg = LMConfig(**{**BASE, "layers": 1, "heads": 4}, head_dim=6, bias=True, ffn_kind="swiglu", scan_layers=False)
    shapes, roles = param_shapes(cfg), param_roles(cfg)
    assert shapes["l0_wq"] == (16, 24) and shapes["l0_wo"] == (24, 16) and shapes["l0_wq_b"] == (24,)
    assert shapes["l0_w3"] == (16, 24) and shapes["l0_w3_b"] == (24,) and shapes["l0_w2_b"] == (16,)
    assert roles["l0_wq_b"].tensor == 0 and roles["l0_w3"].tensor == 1  # split like their weights' columns
    assert roles["l0_wo_b"].tensor is None and roles["l0_w2_b"].tensor is None  # added after the reduction
    # without the new options the parameters (names and initial values) are what they always were
    plain = LMConfig(**BASE)
    assert [k for k in param_shapes(plain) if "_b" in k and "ln" not in k] == [] and "layers_w3" not in param_shapes(plain)
    params = init_params(cfg, 0)
    assert all(np.all(params[k] == 0) for k in params if k.endswith("_b"))  # biases start at zero


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="ffn_kind must be one of .*; got 'relu'"):
        LMConfig(ffn_kind="relu")
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        LMConfig(head_dim=0)
    with pytest.raises(ValueError, match="or set head_dim"):
        LMConfig(d=10, heads=4)
    assert LMConfig(d=10, heads=4, head_dim=8).head_size == 8


FAMILY = LMConfig(**{**BASE, "batch": 8, "heads": 4}, head_dim=6, bias=True, ffn_kind="geglu")


@pytest.mark.parametrize("preset,shape,micro", [
    ("megatron", (2,), 1), ("megatron", (2, 2), 1), ("megatron", (3,), 1), ("fsdp_megatron", (2, 2), 1),
    ("wus", (4,), 1), ("megatron", (2, 2), 2), ("pipeline", (2, 1, 2), 2),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_the_partitioned_step_matches_the_reference(preset, shape, micro):
    """Biases split with their weights' columns (heads of 6, 3-way uneven over 3 model ranks), gated FFN."""
    ts = build_train_step(FAMILY, train_mesh(shape, preset), preset, AdamW(lr=1e-2), microbatches=micro)
    params = dict(perturbed(FAMILY, 3))
    state = {"params": params, "opt_state": ts.optimizer.init_state(params)}
    rng = np.random.default_rng(2)
    data = [tuple(rng.integers(0, FAMILY.vocab, (FAMILY.batch, FAMILY.seq)) for _ in range(2)) for _ in range(2)]
    want, want_losses = state, []
    for x, y in data:
        want, loss = ts.reference_step(want, x, y)
        want_losses.append(loss)
    got, losses = train_simulated(ts, state, data)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for name in ts.param_names:
        np.testing.assert_allclose(got["params"][name], want["params"][name], rtol=1e-8, atol=1e-11, err_msg=name)
    assert want_losses[0] == pytest.approx(numpy_loss(FAMILY, state["params"], *data[0]), rel=1e-12)
