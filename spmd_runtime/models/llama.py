"""Llama 2 (the ``Transformer`` of Karpathy's llama2.c ``model.py``) written on the public API as jax.numpy
code would be: ``spmd_runtime.numpy`` as snp, ``spmd_runtime.nn`` as snn, ``spmd_runtime.random`` as srandom.

The model: token embedding, ``n_layers`` pre-norm blocks (RMSNorm; causal self-attention with rotary position
embeddings (RoPE, its cos / sin precomputed as llama2.c does and applied in real arithmetic) and grouped-query
attention (``n_kv_heads`` key / value heads, each shared by ``n_heads / n_kv_heads`` query heads:
``repeat_kv``); RMSNorm; SwiGLU feed-forward w2(silu(w1 x) * w3 x)), a final RMSNorm and the output layer; the
loss is the mean cross-entropy (``ignore_index=-1``). Dropout (embedding, attention probabilities, both
residual branches) draws its masks from a key (``spmd_runtime.random``), so a mask is the same on any mesh.

Parameters are a dict with llama2.c's state_dict names and PyTorch's layouts (``nn.Linear`` weights are
[out, in]), so a PyTorch state dict loads as it is: ``tok_embeddings.weight``,
``layers.{i}.attention.wq/wk/wv/wo.weight``, ``layers.{i}.feed_forward.w1/w2/w3.weight``,
``layers.{i}.attention_norm.weight``, ``layers.{i}.ffn_norm.weight``, ``norm.weight``, ``output.weight``. The
output layer has its own matrix by default (Llama 2's); ``ModelArgs(tie_embeddings=True)`` ties it to the
embedding as llama2.c does (no ``output.weight`` then).

Sharding hints (``param_roles``): each parameter's role says which dim tensor (Megatron) parallelism splits:
the rows of wq / wk / wv / w1 / w3 (heads, FFN hidden), the columns of wo / w2, the vocab of the embedding and
output layer; the norms are replicated. ``annotate(x, role)`` pins activations with the built-in LM's roles
('residual', 'normed', 'hidden', 'logits'), so ``train.model_layout(...).activation`` applies a preset
(dp, fsdp, megatron, ...). The pipeline preset takes the layers stacked (``stacked_param_shapes`` /
``stacked_param_roles``: 'layers.<kind>' of shape (n_layers, ...); ``stack_layers`` / ``unstack_layers`` convert
state dicts) and ``pipelined_loss``, which runs them as GPipe stages over the preset's stage axis. Example (``scripts/llama_vs_torch.py`` compares it with llama2.c's PyTorch model)::

    import spmd_runtime as sr
    from spmd_runtime.models import llama
    from spmd_runtime.train import PRESETS, model_layout, train_mesh

    args = llama.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
    params = llama.init_params(args, seed=0)
    mesh = train_mesh((2, 2), "megatron")
    layout = model_layout(mesh, PRESETS["megatron"], llama.param_shapes(args), llama.param_roles(args))
    loss_and_grads = sr.jit(sr.value_and_grad(
        lambda p, x, y: llama.loss(args, p, x, y, annotate=layout.activation)), mesh=mesh,
        in_specs=({n: sr.P(*s) for n, s in layout.use.items()}, sr.P("data"), sr.P("data")))
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import lax
from .. import nn as snn
from .. import numpy as snp
from .. import random as srandom
from ..darray import DArray, device_put
from ..jit import jit
from ..mesh import get_mesh
from ..pipeline import micro_batches, pipeline, stages_of_layers
from ..sharding import P
from .roles import LINEAR_COLUMN, LINEAR_ROW, NORM, ParamRole

VOCAB_ROWS = ParamRole("embedding or output layer [vocab, dim]", tensor=0)
PARAM_ROLES = {"tok_embeddings.weight": VOCAB_ROWS, "attention.wq.weight": LINEAR_COLUMN,
               "attention.wk.weight": LINEAR_COLUMN, "attention.wv.weight": LINEAR_COLUMN,
               "attention.wo.weight": LINEAR_ROW, "feed_forward.w1.weight": LINEAR_COLUMN,
               "feed_forward.w2.weight": LINEAR_ROW, "feed_forward.w3.weight": LINEAR_COLUMN,
               "attention_norm.weight": NORM, "ffn_norm.weight": NORM, "norm.weight": NORM,
               "output.weight": VOCAB_ROWS}
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelArgs:
    """llama2.c's ModelArgs (its defaults: Llama 2 7B), plus ``tie_embeddings`` (llama2.c ties the output layer
    to the embedding; Llama 2 and this model by default do not)."""
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    hidden_dim: int | None = None
    multiple_of: int = 256  # the FFN hidden dim is rounded up to a multiple of this
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive int; got {getattr(self, name)!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"ModelArgs needs dim to be n_heads times an even head dim (RoPE rotates pairs); got "
                             f"dim={self.dim}, n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelArgs needs n_heads to be a multiple of n_kv_heads (each kv head serves "
                             f"n_heads / n_kv_heads query heads); got n_heads={self.n_heads}, "
                             f"n_kv_heads={self.n_kv_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelArgs.dropout is a probability in [0, 1); got {self.dropout!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """llama2.c's FeedForward hidden dim: ``hidden_dim``, or 2/3 of 4 dim rounded up to ``multiple_of``."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# ================================================================ parameters and their sharding hints
