"""Neural-network functions (``jax.nn``'s common set, plus the losses and layers model code needs), written
with traced primitives so they partition like any other code: ``import spmd_runtime.nn as snn``.

Activations: ``relu``, ``relu6``, ``sigmoid``, ``silu`` / ``swish``, ``gelu`` (``approximate=True``, the tanh
form, is jax.nn.gelu's default and GPT-2's; ``approximate=False`` is the exact x * Phi(x) with erf, PyTorch's
``nn.GELU()`` default: port PyTorch code with ``approximate=False``), ``softplus``, ``log_sigmoid``, ``elu``,
``leaky_relu``, ``tanh``, ``hard_tanh``; ``softmax`` / ``log_softmax`` (with ``where``), ``one_hot``,
``standardize``, ``dot_product_attention`` (jax.nn's: causal masks, grouped kv heads). Layers and losses:
``layer_norm``, ``rms_norm``, ``cross_entropy`` (integer labels, PyTorch's reductions and ``ignore_index``),
``dropout`` (on ``spmd_runtime.random``: the same mask on any mesh), ``embedding``.

Every reduction runs over static axes; masks are ``where`` selects, so gradients never meet a NaN. Called
outside a trace (on DArrays, or NumPy arrays under a context mesh) each function runs eagerly as one cached
program, as ``snp``'s functions do (``spmd_runtime/eager.py``).
"""
from __future__ import annotations

import math

import numpy as np

from . import numpy as snp
from . import random
from .dtypes import finfo
from . import dispatch
from .ops.core import stop_gradient
from .ops.special import gelu_exact
from .trace import Tensor

__all__ = ["relu", "relu6", "sigmoid", "silu", "swish", "gelu", "softplus", "log_sigmoid", "elu", "leaky_relu",
           "tanh", "hard_tanh", "softmax", "log_softmax", "logsumexp", "one_hot", "standardize",
           "dot_product_attention", "layer_norm", "rms_norm", "cross_entropy", "dropout", "embedding"]

tanh = snp.tanh
logsumexp = snp.logsumexp


# ================================================================ activations
def relu(x):
    return snp.maximum(x, 0)


def relu6(x):
    return snp.minimum(snp.maximum(x, 0), 6)


def sigmoid(x):
    """1 / (1 + exp(-x)): ``snp.sigmoid`` (the logistic op: it computes exp(-|x|) only, so nothing overflows)."""
    return snp.sigmoid(x)


def silu(x):
    """x * sigmoid(x) (swish; Llama's SwiGLU gate)."""
    return x * sigmoid(x)


swish = silu


def gelu(x, approximate: bool = True):
    """GELU. ``approximate=True`` (jax.nn.gelu's default, GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)));
    ``approximate=False``: the exact 0.5 x (1 + erf(x / sqrt 2)), which PyTorch's ``nn.GELU()`` computes by
    default (the two differ by up to ~1.5e-4 at |x| ~ 2), evaluated as 0.5 x erfc(-x / sqrt 2) so the negative
    tail keeps its relative accuracy (as JAX); one op (``gelu_exact``), whose backward needs only x."""
    if approximate:
        return 0.5 * x * (1.0 + snp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return gelu_exact(x)


def softplus(x):
    """log(1 + exp(x)) without overflow: x + log1p(exp(-x)) for x > 0, log1p(exp(x)) otherwise (each branch
    fed only its own side, so neither overflows and no NaN reaches the gradient)."""
    positive = x > 0
    above, below = snp.where(positive, x, 0.0), snp.where(positive, 0.0, x)
    return snp.where(positive, above + snp.log1p(snp.exp(-above)), snp.log1p(snp.exp(below)))


def log_sigmoid(x):
    return -softplus(-x)


def elu(x, alpha=1.0):
    """x for x > 0, alpha (exp(x) - 1) otherwise."""
    below = snp.where(x > 0, 0.0, x)
    return snp.where(x > 0, x, alpha * snp.expm1(below))


def leaky_relu(x, negative_slope=1e-2):
    return snp.where(x >= 0, x, negative_slope * x)


def hard_tanh(x):
    """x clipped to [-1, 1]."""
    return snp.where(x > 1, 1.0, snp.where(x < -1, -1.0, x))


# ================================================================ softmax and friends
def softmax(x, axis=-1, where=None):
    """Numerically safe softmax: subtract the row max before exp (a constant for differentiation, as JAX's and
    PyTorch's softmax: the result does not depend on it). ``where``: a boolean mask broadcastable to x; masked
    entries are 0 and take no part (jax.nn.softmax's ``where``)."""
    shifted = _shifted(x, axis, where)
    e = snp.exp(shifted)
    if where is not None:
        e = snp.where(where, e, 0.0)
    return e / snp.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis=-1, where=None):
    """x - logsumexp(x) along ``axis`` (the shift by the max is a constant for differentiation)."""
    shifted = _shifted(x, axis, where)
    e = snp.exp(shifted)
    if where is not None:
        e = snp.where(where, e, 0.0)
    out = shifted - snp.log(snp.sum(e, axis=axis, keepdims=True))
    return out if where is None else snp.where(where, out, -np.inf)


