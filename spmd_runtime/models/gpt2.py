"""GPT-2 as nanoGPT defines it (karpathy/nanoGPT ``model.py``), written on the public API the way jax.numpy code
is written: ``spmd_runtime.numpy`` as snp, ``spmd_runtime.nn`` as snn, ``spmd_runtime.random`` as srandom. It is
meant to be read as example code as much as used.

Parameters are a flat dict keyed by nanoGPT's ``state_dict`` names (``transformer.wte.weight``,
``transformer.h.0.attn.c_attn.weight``, ...; ``param_shapes``), each weight in ``nn.Linear``'s [out, in]
layout, so a PyTorch state dict maps onto it one to one. The output layer is tied to the token embedding:
nanoGPT's ``lm_head.weight`` is ``transformer.wte.weight`` (``TIED``), held once. ``bias=False`` drops every
Linear and LayerNorm bias, as nanoGPT does.

    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)
    params = init_params(cfg, seed=0)                        # nanoGPT's init, NumPy arrays
    logits, loss = forward(cfg, params, idx, targets)        # inside sr.jit / sr.value_and_grad
    tokens = generate(cfg, params, idx, 20, temperature=0.0)  # KV-cache decode, greedy

Dropout (``cfg.dropout`` > 0 with ``train=True``) draws its masks from ``key`` (``srandom.key(seed)``): the
same masks for a key on any mesh and sharding, each rank drawing only its own block.

Sharding hints: the model never names a mesh. ``param_roles(cfg)`` gives every parameter's ``ParamRole``
(``models/roles.py``: which dim tensor parallelism splits), the same hints the built-in LM declares; the
training presets turn roles into specs for any model that states them::

    from spmd_runtime.train import PRESETS, param_layout
    preset = PRESETS["megatron"].on(mesh)
    layout = param_layout(param_shapes(cfg), param_roles(cfg), mesh, preset)
    params = {n: sr.device_put(w, sr.P(*layout.held[n]), mesh) for n, w in layout.hold(params).items()}

``layout.hold`` views each c_attn weight (3d, d) as (3, d, d) and bias (3d,) as (3, d) (``QKV``: q, k and v
blocks, each split over heads; free, the same bytes) and ``layout.release`` reshapes back to the state dict's;
every other parameter is held in its state-dict shape. ``layout.held`` is how each parameter lives between steps, ``layout.use`` how the model uses it (they differ
under fsdp: ``sr.mesh_split(w, mesh, layout.use[n], grad_spec=layout.held[n])`` gathers the weight where it is
used and reduce-scatters its gradient), and the batch goes on ``preset.batch``. A user model states its hints
the same way: a dict name -> ``ParamRole`` (``LINEAR_COLUMN`` / ``LINEAR_ROW`` for [out, in] weights, the
shared ``COLUMN`` / ``ROW`` for [in, out] ones). Everything in between (activations, the KV cache) follows by
propagation: megatron's head split comes from the fused ``c_attn`` weight viewed as (3, heads, head dim, d), a
local reshape of its held (3, d, d) split within the blocks, so a training step moves no c_attn weight.
AdamW's weight decay goes on ``decayed(cfg)`` (pass ``matrices=``: a held c_attn bias has 2 dims).
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import nn as snn
from .. import numpy as snp
from .. import random as srandom
from ..darray import DArray, device_put
from ..jit import jit
from ..sharding import P
from .lm import EMBEDDING, POSITIONAL
from .roles import COLUMN_BIAS, LINEAR_COLUMN, LINEAR_ROW, NORM, ROW_BIAS, ParamRole

# c_attn fuses q, k and v: its out dim is 3 blocks of heads, held as (3, d, ...) and split within the blocks, so
# each rank holds its heads' q, k and v and attention's (3, heads, head size, d) view of it is a local reshape
QKV = ParamRole("fused q, k, v column-parallel weight [3 out, in]", tensor=0, blocks=3)
QKV_BIAS = ParamRole("fused q, k, v column-parallel bias [3 out]", tensor=0, blocks=3)
# the tied token embedding: under FSDP used in its vocab split (the lookup and the head's logits vocab-parallel,
# as Megatron's), so the (vocab, d) table is never gathered
TIED_EMBEDDING = dataclasses.replace(EMBEDDING, kind="tied embedding", vocab_parallel=True)
TIED = {"lm_head.weight": "transformer.wte.weight"}  # nanoGPT's state_dict holds the tied head under both names


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's GPTConfig, plus ``gelu_approximate``: False is nanoGPT's exact ``nn.GELU()``, True the tanh form
    of OpenAI's GPT-2 (Hugging Face's ``gelu_new``)."""
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    gelu_approximate: bool = False

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig {name} must be a positive int; got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig needs n_embd to be a multiple of n_head; got n_embd={self.n_embd}, "
                             f"n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig dropout is a probability in [0, 1); got {self.dropout!r}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


