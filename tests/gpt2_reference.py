"""An independent NumPy GPT-2 (nanoGPT's model.py, line for line in plain NumPy, float64) for the tests of
``spmd_runtime.models.gpt2``: logits, loss, greedy generation without a cache, and gradients as directional
finite differences. Written from nanoGPT's PyTorch module, not from the code under test."""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def _layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + 1e-5) * w
    return y if b is None else y + b


def _linear(x, w, b):
    y = x @ w.T
    return y if b is None else y + b


def _gelu(x, approximate):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def logits(cfg, p, idx):
    """(b, t, vocab) logits of nanoGPT's GPT for int tokens ``idx`` (b, t), parameters by nanoGPT name."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    g = lambda name: p.get(name)
    b, t = idx.shape
    nh, c = cfg.n_head, cfg.n_embd
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][np.arange(t)]
    mask = np.tril(np.ones((t, t), bool))
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        a = _layer_norm(x, g(h + "ln_1.weight"), g(h + "ln_1.bias"))
        q, k, v = np.split(_linear(a, g(h + "attn.c_attn.weight"), g(h + "attn.c_attn.bias")), 3, axis=2)
        q, k, v = (z.reshape(b, t, nh, c // nh).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(c // nh)
        att = _softmax(np.where(mask, att, -np.inf))
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + _linear(y, g(h + "attn.c_proj.weight"), g(h + "attn.c_proj.bias"))
        m = _layer_norm(x, g(h + "ln_2.weight"), g(h + "ln_2.bias"))
        m = _gelu(_linear(m, g(h + "mlp.c_fc.weight"), g(h + "mlp.c_fc.bias")), cfg.gelu_approximate)
        x = x + _linear(m, g(h + "mlp.c_proj.weight"), g(h + "mlp.c_proj.bias"))
    x = _layer_norm(x, g("transformer.ln_f.weight"), g("transformer.ln_f.bias"))
    return x @ p["transformer.wte.weight"].T


def loss(cfg, p, idx, targets):
    """nanoGPT's F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)."""
    z = logits(cfg, p, idx).reshape(-1, cfg.vocab_size)
    y = targets.reshape(-1)
    zmax = z.max(-1, keepdims=True)
    logp = z - zmax - np.log(np.exp(z - zmax).sum(-1, keepdims=True))
    keep = y != -1
    return -logp[np.arange(len(y))[keep], y[keep]].mean()


def greedy(cfg, p, idx, new_tokens):
    """nanoGPT's generate with argmax sampling: each step the whole (cropped) context, no cache."""
    idx = np.asarray(idx)
    for _ in range(new_tokens):
        z = logits(cfg, p, idx[:, -cfg.block_size:])[:, -1, :]
        idx = np.concatenate([idx, z.argmax(-1)[:, None]], axis=1)
    return idx


def directional_derivatives(cfg, p, idx, targets, directions, eps=1e-6):
    """name -> d loss / d eps of loss(p[name] + eps * directions[name]) at eps = 0 (central differences, float64)."""
    out = {}
    for name, u in directions.items():
        plus, minus = dict(p), dict(p)
        plus[name] = np.asarray(p[name], np.float64) + eps * u
        minus[name] = np.asarray(p[name], np.float64) - eps * u
        out[name] = (loss(cfg, plus, idx, targets) - loss(cfg, minus, idx, targets)) / (2 * eps)
    return out