def param_shapes(args: ModelArgs) -> "OrderedDict[str, tuple[int, ...]]":
    """name -> shape, in llama2.c's state_dict order."""
    d, kv, f = args.dim, args.kv_heads * args.head_dim, args.ffn_dim
    shapes = OrderedDict([("tok_embeddings.weight", (args.vocab_size, d))])
    for i in range(args.n_layers):
        layer = {"attention.wq.weight": (d, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
                 "attention.wo.weight": (d, d), "feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f),
                 "feed_forward.w3.weight": (f, d), "attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
        shapes.update((f"layers.{i}.{k}", shape) for k, shape in layer.items())
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def param_kind(name: str) -> str:
    """A parameter's name without its layer: 'layers.3.attention.wq.weight' -> 'attention.wq.weight', and so of
    the stacked 'layers.attention.wq.weight' (``stacked_param_shapes``)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return name
    return ".".join(parts[2:] if parts[1].isdigit() else parts[1:])


def param_roles(args: ModelArgs) -> "OrderedDict[str, ParamRole]":
    """name -> sharding role of every parameter, in ``param_shapes`` order."""
    return OrderedDict((n, PARAM_ROLES[param_kind(n)]) for n in param_shapes(args))


# ---------------------------------------------------------------- the layers stacked (for the pipeline presets)
STACKED = "layers."  # "layers.<kind>" holds parameter <kind> of every layer on a leading layer dim


def stacked_param_shapes(args: ModelArgs) -> "OrderedDict[str, tuple[int, ...]]":
    """``param_shapes`` with each block parameter of every layer held once, stacked on a leading layer dim:
    'layers.attention.wq.weight' (n_layers, dim, dim), ...; what a pipeline preset splits into stages."""
    shapes = param_shapes(args)
    first = {param_kind(n): s for n, s in shapes.items() if n.startswith("layers.0.")}
    out = OrderedDict((n, s) for n, s in shapes.items() if not n.startswith("layers."))
    out.update((STACKED + k, (args.n_layers,) + s) for k, s in first.items())
    out.move_to_end("norm.weight")
    if not args.tie_embeddings:
        out.move_to_end("output.weight")
    return out


def stacked_param_roles(args: ModelArgs) -> "OrderedDict[str, ParamRole]":
    """The roles of ``stacked_param_shapes``: a block parameter's role on its leading layer dim (``stack``)."""
    return OrderedDict((n, PARAM_ROLES[param_kind(n)].stack() if n.startswith(STACKED) else PARAM_ROLES[n])
                       for n in stacked_param_shapes(args))


def stack_layers(args: ModelArgs, params: dict) -> dict:
    """llama2.c's per-layer arrays (NumPy) as ``stacked_param_shapes``' (each kind stacked over the layers)."""
    out = {n: w for n, w in params.items() if not n.startswith("layers.")}
    for name in stacked_param_shapes(args):
        if name.startswith(STACKED):
            kind = name[len(STACKED):]
            out[name] = np.stack([np.asarray(params[f"layers.{i}.{kind}"]) for i in range(args.n_layers)])
    return {n: out[n] for n in stacked_param_shapes(args)}


def unstack_layers(args: ModelArgs, params: dict) -> dict:
    """``stack_layers`` undone: llama2.c's state dict of stacked arrays (NumPy)."""
    out = {}
    for name in param_shapes(args):
        parts = name.split(".")
        out[name] = np.asarray(params[STACKED + param_kind(name)])[int(parts[1])] if name.startswith("layers.") \
            else np.asarray(params[name])
    return out


def init_params(args: ModelArgs, seed: int = 0, dtype="float32") -> "dict[str, np.ndarray]":
    """llama2.c's initialisation, drawn from ``seed`` in name order: every Linear and the embedding N(0, 0.02),
    the residual projections (w3, wo) N(0, 0.02 / sqrt(2 n_layers)), the RMSNorm weights ones. A plain dict
    (in ``param_shapes`` order), so ``in_specs`` given as a dict match it."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(args).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype)
            continue
        std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("w3.weight", "wo.weight")) else 0.02
        out[name] = (rng.standard_normal(shape) * std).astype(dtype)
    return out


# ================================================================ the model
def no_annotation(x, role):
    return x


class Dropout:
    """The dropout sites of one forward pass: each call takes the next key of ``key`` (``fold_in`` of a
    counter), so every mask is distinct; no key or rate 0: the identity (llama2.c's eval mode)."""

    def __init__(self, key, rate: float):
        self.key, self.rate, self.count = key, rate, 0

    def __call__(self, x):
        if self.key is None or self.rate == 0.0:
            return x
        self.count += 1
        return snn.dropout(srandom.fold_in(self.key, self.count), x, self.rate)


# Every block function also runs a pipeline's S stages at once: x with a leading stage dim (S, batch, seq, dim)
# and each weight with one too (stage s's weights at [s]), so the stage dim split over ranks is each its stage.
def rms_norm(x, weight, eps: float):
    """llama2.c's RMSNorm: x / sqrt(mean(x^2) + eps) in float32 at least, back in x's dtype, times weight."""
    xf = x.astype(np.promote_types(x.dtype, np.float32))
    normed = xf * snp.rsqrt(snp.mean(xf ** 2, axis=-1, keepdims=True) + eps)
    if weight.ndim > 1:  # (S, dim): stage s's gain over x[s]
        weight = snp.reshape(weight, weight.shape[:1] + (1,) * (x.ndim - 2) + weight.shape[1:])
    return normed.astype(x.dtype) * weight


def linear(x, weight):
    """PyTorch's F.linear without bias: x @ weight.T for a [out, in] weight; stage s's (S, out, in) on x[s]."""
    if weight.ndim == 3:
        return snp.einsum("zbsi,zoi->zbso", x, weight)
    return x @ weight.T


def precompute_freqs_cis(dim: int, end: int, theta: float = ROPE_THETA, dtype="float32"):
    """RoPE's (end, dim / 2) cos and sin of t * theta^(-2i / dim): llama2.c's real and imaginary parts."""
    freqs = 1.0 / (theta ** (snp.arange(0, dim, 2)[: dim // 2].astype(dtype) / dim))
    t = snp.arange(end).astype(dtype)
    freqs = snp.outer(t, freqs)
    return snp.cos(freqs), snp.sin(freqs)


def reshape_for_broadcast(freqs, x):
    """(seq, hd / 2) ``freqs`` shaped to broadcast over x's (..., batch, seq, heads, hd / 2)."""
    return freqs.reshape([d if i in (x.ndim - 3, x.ndim - 1) else 1 for i, d in enumerate(x.shape)])


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    """Rotate each (even, odd) pair of xq's and xk's head dims by its position's angle, as complex numbers in
    real arithmetic (llama2.c's)."""
    xq_r, xq_i = snp.unstack(xq.reshape(xq.shape[:-1] + (-1, 2)), axis=-1)
    xk_r, xk_i = snp.unstack(xk.reshape(xk.shape[:-1] + (-1, 2)), axis=-1)
    cos, sin = reshape_for_broadcast(freqs_cos, xq_r), reshape_for_broadcast(freqs_sin, xq_r)
    xq_out = snp.stack([xq_r * cos - xq_i * sin, xq_r * sin + xq_i * cos], axis=-1).reshape(xq.shape)
    xk_out = snp.stack([xk_r * cos - xk_i * sin, xk_r * sin + xk_i * cos], axis=-1).reshape(xk.shape)
    return xq_out.astype(xq.dtype), xk_out.astype(xk.dtype)


def repeat_kv(x, n_rep: int):
    """(..., batch, seq, kv_heads, hd) -> (..., batch, seq, kv_heads * n_rep, hd), each kv head repeated n_rep
    times in place (torch.repeat_interleave on the kv head dim)."""
    *lead, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    expanded = snp.broadcast_to(snp.expand_dims(x, -2), (*lead, n_kv_heads, n_rep, head_dim))
    return expanded.reshape(*lead, n_kv_heads * n_rep, head_dim)


def project_qkv(args: ModelArgs, w: dict, x, freqs_cos, freqs_sin):
    """Queries (batch, seq, n_heads, hd), keys and values (batch, seq, n_kv_heads, hd) of the normed ``x``,
    queries and keys rotated (RoPE)."""
    lead, hd = x.shape[:-1], args.head_dim
    xq = linear(x, w["attention.wq.weight"]).reshape(*lead, args.n_heads, hd)
    xk = linear(x, w["attention.wk.weight"]).reshape(*lead, args.kv_heads, hd)
    xv = linear(x, w["attention.wv.weight"]).reshape(*lead, args.kv_heads, hd)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
    return xq, xk, xv


def attention(args: ModelArgs, w: dict, x, freqs_cos, freqs_sin, dropout: Dropout, annotate=no_annotation):
    """Causal grouped-query self-attention with RoPE of the normed residual ``x`` (batch, seq, dim)."""
    seqlen, hd = x.shape[-2], args.head_dim
    xq, xk, xv = project_qkv(args, w, x, freqs_cos, freqs_sin)
    n_rep = args.n_heads // args.kv_heads
    xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
    xq, xk, xv = (snp.swapaxes(t, -3, -2) for t in (xq, xk, xv))  # heads as a batch dim: (bsz, heads, seq, hd)
    scores = (xq @ snp.swapaxes(xk, -2, -1)) / math.sqrt(hd)
    scores = scores + snp.triu(snp.full((seqlen, seqlen), -snp.inf, scores.dtype), k=1)  # query t sees keys <= t
    probs = dropout(snn.softmax(scores.astype(np.promote_types(scores.dtype, np.float32)), axis=-1)
                    .astype(xq.dtype))
    output = snp.swapaxes(probs @ xv, -3, -2).reshape(*x.shape[:-1], -1)  # heads concatenated
    return dropout(linear(annotate(output, "hidden"), w["attention.wo.weight"]))


def feed_forward(w: dict, x, dropout: Dropout, annotate=no_annotation):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""
    hidden = snn.silu(linear(x, w["feed_forward.w1.weight"])) * linear(x, w["feed_forward.w3.weight"])
    return dropout(linear(annotate(hidden, "hidden"), w["feed_forward.w2.weight"]))


def transformer_block(args: ModelArgs, w: dict, x, freqs_cos, freqs_sin, dropout: Dropout, annotate=no_annotation):
    """One block; ``w`` holds its parameters by ``param_kind``."""
    normed = annotate(rms_norm(x, w["attention_norm.weight"], args.norm_eps), "normed")
    h = annotate(x + attention(args, w, normed, freqs_cos, freqs_sin, dropout, annotate), "residual")
    normed = annotate(rms_norm(h, w["ffn_norm.weight"], args.norm_eps), "normed")
    return annotate(h + feed_forward(w, normed, dropout, annotate), "residual")


def hidden_states(args: ModelArgs, params: dict, tokens, key=None, annotate=no_annotation):
    """The final RMSNorm's output (batch, seq, dim) for int ``tokens`` (batch, seq <= max_seq_len); with a
    ``key`` (``srandom.key(seed)``) and ``args.dropout`` > 0, dropout as in training."""
    _bsz, seqlen = tokens.shape
    if seqlen > args.max_seq_len:
        raise ValueError(f"llama takes at most max_seq_len={args.max_seq_len} tokens per sequence; got {seqlen}")
    dropout = Dropout(key, args.dropout)
    h = dropout(annotate(snn.embedding(params["tok_embeddings.weight"], tokens), "residual"))
    freqs_cos, freqs_sin = precompute_freqs_cis(args.head_dim, args.max_seq_len, dtype=h.dtype)
    freqs_cos, freqs_sin = freqs_cos[:seqlen], freqs_sin[:seqlen]
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        layer = {n[len(prefix):]: w for n, w in params.items() if n.startswith(prefix)}
        h = transformer_block(args, layer, h, freqs_cos, freqs_sin, dropout, annotate)
    return rms_norm(h, params["norm.weight"], args.norm_eps)


def output_weight(args: ModelArgs, params: dict):
    return params["tok_embeddings.weight" if args.tie_embeddings else "output.weight"]


def logits(args: ModelArgs, params: dict, tokens, key=None, annotate=no_annotation):
    """(batch, seq, vocab) next-token logits of every position."""
    return annotate(linear(hidden_states(args, params, tokens, key, annotate), output_weight(args, params)), "logits")


def loss(args: ModelArgs, params: dict, tokens, targets, key=None, annotate=no_annotation):
    """Mean next-token cross-entropy over the targets that are not -1 (llama2.c's ``ignore_index=-1``)."""
    return cross_entropy(logits(args, params, tokens, key, annotate), targets)


def pipelined_loss(args: ModelArgs, params: dict, tokens, targets, layout, microbatches: int,
                   annotate=no_annotation):
    """``loss`` with the layers run as GPipe pipeline stages (``sr.pipeline``): ``params`` as
    ``stacked_param_shapes`` holds them, laid out by ``layout`` (``train.model_layout`` of the stacked shapes and
    roles under a pipeline preset: the layer dim over its stage axis, S stages of n_layers / S consecutive layers,
    megatron's splits on "model" where the mesh has it); the batch cut into ``microbatches`` micro-batches (rows m,
    m + M, ... form micro-batch m); the embedding, final norm and output layer outside the loop. The same loss as
    ``loss`` of the unstacked parameters (``stack_layers``); no dropout (its sites are numbered per layer)."""
    preset, mesh = layout.preset, layout.mesh
    if not preset.stage or preset.schedule != "gpipe":
        raise ValueError(f"llama.pipelined_loss runs GPipe stages over a pipeline preset's stage axis; got preset "
                         f"{preset.name!r} (stage axes {preset.stage}, schedule {preset.schedule!r})")
    if args.dropout:
        raise ValueError(f"llama.pipelined_loss runs without dropout; got dropout={args.dropout}")
    stages = mesh.axis_size(preset.stage[0])
    if args.n_layers % stages:
        raise ValueError(f"llama.pipelined_loss needs the {stages} stages (mesh axis {preset.stage[0]!r}) to divide "
                         f"n_layers={args.n_layers}")
    seqlen = tokens.shape[1]
    h = annotate(snn.embedding(params["tok_embeddings.weight"], tokens), "residual")
    stacked = {n[len(STACKED):]: w for n, w in params.items() if n.startswith(STACKED)}
    specs = {k: (None,) + tuple(layout.use[STACKED + k][1:]) for k in stacked}  # (layers in stage, stage, ...)

    def stage(layers, x):  # every stage at once: x (S, batch / M, seq, dim), each layer's weights (S, ...)
        cos, sin = (f[:seqlen] for f in precompute_freqs_cis(args.head_dim, args.max_seq_len, dtype=x.dtype))
        block = lambda x, layer: (transformer_block(args, layer, x, cos, sin, Dropout(None, 0.0), annotate), None)
        return lax.scan(block, x, layers)[0]
    ys = pipeline(stage, {k: stages_of_layers(w, stages) for k, w in stacked.items()}, micro_batches(h, microbatches),
                  mesh=mesh, stage_axis=preset.stage[0], stage_dim=1, param_specs=specs,
                  state_spec=(preset.batch or None, preset.seq or None, None))
    h = snp.reshape(snp.transpose(ys, (1, 0, 2, 3)), h.shape)  # micro-batch m's row r is the batch's row r M + m
    h = rms_norm(h, params["norm.weight"], args.norm_eps)
    return cross_entropy(annotate(linear(h, output_weight(args, params)), "logits"), targets)


def cross_entropy(logits, targets):
    """F.cross_entropy of (batch, seq, vocab) logits flattened over the tokens, ignoring targets of -1."""
    return snn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def transformer(args: ModelArgs, params: dict, tokens, targets=None, key=None, annotate=no_annotation):
    """llama2.c's ``Transformer.forward``: with ``targets``, (logits of every position, loss); without, the
    logits of the last position only (batch, 1, vocab), the inference-time shortcut."""
    if targets is not None:
        out = logits(args, params, tokens, key, annotate)
        return out, cross_entropy(out, targets)
    h = hidden_states(args, params, tokens, key, annotate)
    return linear(h[:, [-1], :], output_weight(args, params))  # the list [-1] keeps the time dim


# ================================================================ generation with a KV cache
def init_cache(args: ModelArgs, batch: int, dtype="float32") -> dict:
    """Every layer's keys and values for up to max_seq_len positions: {"k", "v"}, each (n_layers, batch,
    max_seq_len, n_kv_heads, head_dim), zeros."""
    shape = (args.n_layers, batch, args.max_seq_len, args.kv_heads, args.head_dim)
    return {"k": np.zeros(shape, dtype), "v": np.zeros(shape, dtype)}


def decode(args: ModelArgs, params: dict, cache: dict, tokens, pos, annotate=no_annotation):
    """(logits (batch, vocab) of the next token, the updated cache) after ``tokens`` (batch, t) at positions
    pos .. pos + t - 1 (``pos`` an int or a traced 0-d int) attending to the cache's first pos positions and
    themselves: the prompt at pos 0 (prefill), then one token at a time (decode), each shape one program.
    The keys and values of the new positions are written into the cache (``lax.dynamic_update_slice``)."""
    _bsz, t = tokens.shape
    h = snn.embedding(params["tok_embeddings.weight"], tokens)
    freqs_cos, freqs_sin = precompute_freqs_cis(args.head_dim, args.max_seq_len, dtype=h.dtype)
    freqs_cos, freqs_sin = (lax.dynamic_slice_in_dim(f, pos, t) for f in (freqs_cos, freqs_sin))
    # query t' (position pos + t') sees the cached keys at positions <= pos + t'
    visible = snp.arange(args.max_seq_len)[None, :] <= pos + snp.arange(t)[:, None]
    keys, values = cache["k"], cache["v"]
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        layer = {n[len(prefix):]: w for n, w in params.items() if n.startswith(prefix)}
        normed = rms_norm(h, layer["attention_norm.weight"], args.norm_eps)
        xq, xk, xv = project_qkv(args, layer, normed, freqs_cos, freqs_sin)
        keys = lax.dynamic_update_slice(keys, xk[None], (i, 0, pos, 0, 0))
        values = lax.dynamic_update_slice(values, xv[None], (i, 0, pos, 0, 0))
        n_rep = args.n_heads // args.kv_heads
        ck, cv = repeat_kv(keys[i], n_rep), repeat_kv(values[i], n_rep)  # (batch, max_seq_len, n_heads, hd)
        scores = snp.einsum("bqhd,bkhd->bhqk", xq, ck) / math.sqrt(args.head_dim)
        probs = snn.softmax(snp.where(visible, scores, -snp.inf), axis=-1)
        out = snp.einsum("bhqk,bkhd->bqhd", probs, cv).reshape(h.shape[0], t, -1)
        h = h + linear(annotate(out, "hidden"), layer["attention.wo.weight"])
        normed = rms_norm(h, layer["ffn_norm.weight"], args.norm_eps)
        h = h + feed_forward(layer, normed, Dropout(None, 0.0), annotate)
    h = rms_norm(h, params["norm.weight"], args.norm_eps)
    return linear(h[:, -1, :], output_weight(args, params)), {"k": keys, "v": values}


def sample(logits, key=None, temperature: float = 1.0, top_k: int | None = None):
    """llama2.c's choice of the next token from (batch, vocab) logits: the argmax at temperature 0 (or
    without a key), else a draw from softmax(logits / temperature) restricted to the ``top_k`` largest."""
    if temperature == 0.0 or key is None:
        return snp.argmax(logits, axis=-1).astype("int32")
    logits = logits / temperature
    if top_k is not None:
        v, _ = snp.top_k(logits, min(top_k, logits.shape[-1]))
        logits = snp.where(logits < v[:, [-1]], -snp.inf, logits)
    return srandom.categorical(key, logits, axis=-1)


def generate(args: ModelArgs, params: dict, idx, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, key=None, mesh=None):
    """llama2.c's ``generate`` with a KV cache: ``idx`` (batch, t) int tokens followed by ``max_new_tokens``
    more (a NumPy array), one decode step per token; token n is drawn with ``fold_in(key, n)`` (greedy at
    temperature 0 or without a key). Runs under ``mesh`` (default: the context mesh) as two jit programs,
    the prefill and the decode step."""
    idx = np.asarray(idx, dtype=np.int32)
    bsz, t = idx.shape
    if t + max_new_tokens > args.max_seq_len:
        raise ValueError(f"generate keeps at most max_seq_len={args.max_seq_len} tokens in its cache; got a "
                         f"prompt of {t} and max_new_tokens={max_new_tokens}")
    dtype = next(iter(params.values())).dtype
    step = _generation_step(args, temperature, top_k, mesh)
    mesh = mesh or get_mesh(required_by="llama.generate")
    comm = next((w.comm for w in params.values() if isinstance(w, DArray)), None)
    # weights placed once (replicated where they are NumPy), not copied and digested again at every token
    params = {n: w if isinstance(w, DArray) else device_put(w, P(), mesh, comm=comm) for n, w in params.items()}
    out = [idx]
    nxt, cache = step(params, init_cache(args, bsz, dtype), idx, np.int32(0), key, np.int32(0))
    for n in range(max_new_tokens):
        out.append(np.asarray(nxt).reshape(bsz, 1).astype(np.int32))
        if n + 1 < max_new_tokens:
            nxt, cache = step(params, cache, out[-1], np.int32(t + n), key, np.int32(n + 1))
    return np.concatenate(out, axis=1)



@functools.lru_cache(maxsize=32)
def _generation_step(args: ModelArgs, temperature: float, top_k, mesh):
    """The jitted (prefill or decode) step of ``generate``: one per model and sampling choice, so its two
    programs (the prompt's shape and one token's) compile once across calls."""
    def step(params, cache, tokens, pos, key, n):
        logits, cache = decode(args, params, cache, tokens, pos)
        return sample(logits, None if key is None else srandom.fold_in(key, n), temperature, top_k), cache
    return jit(step, mesh=mesh)


__all__ = ["ModelArgs", "param_shapes", "param_kind", "param_roles", "PARAM_ROLES", "init_params", "rms_norm",
           "precompute_freqs_cis", "apply_rotary_emb", "repeat_kv", "attention", "feed_forward",
           "transformer_block", "hidden_states", "logits", "loss", "cross_entropy", "transformer", "project_qkv",
           "init_cache", "decode", "sample", "generate", "STACKED", "stacked_param_shapes", "stacked_param_roles",
           "stack_layers", "unstack_layers", "pipelined_loss"]