def _shifted(x, axis, where):
    """x minus its (masked) max along ``axis``; masked entries hold 0 (they are then dropped by the caller)."""
    x = snp.asarray(x)
    if where is None:
        return x - stop_gradient(snp.max(x, axis=axis, keepdims=True))
    lowest = float(finfo(x.dtype).min)
    peak = stop_gradient(snp.max(snp.where(where, x, lowest), axis=axis, keepdims=True))
    return snp.where(where, x - peak, 0.0)


def one_hot(x, num_classes: int, dtype="float32", axis=-1):
    """``x[..., None] == arange(num_classes)`` as ``dtype``, the class dim at ``axis`` (jax.nn.one_hot); ids
    outside [0, num_classes) give all zeros."""
    x = snp.asarray(x)
    if isinstance(num_classes, Tensor) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"one_hot needs a static num_classes >= 1; got {num_classes!r}")
    ndim = x.ndim + 1
    axis = int(axis) % ndim if -ndim <= int(axis) < ndim else _bad_axis(axis, ndim)
    # the classes as (1, ..., C, ..., 1), broadcast by the comparison: a full-shape iota would be a buffer as big
    # as the logits (int32 (b, t, vocab) in a language model's loss) that the fused comparison never needs
    classes = snp.broadcasted_iota(x.dtype, (1,) * axis + (int(num_classes),) + (1,) * (ndim - 1 - axis), axis)
    return snp.astype(snp.expand_dims(x, axis) == classes, dtype)


def _bad_axis(axis, ndim):
    raise ValueError(f"axis must be in [-{ndim}, {ndim}); got {axis}")


def standardize(x, axis=-1, mean=None, variance=None, epsilon=1e-5):
    """(x - mean) / sqrt(variance + epsilon) along ``axis`` (mean and variance computed when not given)."""
    if mean is None:
        mean = snp.mean(x, axis=axis, keepdims=True)
    centred = x - mean
    if variance is None:
        variance = snp.mean(centred * centred, axis=axis, keepdims=True)
    return centred / snp.sqrt(variance + epsilon)