# ================================================================ parameters
def _layer_shapes(cfg: GPTConfig, i: int) -> list:
    d, h = cfg.n_embd, f"transformer.h.{i}."
    linears = [("attn.c_attn", 3 * d, d), ("attn.c_proj", d, d), ("mlp.c_fc", 4 * d, d), ("mlp.c_proj", d, 4 * d)]
    shapes = {name: [(f"{h}{name}.weight", (out, inp))] + ([(f"{h}{name}.bias", (out,))] if cfg.bias else [])
              for name, out, inp in linears}
    return _norm(cfg, h + "ln_1") + shapes["attn.c_attn"] + shapes["attn.c_proj"] + _norm(cfg, h + "ln_2") + \
        shapes["mlp.c_fc"] + shapes["mlp.c_proj"]


def _norm(cfg: GPTConfig, name: str) -> list:
    return [(name + ".weight", (cfg.n_embd,))] + ([(name + ".bias", (cfg.n_embd,))] if cfg.bias else [])


def param_shapes(cfg: GPTConfig) -> "OrderedDict[str, tuple[int, ...]]":
    """nanoGPT's parameter name -> shape, in its ``named_parameters`` order (the tied head held once)."""
    shapes = [("transformer.wte.weight", (cfg.vocab_size, cfg.n_embd)),
              ("transformer.wpe.weight", (cfg.block_size, cfg.n_embd))]
    for i in range(cfg.n_layer):
        shapes += _layer_shapes(cfg, i)
    return OrderedDict(shapes + _norm(cfg, "transformer.ln_f"))


def param_role(name: str) -> ParamRole:
    """The sharding role of nanoGPT parameter ``name``: the vocab of the (tied) embedding, the heads of c_attn
    (within each of its q, k, v blocks) and the hidden dim of c_fc (column-parallel) and the inputs of both
    c_proj (row-parallel) split by tensor parallelism; positions and LayerNorms replicated."""
    if name == "transformer.wte.weight":
        return TIED_EMBEDDING
    if name == "transformer.wpe.weight":
        return POSITIONAL
    module, kind = name.rsplit(".", 1)
    if module.endswith(("ln_1", "ln_2", "ln_f")):
        return NORM
    if module.endswith("c_attn"):
        return QKV if kind == "weight" else QKV_BIAS
    column = module.endswith("c_fc")
    if kind == "weight":
        return LINEAR_COLUMN if column else LINEAR_ROW
    return COLUMN_BIAS if column else ROW_BIAS


def param_roles(cfg: GPTConfig) -> "OrderedDict[str, ParamRole]":
    """name -> sharding role of every parameter, in ``param_shapes`` order."""
    return OrderedDict((n, param_role(n)) for n in param_shapes(cfg))


def decayed(cfg: GPTConfig) -> set:
    """The parameters AdamW decays (nanoGPT's ``configure_optimizers``: those of 2 or more dims in its state
    dict; pass as ``update(..., matrices=)``, as a held c_attn bias (3, d) has 2 dims)."""
    return {n for n, shape in param_shapes(cfg).items() if len(shape) >= 2}


