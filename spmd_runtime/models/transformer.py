"""A pre-LayerNorm Transformer block (multi-head self-attention + GELU MLP), forward pass."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import numpy as snp
from ..nn import gelu, layer_norm, softmax
from .roles import COLUMN, NORM, ROW

PARAM_NAMES = ("x", "ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "ln2_g", "ln2_b", "w1", "w2")
# Sharding hints: the role of each parameter (every input but x); the weights are (d_in, d_out) matrices
PARAM_ROLES = {"ln1_g": NORM, "ln1_b": NORM, "wq": COLUMN, "wk": COLUMN, "wv": COLUMN, "wo": ROW,
               "ln2_g": NORM, "ln2_b": NORM, "w1": COLUMN, "w2": ROW}


@dataclass(frozen=True)
class BlockConfig:
    batch: int = 8
    seq: int = 64
    d: int = 256
    heads: int = 8
    ffn: int = 1024
    dtype: str = "float32"

    def __post_init__(self):
        if self.d % self.heads:
            raise ValueError(f"d must be a multiple of heads; got d={self.d}, heads={self.heads}")


def transformer_block(cfg: BlockConfig):
    """The traced function f(x, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, w1, w2) -> y."""
    h, hd = cfg.heads, cfg.d // cfg.heads

    def block(x, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, w1, w2):
        b, s, d = x.shape
        a = layer_norm(x, ln1_g, ln1_b)
        q = (a @ wq).reshape(b, s, h, hd)
        k = (a @ wk).reshape(b, s, h, hd)
        v = (a @ wv).reshape(b, s, h, hd)
        p = softmax(snp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hd)))
        ctx = snp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d)
        x = x + ctx @ wo
        return x + gelu(layer_norm(x, ln2_g, ln2_b) @ w1) @ w2
    return block


def block_params(cfg: BlockConfig, seed: int = 0) -> list[np.ndarray]:
    """Inputs in PARAM_NAMES order, drawn from ``seed`` (identical on every rank and mesh)."""
    rng = np.random.default_rng(seed)
    d, f = cfg.d, cfg.ffn
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(cfg.dtype)
    ones, zeros = np.ones(d, cfg.dtype), np.zeros(d, cfg.dtype)
    x = rng.standard_normal((cfg.batch, cfg.seq, d)).astype(cfg.dtype)
    return [x, ones, zeros, w(d, d), w(d, d), w(d, d), w(d, d), ones.copy(), zeros.copy(), w(d, f), w(f, d)]


def megatron_specs(data_axis: str | None, model_axis: str | None) -> list:
    """Megatron-LM tensor parallelism: batch on ``data_axis``; heads (QKV columns, output-projection rows)
    and the MLP hidden dim on ``model_axis``. One all-reduce over ``model_axis`` after attention and one
    after the MLP; everything else is local. The norms' gains and biases are left unannotated."""
    roles = [PARAM_ROLES[n] for n in PARAM_NAMES[1:]]
    return [(data_axis, None, None)] + [None if r.tensor is None else r.spec(2, tensor=model_axis) for r in roles]