# ================================================================ attention
def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False):
    """jax.nn.dot_product_attention: softmax(q k^T * scale + bias, masked) v.

    Shapes (B, T, N, H) for query, (B, S, K, H) for key and value (the batch dim B may be absent in all
    three); N must be a multiple of K: each group of N / K query heads shares one kv head (grouped-query
    attention; K = 1 is multi-query). ``scale`` defaults to 1 / sqrt(H); ``bias`` and the boolean ``mask``
    broadcast to (B, N, T, S); ``is_causal``: query t sees keys s <= t. Scores and softmax run in float32 at
    least; masked scores are -0.7 * the dtype's max, so a fully masked row averages its values (as JAX)."""
    q, k, v = snp.asarray(query), snp.asarray(key), snp.asarray(value)
    batched = q.ndim == 4
    if not batched:
        q, k, v = (snp.expand_dims(t, 0) for t in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"dot_product_attention needs query (B, T, N, H) and key, value (B, S, K, H) (B optional "
                         f"in all three); got {query.shape}, {key.shape}, {value.shape}")
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    if n % kv:
        raise ValueError(f"dot_product_attention needs the query heads N to be a multiple of the kv heads K (each "
                         f"K head serves N / K query heads); got N={n}, K={kv}")
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    compute = np.result_type(q.dtype, np.float32)
    grouped = snp.reshape(snp.astype(q, compute), (b, t, kv, n // kv, h))
    logits = snp.einsum("btkgh,bskh->bkgts", grouped, snp.astype(k, compute)) * scale
    logits = snp.reshape(logits, (b, n, t, s))
    if bias is not None:
        logits = logits + snp.astype(bias, compute)
    keep = _attention_mask(mask, is_causal, t, s)
    if keep is not None:
        logits = snp.where(keep, logits, -0.7 * float(finfo(compute).max))
    probs = softmax(logits, axis=-1)
    probs = snp.reshape(probs, (b, kv, n // kv, t, s))
    out = snp.einsum("bkgts,bskh->btkgh", probs, snp.astype(v, compute))
    out = snp.astype(snp.reshape(out, (b, t, n, h)), q.dtype)
    return out if batched else snp.reshape(out, out.shape[1:])


def _attention_mask(mask, is_causal, t, s):
    keep = None if mask is None else snp.astype(mask, "bool")
    if is_causal:
        causal = snp.broadcasted_iota("int32", (t, s), 0) >= snp.broadcasted_iota("int32", (t, s), 1)
        keep = causal if keep is None else snp.logical_and(keep, causal)
    return keep


# ================================================================ layers and losses
def layer_norm(x, gamma=None, beta=None, eps=1e-5):
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps), times ``gamma`` and plus ``beta`` when given
    (PyTorch's ``F.layer_norm(x, (d,), weight, bias, eps)``; nanoGPT's ``bias=False`` passes no beta)."""
    out = standardize(x, axis=-1, epsilon=eps)
    if gamma is not None:
        out = out * gamma
    return out if beta is None else out + beta


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps), times ``weight`` when given (Llama's)."""
    out = x / snp.sqrt(snp.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if weight is None else out * weight


def cross_entropy(logits, labels, reduction="mean", ignore_index=None):
    """Softmax cross-entropy of ``logits`` (..., C) (classes LAST, as optax; PyTorch's class dim is 1) against
    integer ``labels`` (...): logsumexp(logits) - logits[label], per entry. ``reduction``: 'mean' (over the
    entries whose label is not ``ignore_index``, as PyTorch), 'sum' or 'none'. Picking logits[label] is a
    one-hot select and sum, so a class dim split over ranks needs no gather. Written as logsumexp minus the picked
    (shifted) logit, not as -sum(log_softmax * one_hot): the same bits (one nonzero term, and -(a - b) is b - a),
    but its gradient needs no sum of the one-hot over the classes (GPT-2's 50304: a full pass over the logits'
    size); and picked by a select, not a product with a float one-hot: 2x faster per pass as a compiled loop
    (no bool-to-float conversion), and a -inf logit of another class gives no NaN (-inf * 0)."""
    logits, labels = snp.asarray(logits), snp.asarray(labels)
    if labels.dtype.kind not in "iu" or logits.shape[:-1] != labels.shape:
        raise ValueError(f"cross_entropy takes logits (..., C) and integer labels (...) of the leading shape; got "
                         f"logits {logits.shape}, labels {labels.dtype}{list(labels.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy's reduction is 'mean', 'sum' or 'none'; got {reduction!r}")
    shifted = _shifted(logits, -1, None)
    picked = snp.sum(snp.where(one_hot(labels, logits.shape[-1], "bool"), shifted, 0.0), axis=-1)
    loss = snp.log(snp.sum(snp.exp(shifted), axis=-1)) - picked
    counted = None if ignore_index is None else labels != ignore_index
    if counted is not None:
        loss = snp.where(counted, loss, 0.0)
    if reduction == "none":
        return loss
    total = snp.sum(loss)
    if reduction == "sum":
        return total
    return total / (loss.size if counted is None else snp.sum(snp.astype(counted, loss.dtype)))


def dropout(key, x, rate: float, deterministic: bool = False):
    """Zero each entry with probability ``rate`` and scale the kept ones by 1 / (1 - rate) (Flax's Dropout);
    the identity when ``deterministic`` or rate == 0. The mask is ``random.bernoulli(key, 1 - rate, x.shape)``:
    the same for a key on any mesh and sharding, each rank drawing only its block."""
    if not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"dropout's rate is a probability in [0, 1]; got {rate!r}")
    if deterministic or rate == 0.0:
        return x
    x = snp.asarray(x)
    if rate == 1.0:
        return snp.zeros(x.shape, x.dtype)
    keep = random.bernoulli(key, 1.0 - float(rate), x.shape)
    return snp.where(keep, x / (1.0 - float(rate)), 0.0)


def embedding(table, ids):
    """Rows of ``table`` (V, D) for integer ``ids`` of any shape: (..., D); as ``jnp.take``'s default mode 'fill',
    ids in [-V, 0) wrap and ids outside [-V, V) give NaN rows (nothing is clamped silently)."""
    return snp.take(table, ids, axis=0)


# Eager outside a trace, one program per call (``snp``'s dispatch; ``tanh`` and ``logsumexp`` are snp's own).
dispatch.wrap_functions(globals(), __all__)