def init_params(cfg: GPTConfig, seed: int = 0, dtype="float32") -> dict:
    """nanoGPT's initialisation: every Linear and Embedding weight normal(0, 0.02), the residual projections
    (``c_proj.weight``) normal(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm gains 1; drawn from ``seed`` in
    name order, so the same arrays on every rank."""
    rng = np.random.default_rng(seed)
    out = {}  # a plain dict (pytrees tell dict from OrderedDict), in param_shapes order
    for name, shape in param_shapes(cfg).items():
        if param_role(name) is NORM:
            value = np.ones(shape) if name.endswith(".weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            value = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            value = rng.normal(0.0, std, shape)
        out[name] = value.astype(dtype)
    return out


# ================================================================ the model
def linear(x, weight, bias=None):
    """``nn.Linear``: x @ weight.T + bias, weight [out, in]."""
    y = snp.einsum("...i,oi->...o", x, weight)
    return y if bias is None else y + bias


def _dropout(cfg: GPTConfig, key, x, train: bool):
    return snn.dropout(key, x, cfg.dropout, deterministic=not train or key is None)


def attention(cfg: GPTConfig, p: dict, prefix: str, x, key=None, train=False, cache=None, pos=0):
    """Causal self-attention of ``x`` (b, t, d). The fused c_attn weight (3d, d), or its held view (3, d, d)
    (``QKV``), is viewed as (3, heads, head size, d), so q, k and v come out head-major and a head split of that
    view (tensor parallelism) keeps the attention local. ``cache``: this layer's {"k", "v"} (b, block_size, heads, head size); x holds positions
    pos .. pos + t - 1 (``pos`` an int, or a traced int32 with t == 1), written into it functionally. Returns
    (y, the new cache or None)."""
    b, t, d = x.shape
    nh, hs = cfg.n_head, cfg.head_size
    w = snp.reshape(p[prefix + "c_attn.weight"], (3, nh, hs, d))
    qkv = snp.einsum("btc,shec->sbthe", x, w)  # (3, b, t, heads, head size)
    if cfg.bias:
        qkv = qkv + snp.reshape(p[prefix + "c_attn.bias"], (3, 1, 1, nh, hs))
    q, k, v = qkv[0], qkv[1], qkv[2]
    if cache is not None:
        k, v = _cached(cache["k"], k, pos), _cached(cache["v"], v, pos)
        cache = {"k": k, "v": v}
    keys = k.shape[1]
    scores = snp.einsum("bqhe,bkhe->bhqk", q, k) * (1.0 / math.sqrt(hs))
    query_pos = snp.arange(t, dtype="int32")[:, None] + pos  # key j is visible from query i when j <= i
    visible = snp.arange(keys, dtype="int32")[None, :] <= query_pos
    att = snn.softmax(snp.where(visible, scores, -snp.inf), axis=-1)
    att = _dropout(cfg, key if key is None else key[0], att, train)
    y = snp.reshape(snp.einsum("bhqk,bkhe->bqhe", att, v), (b, t, d))
    y = linear(y, p[prefix + "c_proj.weight"], p.get(prefix + "c_proj.bias"))
    return _dropout(cfg, key if key is None else key[1], y, train), cache


def _cached(cache, new, pos):
    """``cache`` (b, block_size, heads, head size) with ``new`` (b, t, ...) written at positions pos .. pos + t - 1."""
    if isinstance(pos, int):
        return cache.at[:, pos:pos + new.shape[1]].set(new)
    return cache.at[:, pos].set(new[:, 0])  # a traced position: one token (a dynamic_update_slice)


def mlp(cfg: GPTConfig, p: dict, prefix: str, x, key=None, train=False):
    h = linear(x, p[prefix + "c_fc.weight"], p.get(prefix + "c_fc.bias"))
    h = snn.gelu(h, approximate=cfg.gelu_approximate)
    y = linear(h, p[prefix + "c_proj.weight"], p.get(prefix + "c_proj.bias"))
    return _dropout(cfg, key, y, train)


def block(cfg: GPTConfig, p: dict, i: int, x, keys=None, train=False, cache=None, pos=0):
    h = f"transformer.h.{i}."
    attended, cache = attention(cfg, p, h + "attn.", _layer_norm(p, h + "ln_1", x),
                                None if keys is None else keys[:2], train, cache, pos)
    x = x + attended
    return x + mlp(cfg, p, h + "mlp.", _layer_norm(p, h + "ln_2", x), None if keys is None else keys[2], train), cache


def _layer_norm(p: dict, name: str, x):
    return snn.layer_norm(x, p[name + ".weight"], p.get(name + ".bias"), eps=1e-5)


def hidden_states(cfg: GPTConfig, params: dict, idx, key=None, train=False, cache=None, pos=0):
    """The final LayerNorm's output (b, t, d) for int tokens ``idx`` (b, t) at positions pos .. pos + t - 1, and
    the new KV cache (a list of per-layer {"k", "v"}, or None without one)."""
    t = idx.shape[1]
    if isinstance(pos, int) and pos + t > cfg.block_size:
        raise ValueError(f"GPT sees at most block_size={cfg.block_size} positions; got {t} tokens at position {pos} "
                         f"(crop the context to its last block_size tokens)")
    keys = None if key is None or not train or cfg.dropout == 0 else srandom.split(key, 1 + 3 * cfg.n_layer)
    positions = snp.arange(t, dtype="int32") + pos
    x = snn.embedding(params["transformer.wte.weight"], idx) + snn.embedding(params["transformer.wpe.weight"],
                                                                             positions)
    x = _dropout(cfg, None if keys is None else keys[0], x, train)
    new_cache = None if cache is None else []
    for i in range(cfg.n_layer):
        layer_keys = None if keys is None else keys[1 + 3 * i:4 + 3 * i]
        x, layer_cache = block(cfg, params, i, x, layer_keys, train, None if cache is None else cache[i], pos)
        if cache is not None:
            new_cache.append(layer_cache)
    return _layer_norm(params, "transformer.ln_f", x), new_cache


def lm_head(params: dict, x):
    """Logits of the tied output layer: x @ wte.T."""
    return linear(x, params["transformer.wte.weight"])


def logits(cfg: GPTConfig, params: dict, idx, key=None, train=False):
    """(b, t, vocab) next-token logits at every position."""
    return lm_head(params, hidden_states(cfg, params, idx, key, train)[0])


def forward(cfg: GPTConfig, params: dict, idx, targets=None, key=None, train=False):
    """nanoGPT's ``GPT.forward``: with ``targets`` (b, t) the logits at every position and the mean
    cross-entropy (targets of -1 ignored); without them the logits of the last position only (b, 1, vocab) and
    None. ``train=True`` with ``cfg.dropout`` > 0 applies dropout with masks drawn from ``key``."""
    x, _ = hidden_states(cfg, params, idx, key, train)
    if targets is None:
        return lm_head(params, x[:, [-1], :]), None
    out = lm_head(params, x)
    return out, snn.cross_entropy(out, targets, ignore_index=-1)


def loss(cfg: GPTConfig, params: dict, idx, targets, key=None, train=False):
    """The mean cross-entropy alone (what ``sr.value_and_grad`` differentiates)."""
    return forward(cfg, params, idx, targets, key, train)[1]


# ================================================================ generation
def empty_cache(cfg: GPTConfig, batch: int, dtype="float32") -> list:
    """A zero KV cache of ``batch`` sequences: per layer {"k", "v"} (batch, block_size, heads, head size)."""
    shape = (batch, cfg.block_size, cfg.n_head, cfg.head_size)
    return [{"k": snp.zeros(shape, dtype), "v": snp.zeros(shape, dtype)} for _ in range(cfg.n_layer)]


def sample(logits_last, key, temperature: float, top_k: int | None):
    """Next tokens (b,) int32 from the last position's logits (b, vocab): argmax when ``temperature`` == 0,
    else a draw from softmax(logits / temperature) restricted to the ``top_k`` largest (nanoGPT's sampling)."""
    if temperature == 0:
        return snp.astype(snp.argmax(logits_last, axis=-1), "int32")
    scaled = logits_last / temperature
    if top_k is not None:
        kth = snp.top_k(scaled, min(top_k, scaled.shape[-1]))[0][:, [-1]]
        scaled = snp.where(scaled < kth, -snp.inf, scaled)
    return srandom.categorical(key, scaled, axis=-1)


def prefill(cfg: GPTConfig, params: dict, idx, key, temperature: float = 0.0, top_k: int | None = None):
    """The prompt ``idx`` (b, t) through the model at positions 0 .. t - 1, filling a new KV cache: (the first
    sampled tokens (b,), the cache)."""
    x, cache = hidden_states(cfg, params, idx, cache=empty_cache(cfg, idx.shape[0], params[
        "transformer.wte.weight"].dtype), pos=0)
    return sample(lm_head(params, x[:, -1, :]), srandom.fold_in(key, idx.shape[1]), temperature, top_k), cache


def decode_step(cfg: GPTConfig, params: dict, cache, token, pos, key, temperature: float = 0.0,
                top_k: int | None = None):
    """One token per sequence (``token`` (b,)) at the traced position ``pos`` (an int32 scalar) against the
    cache: (the next tokens (b,), the updated cache). One program serves every position."""
    x, cache = hidden_states(cfg, params, token[:, None], cache=cache, pos=pos)
    return sample(lm_head(params, x[:, -1, :]), srandom.fold_in(key, pos + 1), temperature, top_k), cache


def sample_uncached(cfg: GPTConfig, params: dict, idx, key, temperature: float = 0.0, top_k: int | None = None):
    """The next tokens of the full context ``idx`` (b, t <= block_size) without a cache (nanoGPT's loop, used
    once a sequence outgrows the block and its positions shift)."""
    x, _ = hidden_states(cfg, params, idx)
    return sample(lm_head(params, x[:, -1, :]), key, temperature, top_k)


_JITTED = {}  # (function, batch axes, head axes) -> its jit, the KV cache pinned to (batch, -, heads, -)


def _jitted(fn, n_layer: int, batch: tuple, heads: tuple):
    """``fn`` (prefill, decode_step or sample_uncached) under ``jit``: tokens split over ``batch`` axes, and the
    cache it returns over ``batch`` and its head dim over ``heads`` (tensor parallelism: each rank keeps its
    heads' keys and values)."""
    key = (fn, n_layer, batch, heads)
    if key not in _JITTED:
        rows = P(batch or None)
        cache = [{"k": P(batch or None, None, heads or None, None)} for _ in range(n_layer)]
        cache = [{"k": c["k"], "v": c["k"]} for c in cache]
        outs = rows if fn is sample_uncached else (rows, cache)
        _JITTED[key] = jit(fn, static_argnums=(0, 6, 7) if fn is decode_step else (0, 4, 5),
                           donate_argnums=(2,) if fn is decode_step else (), out_specs=outs)
    return _JITTED[key]


def _head_axes(params: dict, batch: tuple) -> tuple:
    """The mesh axes splitting the heads where the model uses them: those splitting the out dim of the first
    c_attn weight (a DArray: the fused (3d, d) or a view with its heads on dim 1), less the batch's."""
    w = params["transformer.h.0.attn.c_attn.weight"]
    if not isinstance(w, DArray):
        return ()
    return tuple(a for a in w.sharding.dims[0 if w.ndim == 2 else 1] if a not in batch)


def _head_major(cfg: GPTConfig, params: dict, heads: tuple) -> dict:
    """``params`` with each c_attn weight (3d, d) and bias (3d,) laid out once as the (3, heads, head size, ...)
    view attention takes, split over ``heads``: a contiguous split of 3d is not a head split, so decode steps
    would otherwise reshard every c_attn weight for every token (megatron's layout holds the (3, d, ...) view,
    split within the blocks: kept as it is). ``attention`` takes any of these shapes."""
    fused = [n for n in params if n.endswith("attn.c_attn.weight") and params[n].ndim == 2 or
             n.endswith("attn.c_attn.bias") and params[n].ndim == 1]  # not views already split over heads
    if not heads or not fused:
        return params
    key = ("head-major", cfg, heads)
    if key not in _JITTED:
        shapes = {n: (3, cfg.n_head, cfg.head_size) + params[n].shape[1:] for n in fused}
        specs = {n: P(None, heads, *[None] * (len(shapes[n]) - 2)) for n in fused}
        _JITTED[key] = jit(lambda ws: {n: snp.reshape(w, shapes[n]) for n, w in ws.items()}, out_specs=specs)
    return {**params, **_JITTED[key]({n: params[n] for n in fused})}


def generate(cfg: GPTConfig, params: dict, idx, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, key=None, batch_axes=()):
    """nanoGPT's ``GPT.generate``: ``idx`` (b, t) continued by ``max_new_tokens`` tokens, returned as a NumPy
    int array (b, t + max_new_tokens). The prompt is one prefill filling a KV cache, each new token one decode
    step against it (functional cache updates; the same program for every position). ``temperature`` == 0 is
    greedy; else softmax(logits / temperature) sampled over the ``top_k`` largest with keys from ``key``
    (``srandom.key(seed)``; default key(0)): token p of a sequence is drawn with ``fold_in(key, p)``, the same
    on any mesh.

    Sharded as training is: on the mesh of DArray ``params`` (or the context mesh), partitioned as they are laid
    out; with megatron's layout the decode is tensor-parallel and the cache split over heads like c_attn's out
    dim. ``batch_axes`` (a preset's ``batch``) split the sequences. Past ``block_size`` tokens the context is
    cropped to its last block_size (as nanoGPT) and each step runs the whole block uncached."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate's max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"generate's temperature must be >= 0 (0: greedy); got {temperature!r}")
    idx = np.asarray(idx).astype("int32")
    key = srandom.key(0) if key is None else np.asarray(key)
    # NumPy weights become replicated DArrays once: a jit call digests its NumPy arguments, every decode step
    params = {n: w if isinstance(w, DArray) else device_put(w) for n, w in params.items()}
    batch = tuple(batch_axes)
    layout = (cfg.n_layer, batch, _head_axes(params, batch))
    params = _head_major(cfg, params, layout[2])
    if max_new_tokens == 0:
        return idx
    context = idx[:, -cfg.block_size:]
    token, cache = _jitted(prefill, *layout)(cfg, params, context, key, temperature, top_k)
    tokens, pos = [token], context.shape[1]
    for _ in range(max_new_tokens - 1):
        if pos < cfg.block_size:
            token, cache = _jitted(decode_step, *layout)(cfg, params, cache, token, np.int32(pos), key, temperature,
                                                         top_k)
        else:  # the block is full: nanoGPT crops the context, so every position shifts
            so_far = np.concatenate([idx] + [np.asarray(x)[:, None] for x in tokens], axis=1)
            token = _jitted(sample_uncached, *layout)(cfg, params, so_far[:, -cfg.block_size:],
                                                      srandom.fold_in(key, pos + 1), temperature, top_k)
        tokens.append(token)
        pos += 1
    return np.concatenate([idx] + [np.asarray(x).astype("int32")[:, None] for x in tokens], axis=1)


__all__ = ["GPTConfig", "LINEAR_COLUMN", "LINEAR_ROW", "QKV", "QKV_BIAS", "TIED", "param_shapes", "param_role",
           "param_roles", "decayed", "init_params", "linear", "attention", "mlp", "block", "hidden_states", "lm_head", "logits", "forward",
           "loss", "empty_cache", "sample", "prefill", "decode_step", "sample_uncached", "generate"]
