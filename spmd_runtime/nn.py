"""Neural-network building blocks written with traced primitives (so they partition like any other code)."""
from __future__ import annotations

import math

from . import numpy as snp
from .ops.core import stop_gradient


def softmax(x, axis=-1):
    """Numerically safe softmax: subtract the row max before exp (a constant for differentiation, as JAX's and
    PyTorch's softmax: the result does not depend on it)."""
    e = snp.exp(x - stop_gradient(snp.max(x, axis=axis, keepdims=True)))
    return e / snp.sum(e, axis=axis, keepdims=True)


def layer_norm(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last dim."""
    mu = snp.mean(x, axis=-1, keepdims=True)
    centred = x - mu
    var = snp.mean(centred * centred, axis=-1, keepdims=True)
    return centred / snp.sqrt(var + eps) * gamma + beta


def gelu(x):
    """GELU, tanh approximation (as in GPT-2)."""
    return 0.5 * x * (1.0 + snp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
