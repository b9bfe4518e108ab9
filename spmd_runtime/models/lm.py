"""A decoder-only Transformer language model (GPT-2 shape) as a traced function.

Token + learned positional embedding, ``layers`` pre-LayerNorm blocks (causal
multi-head self-attention, GELU MLP, residuals), a final LayerNorm and an output
layer (tied to the embedding or its own matrix), then softmax cross-entropy
averaged over every token. The family of the published configs: optional biases
on every projection, a per-head dim independent of d / heads, gated FFNs (GEGLU,
SwiGLU), GShard MoE blocks. Every op is an ordinary traced primitive, so the
loss, its gradient (``sr.value_and_grad``) and a whole training step partition
like any other graph; how is decided only by annotations (``spmd_runtime.train``).

Parameters are an ordered dict name -> array (``param_shapes``); the traced
loss takes them in that order. Names are Python identifiers, so a traced step
names its inputs after them. Each parameter has a sharding role
(``PARAM_ROLES``, ``param_roles``: which dims tensor and expert parallelism
split), so a trainer lays parameters out by role, never by name.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from .. import numpy as snp
from ..checkpoint import SliceOf, StackOf
from ..dtypes import FLOATING
from ..nn import gelu
from ..ops.control import remat, save_only_these_names, scan
from ..ops.core import stop_gradient
from ..pipeline import micro_batches, pipeline, stages_of_layers
from .moe import (ALL_TO_ALL_NAMES, EXPERT_COLUMN, EXPERT_ROW, GATE_DTYPE, ROUTER, Gating, MoEConfig, check_moe,
                  moe_ffn, one_hot)
from .roles import COLUMN, COLUMN_BIAS, NORM, ROW_BIAS, ParamRole
from .transformer import PARAM_ROLES as BLOCK_ROLES

STACKED = "layers_"  # with scan_layers, block parameter k of every layer is "layers_<k>", shape (layers, ...)
# with scan_layers and MoE blocks: the layers run as a scan over groups of ``moe_every`` blocks (the last one MoE),
# "layers<r>_<k>" holding parameter k of block r of every group, shape (layers / moe_every, ...)
GROUPED = re.compile(r"layers(\d+)_(\w+)")
# "full_save_all_to_all": full recompute, but an MoE layer's all-to-all results (``moe.ALL_TO_ALL_NAMES``) are
# saved, so the recomputed forward sends nothing again (dense blocks: the same as "full")
REMAT_POLICIES = {"none": None, "full": "nothing_saveable", "dots": "dots_saveable",
                  "full_save_all_to_all": save_only_these_names(*ALL_TO_ALL_NAMES)}
BLOCK_PARAMS = ("ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "ln2_g", "ln2_b", "w1", "w2")
MOE_BLOCK_PARAMS = ("ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "ln2_g", "ln2_b", "wg", "we1", "we2")
GATE_PARAMS = ("w3",)  # gated FFNs: the gate's projection (d, ffn), beside w1
ATTENTION_BIASES = ("wq_b", "wk_b", "wv_b", "wo_b")  # ``bias=True``: "<weight>_b" is the bias of <weight>
FFN_BIASES = ("w1_b", "w2_b")
ALL_BLOCK_PARAMS = BLOCK_PARAMS + GATE_PARAMS + ATTENTION_BIASES + FFN_BIASES + ("w3_b",)
FFN_KINDS = ("gelu", "geglu", "swiglu")  # GELU MLP; gated GELU / SiLU (Shazeer 2020, T5 v1.1, GShard, PaLM)
MASKED_SCORE = -1e9  # finite, so a masked score times a zero cotangent never makes a NaN (float16: -max/2)

# Sharding hints: the role of each parameter kind (``param_kind``); tensor parallelism splits the vocab of the
# embedding and output layer, the heads and MLP hidden dim of the blocks
EMBEDDING = ParamRole("embedding", tensor=0)  # (vocab, d)
OUTPUT = ParamRole("output layer", tensor=1)  # (d, vocab)
POSITIONAL = ParamRole("positional table")  # (seq, d): replicated
PARAM_ROLES = {"embed": EMBEDDING, "pos": POSITIONAL, "lnf_g": NORM, "lnf_b": NORM, "unembed": OUTPUT,
               **BLOCK_ROLES,  # the Megatron block's, as transformer.py declares them
               "wg": ROUTER, "we1": EXPERT_COLUMN, "we2": EXPERT_ROW,  # MoE blocks: moe_ffn's wg, w1, w2
               "w3": COLUMN, **{k: COLUMN_BIAS for k in ("wq_b", "wk_b", "wv_b", "w1_b", "w3_b")},
               "wo_b": ROW_BIAS, "w2_b": ROW_BIAS}


@dataclass(frozen=True)
class LMConfig:
    layers: int = 2
    d: int = 256
    heads: int = 8
    ffn: int = 1024
    vocab: int = 1024
    seq: int = 128
    batch: int = 8
    tied: bool = False
    dtype: str = "float32"  # compute: activations, gradients and their communication
    param_dtype: str | None = None  # master weights and optimizer state; None: float32 for 16-bit dtype, else dtype
    embedding: str = "auto"  # "take" (gather), "onehot" (Mesh-TF contraction), "auto": take when available
    # GShard mixture of experts: every ``moe_every``-th block (0: none) has an MoE feed-forward of ``experts``
    # experts (hidden dim ``ffn`` each), groups = sequences; ``aux_coef`` weighs the load-balancing loss
    moe_every: int = 0
    experts: int = 0
    top_k: int = 2
    capacity_factor: float = 2.0
    aux_coef: float = 0.01
    # layers as ONE sr.scan over parameters stacked on a leading layer dim; None (default): scanned for dense
    # models, unrolled for MoE ones (their MoE and dense blocks differ; see ``scanned``)
    scan_layers: bool | None = None
    remat: str = "none"  # what the backward pass recomputes of each layer: "none", "full", "dots" or
    #                      "full_save_all_to_all" (REMAT_POLICIES; scanned layers: the scan's policy; unrolled
    #                      ones, as MoE models run: each block its own remat)
    # the model family of the published configs: per-head dim independent of d / heads (GShard's 16 x 128 at
    # d = 1024; None: d // heads), biases on every projection (GPT-2, Megatron: "<weight>_b"), and the dense
    # FFN: "gelu" (GELU MLP), "geglu" / "swiglu" (gated: act(x w1) * (x w3), then w2; Shazeer 2020)
    head_dim: int | None = None
    bias: bool = False
    ffn_kind: str = "gelu"

    def __post_init__(self):
        if self.head_dim is None and self.d % self.heads:
            raise ValueError(f"LMConfig needs d to be a multiple of heads; got d={self.d}, heads={self.heads} "
                             f"(or set head_dim: the per-head dim need not be d // heads)")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"LMConfig head_dim must be a positive int or None (d // heads); got {self.head_dim!r}")
        if self.ffn_kind not in FFN_KINDS:
            raise ValueError(f"LMConfig ffn_kind must be one of {FFN_KINDS}; got {self.ffn_kind!r}")
        for name in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMConfig sizes must be >= 1; got {name}={getattr(self, name)}")
        if self.embedding not in ("auto", "take", "onehot"):
            raise ValueError(f"LMConfig embedding must be 'auto', 'take' or 'onehot'; got {self.embedding!r}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in FLOATING):
                raise ValueError(f"LMConfig {name} must be one of {FLOATING}; got {value!r}")
            if value is not None:
                dtypes.dtype(value)  # bfloat16 without ml_dtypes: say which package is missing
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"LMConfig remat must be one of {sorted(REMAT_POLICIES)}; got {self.remat!r}")
        if self.scan_layers not in (None, True, False):
            raise ValueError(f"LMConfig scan_layers must be True, False or None (auto); got {self.scan_layers!r}")
        if self.scan_layers and self.moe_every and self.layers % self.moe_every:
            raise ValueError(f"LMConfig scan_layers with MoE blocks scans whole groups of moe_every blocks; got "
                             f"layers={self.layers}, moe_every={self.moe_every}: make moe_every divide layers, or "
                             f"scan_layers=False")
        if self.moe_every or self.experts:
            if not 1 <= self.moe_every <= self.layers:
                raise ValueError(f"LMConfig moe_every must be in [1, layers] for a mixture of experts (every "
                                 f"moe_every-th block is MoE); got moe_every={self.moe_every}, layers={self.layers}")
            check_moe(self.experts, self.top_k, self.capacity_factor)

    @property
    def scanned(self) -> bool:
        """Whether the layers run as one scan over stacked parameters: ``scan_layers``, or when it is None
        (the default) for dense models. An MoE model's scan (``scan_layers=True``) runs over groups of
        ``moe_every`` blocks; by default MoE models run unrolled."""
        return (not self.moe_every) if self.scan_layers is None else self.scan_layers

    @property
    def master_dtype(self) -> str:
        """The dtype of the parameters and optimizer state held between steps (mixed precision: float32)."""
        return self.param_dtype or ("float32" if dtypes.is_low_precision(self.dtype) else self.dtype)

    @property
    def moe(self) -> "MoEConfig | None":
        return MoEConfig(self.experts, self.top_k, self.capacity_factor) if self.moe_every else None

    def is_moe_block(self, i: int) -> bool:
        """GShard: the second block of every ``moe_every`` (every other block for moe_every=2) is MoE."""
        return bool(self.moe_every) and (i + 1) % self.moe_every == 0

    @property
    def head_size(self) -> int:
        """The per-head dim: ``head_dim``, or d // heads."""
        return self.head_dim or self.d // self.heads

    @property
    def gated(self) -> bool:
        return self.ffn_kind != "gelu"

    def block_params(self, i: int = 0) -> tuple[str, ...]:
        """Parameter kinds of block ``i`` (with scanned layers every block's): the base ones first, so a model
        without biases or gate keeps the names and initial values it always had."""
        attention = ATTENTION_BIASES if self.bias else ()
        if self.is_moe_block(i):  # the experts' FFN has no biases
            return MOE_BLOCK_PARAMS + attention
        gate = GATE_PARAMS if self.gated else ()
        ffn = FFN_BIASES + tuple(k + "_b" for k in gate) if self.bias else ()
        return BLOCK_PARAMS + gate + attention + ffn

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


def block_shapes(cfg: LMConfig) -> dict:
    """Block parameter kind -> shape of one layer's parameter."""
    d, f, e, inner = cfg.d, cfg.ffn, cfg.experts, cfg.heads * cfg.head_size
    return {"ln1_g": (d,), "ln1_b": (d,), "wq": (d, inner), "wk": (d, inner), "wv": (d, inner), "wo": (inner, d),
            "ln2_g": (d,), "ln2_b": (d,), "w1": (d, f), "w2": (f, d), "wg": (d, e), "we1": (e, d, f),
            "we2": (e, f, d), "w3": (d, f), "wq_b": (inner,), "wk_b": (inner,), "wv_b": (inner,), "wo_b": (d,),
            "w1_b": (f,), "w3_b": (f,), "w2_b": (d,)}


def param_shapes(cfg: LMConfig) -> "OrderedDict[str, tuple[int, ...]]":
    """name -> shape, in the order the traced loss takes them."""
    d, block = cfg.d, block_shapes(cfg)
    shapes = OrderedDict(embed=(cfg.vocab, d), pos=(cfg.seq, d))
    if cfg.scanned and cfg.moe_every:  # one stack per block of a group
        groups = cfg.layers // cfg.moe_every
        shapes.update((f"layers{r}_{k}", (groups,) + block[k])
                      for r in range(cfg.moe_every) for k in cfg.block_params(r))
    elif cfg.scanned:
        shapes.update((STACKED + k, (cfg.layers,) + block[k]) for k in cfg.block_params())
    for i in range(0 if cfg.scanned else cfg.layers):
        shapes.update((f"l{i}_{k}", block[k]) for k in cfg.block_params(i))
    shapes.update(lnf_g=(d,), lnf_b=(d,))
    if not cfg.tied:
        shapes["unembed"] = (d, cfg.vocab)
    return shapes


def param_kind(name: str) -> str:
    """The kind of a parameter regardless of its layer: 'wq', 'ln1_g', 'embed', ..."""
    if name.startswith(STACKED):
        return name[len(STACKED):]
    grouped = GROUPED.fullmatch(name)
    if grouped:
        return grouped.group(2)
    return name.split("_", 1)[1] if name[0] == "l" and name.split("_", 1)[0][1:].isdigit() else name


def is_stacked(name: str) -> bool:
    """Whether ``name`` holds one block parameter of every layer (or group of blocks) on a leading dim (scanned
    layers)."""
    return name.startswith(STACKED) or GROUPED.fullmatch(name) is not None


def layer_key(name: str) -> str:
    """The key a scan's body reads the slice of stacked parameter ``name`` by: its kind ('wq'); in a group of
    blocks, '<r>_<kind>' ('1_we1': block r of the group)."""
    grouped = GROUPED.fullmatch(name)
    return f"{grouped.group(1)}_{grouped.group(2)}" if grouped else param_kind(name)


def stacked_layers(cfg: "LMConfig", name: str) -> list[int]:
    """The unrolled layers whose parameter stacked ``name`` holds, in order (block r of each group)."""
    grouped = GROUPED.fullmatch(name)
    if grouped is None:
        return list(range(cfg.layers))
    return list(range(int(grouped.group(1)), cfg.layers, cfg.moe_every))


def param_role(name: str) -> ParamRole:
    """The sharding role of parameter ``name``: its kind's (``PARAM_ROLES``), stacked on the layer dim when
    ``name`` holds every layer's."""
    role = PARAM_ROLES[param_kind(name)]
    return role.stack() if is_stacked(name) else role


def param_roles(cfg: LMConfig) -> "OrderedDict[str, ParamRole]":
    """name -> sharding role of every parameter, in ``param_shapes`` order."""
    return OrderedDict((n, param_role(n)) for n in param_shapes(cfg))


def layer_views(cfg: LMConfig, names) -> dict:
    """How a checkpoint of the other layer layout reads into ``names`` (parameters, and optimizer state named
    <prefix><parameter>): a stacked "<prefix>layers_<k>" is the stack of "<prefix>l<i>_<k>" over the layers,
    an unrolled "<prefix>l<i>_<k>" is slice i of "<prefix>layers_<k>" (MoE groups: "<prefix>layers<r>_<k>" stacks
    layers r, r + moe_every, ...). The stacked layout is a view of the
    same parameters, so checkpoints written either way load into both."""
    views, kinds = {}, "|".join(ALL_BLOCK_PARAMS + MOE_BLOCK_PARAMS)
    for name in names:
        stacked = re.fullmatch(rf"(.*)layers(\d*)_({kinds})", name)
        unrolled = re.fullmatch(rf"(.*)l(\d+)_({kinds})", name)
        if stacked:
            prefix, r, kind = stacked.groups()
            views[name] = StackOf(tuple(f"{prefix}l{i}_{kind}" for i in stacked_layers(cfg, f"layers{r}_{kind}")))
        elif unrolled and cfg.moe_every:  # block i % moe_every of group i // moe_every
            prefix, i, kind = unrolled.groups()
            views[name] = SliceOf(f"{prefix}layers{int(i) % cfg.moe_every}_{kind}", int(i) // cfg.moe_every)
        elif unrolled:
            prefix, i, kind = unrolled.groups()
            views[name] = SliceOf(f"{prefix}{STACKED}{kind}", int(i))
    return views


def init_params(cfg: LMConfig, seed: int = 0) -> "OrderedDict[str, np.ndarray]":
    """GPT-2 style initialisation, drawn from ``seed`` in name order: the same arrays on every rank and mesh.
    With scan_layers the layer parameters are the same arrays as without, stacked."""
    if cfg.scanned:
        flat = init_params(dataclasses.replace(cfg, scan_layers=False, remat="none"), seed)
        return OrderedDict((n, np.stack([flat[f"l{i}_{param_kind(n)}"] for i in stacked_layers(cfg, n)])
                            if is_stacked(n) else flat[n]) for n in param_shapes(cfg))
    rng = np.random.default_rng(seed)
    residual_scale = 1.0 / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections shrink with depth
    out = OrderedDict()
    for name, shape in param_shapes(cfg).items():
        kind = param_kind(name)
        if kind.endswith("_g"):  # LayerNorm gains; "_b": LayerNorm and projection biases
            value = np.ones(shape)
        elif kind.endswith("_b"):
            value = np.zeros(shape)
        else:
            std = 0.02 * (residual_scale if kind in ("wo", "w2", "we2") else 1.0)
            value = rng.standard_normal(shape) * std
        out[name] = value.astype(cfg.master_dtype)
    return out


def no_annotation(x, role):
    return x


def lm_loss(cfg: LMConfig, params, tokens, labels, annotate=no_annotation):
    """Mean next-token cross-entropy of the model with ``params`` (in ``param_shapes`` order) on int
    ``tokens``/``labels`` of shape (batch, seq).

    ``annotate(x, role)`` may pin the sharding of intermediate values (it returns x, possibly passed
    through ``mesh_split``); roles: 'residual' (batch, seq, d) between sublayers, 'normed' (batch, seq, d) each
    sublayer's LayerNorm output (the input of its first matmul), 'hidden' (batch, seq, d or ffn) the input of its
    last matmul (heads concatenated, or the MLP's hidden activation), 'logits' (batch, seq, vocab),
    and in MoE blocks the roles of ``models.moe`` ('groups', 'expert_in', 'expert_hidden').
    With MoE blocks the loss includes ``aux_coef`` times the summed load-balancing losses.
    """
    return lm_loss_and_metrics(cfg, params, tokens, labels, annotate)[0]


def lm_loss_and_metrics(cfg: LMConfig, params, tokens, labels, annotate=no_annotation, run_layers=None):
    """(loss, metrics): metrics is {} for a dense model, else {'aux_loss', 'dropped_fraction'} (traced
    scalars: the summed load-balancing losses, and the fraction of routed token-expert assignments dropped
    at full experts, over all MoE blocks). ``run_layers``: how the scanned layers run (``_forward``)."""
    logits, gatings = _forward(cfg, params, tokens, annotate, run_layers)
    logits = annotate(logits, "logits")
    if dtypes.is_low_precision(logits.dtype):  # the softmax cross-entropy in float32, as mixed precision does
        logits = snp.astype(logits, "float32")
    loss = cross_entropy(logits, labels)
    if not gatings:
        return loss, {}
    aux = gatings[0].aux_loss
    dropped, routed = gatings[0].dropped, gatings[0].routed
    for g in gatings[1:]:
        aux, dropped, routed = aux + g.aux_loss, dropped + g.dropped, routed + g.routed
    loss = loss + snp.astype(aux * cfg.aux_coef, loss.dtype)
    return loss, {"aux_loss": aux, "dropped_fraction": dropped / routed}


def lm_logits(cfg: LMConfig, params, tokens, annotate=no_annotation):
    """(batch, seq, vocab) next-token logits for int ``tokens`` of shape (any batch, cfg.seq)."""
    return _forward(cfg, params, tokens, annotate)[0]


def _forward(cfg: LMConfig, params, tokens, annotate, run_layers=None):
    """Logits and every MoE block's Gating scalars (aux loss, dropped, routed). ``run_layers(block, x,
    stacked)`` runs the scanned layers
    (default: one ``sr.scan``; the pipeline preset passes ``pipelined_layers``)."""
    p = dict(zip(param_shapes(cfg), params))
    x = annotate(embed(cfg, p["embed"], tokens) + positional(p["pos"], tokens.shape[0]), "residual")
    gatings = []
    if cfg.scanned and cfg.moe_every:  # ONE loop over the groups of blocks
        x, gatings = _grouped_layers(cfg, p, x, annotate, run_layers)
    elif cfg.scanned:  # ONE loop over the stacked (dense) layers: traced and partitioned once
        block = lambda x, layer: dense_block(cfg, x, layer, annotate)
        stacked = {k: p[STACKED + k] for k in cfg.block_params()}
        x = (run_layers or scan_layers)(cfg, block, x, stacked)
    for i in range(0 if cfg.scanned else cfg.layers):
        layer = {k: p[f"l{i}_{k}"] for k in cfg.block_params(i)}
        run = _unrolled_block(cfg, i, annotate)
        x, stats = (remat(run, REMAT_POLICIES[cfg.remat]) if cfg.remat != "none" else run)(x, layer)
        gatings += [Gating(None, None, *stats)] if cfg.is_moe_block(i) else []
    h = layer_norm(x, p["lnf_g"], p["lnf_b"])
    logits = snp.einsum("bsd,vd->bsv", h, p["embed"]) if cfg.tied else h @ p["unembed"]
    return logits, gatings


def _unrolled_block(cfg: LMConfig, i: int, annotate):
    """Block ``i`` of unrolled layers as ``(x, layer) -> (x, stats)``, the unit ``remat`` recomputes: ``stats``
    an MoE block's gating scalars (aux loss, dropped, routed; its (G, S, E, C) tensors stay inside), () for a
    dense block."""
    def run(x, layer):
        x = _attend(cfg, x, layer, annotate)
        if not cfg.is_moe_block(i):
            return annotate(_dense_ffn(cfg, x, layer, annotate), "residual"), ()
        a = layer_norm(x, layer["ln2_g"], layer["ln2_b"])  # groups = sequences: (batch, seq, d) is (G, S, M)
        y, gating = moe_ffn(a, layer["wg"], layer["we1"], layer["we2"], cfg.moe, annotate)
        return annotate(x + y, "residual"), (gating.aux_loss, gating.dropped, gating.routed)
    return run


def _grouped_layers(cfg: LMConfig, p: dict, x, annotate, run_layers=None):
    """The layers of an MoE model as ONE scan over groups of ``moe_every`` blocks (the last one MoE), the
    parameters of block r of every group stacked ("layers<r>_<kind>"); the carry is the residual and the MoE
    blocks' gating scalars summed (aux loss, dropped, routed). Returns (x, [their Gating])."""
    k = cfg.moe_every
    stacked = {layer_key(n): p[n] for n in p if GROUPED.fullmatch(n)}

    def group(carry, layer):
        x, stats = carry
        for r in range(k):
            x, s = _unrolled_block(cfg, r, annotate)(x, {kind: layer[f"{r}_{kind}"] for kind in cfg.block_params(r)})
            stats = tuple(a + b for a, b in zip(stats, s)) if s else stats
        return x, stats
    zero = snp.zeros((), GATE_DTYPE)
    x, stats = (run_layers or scan_layers)(cfg, group, (x, (zero, zero, zero)), stacked)
    return x, [Gating(None, None, *stats)]


def scan_layers(cfg: LMConfig, block, x, stacked):
    """The layers as ONE scan of ``block`` over the parameters stacked on their leading layer dim."""
    return scan(lambda x, layer: (block(x, layer), None), x, stacked, policy=REMAT_POLICIES[cfg.remat])[0]


def pipelined_layers(mesh, microbatches: int, stage_axis: str = "stage", param_specs=None, state_spec=None):
    """A ``run_layers`` (``lm_loss_and_metrics``): the L stacked layers as S pipeline stages of L/S consecutive
    layers each (S the size of mesh axis ``stage_axis``; layer l is on stage l // (L/S), so the layer dim split
    over that axis is each rank holding its stage), run by ``sr.pipeline`` over ``microbatches`` micro-batches
    (rows m, m + M, ... of the batch form micro-batch m, so a batch split stays local). Each stage scans its
    layers. ``param_specs``: block parameter kind -> spec of its dims after the layer dim; ``state_spec``: the
    spec of one micro-batch's residual (batch / M, seq, d)."""
    def run(cfg: LMConfig, block, x, stacked):
        s = mesh.axis_size(stage_axis)
        xs = micro_batches(x, microbatches)  # [M, b/M, seq, d]
        params = {k: stages_of_layers(v, s) for k, v in stacked.items()}  # stage j's layers at [:, j]
        specs = {k: (None,) + tuple((param_specs or {}).get(k) or (None,) * (v.ndim - 1)) for k, v in stacked.items()}
        ys = pipeline(lambda p, h: scan_layers(cfg, block, h, p), params, xs, mesh=mesh, stage_axis=stage_axis,
                      stage_dim=1, param_specs=specs, state_spec=state_spec)
        return snp.reshape(snp.transpose(ys, (1, 0, 2, 3)), x.shape)
    return run


def dense_block(cfg: LMConfig, x, layer, annotate):
    """One pre-LayerNorm block on the residual ``x``: (batch, seq, d), or (stages, batch, seq, d) with
    parameters carrying a leading stage dim too (every pipeline stage at once)."""
    return annotate(_dense_ffn(cfg, _attend(cfg, x, layer, annotate), layer, annotate), "residual")


def _attend(cfg: LMConfig, x, layer, annotate):
    """A block's first half: x plus the attention of its first LayerNorm."""
    normed = annotate(layer_norm(x, layer["ln1_g"], layer["ln1_b"]), "normed")
    return annotate(x + attention(cfg, layer, normed, annotate), "residual")


def _dense_ffn(cfg: LMConfig, x, layer, annotate=no_annotation):
    """``x`` plus the FFN of its second LayerNorm (a dense block's second half): the GELU MLP, or a gated one,
    act(a w1) * (a w3) (``ffn_kind``: GELU for "geglu", SiLU for "swiglu")."""
    a = annotate(layer_norm(x, layer["ln2_g"], layer["ln2_b"]), "normed")
    hidden = _linear(a, layer, "w1")
    if cfg.ffn_kind == "gelu":
        hidden = gelu(hidden)
    else:
        hidden = (gelu(hidden) if cfg.ffn_kind == "geglu" else silu(hidden)) * _linear(a, layer, "w3")
    return x + _linear(annotate(hidden, "hidden"), layer, "w2")


def silu(x):
    """SiLU (swish): x * sigmoid(x)."""
    return x / (1.0 + snp.exp(-x))


def _linear(x, layer, name):
    """``x @ layer[name]``, plus its bias ``layer[name + "_b"]`` where the model has biases."""
    y = _matmul(x, layer[name])
    bias = layer.get(name + "_b")
    return y if bias is None else y + _broadcast_row(y, bias)


def _staged(x) -> str:
    """The einsum letter of the leading stage dim of a (stages, batch, seq, d) activation, "" for (batch, seq, d)."""
    return "z" if x.ndim == 4 else ""


def _matmul(x, w):
    """(batch, seq, d) @ (d, e); per stage with a leading stage dim on both."""
    z = _staged(x)
    return snp.einsum(f"{z}bsd,{z}de->{z}bse", x, w) if z else x @ w


def embed(cfg: LMConfig, table, tokens):
    """Rows of ``table`` (vocab, d) for int ``tokens``: a gather (``take``), or Mesh-TensorFlow's one-hot
    contraction, which partitions over a vocab split like any contraction."""
    use_take = cfg.embedding in ("take", "auto")
    if use_take:
        return snp.take(table, tokens, axis=0, mode="clip")  # token ids are in range: no fill select needed
    return snp.einsum("bsv,vd->bsd", one_hot(tokens, table.shape[0], table.dtype), table)


# Parameters broadcast over batch and sequence (positional table, LayerNorm gain and bias) are applied as
# einsums (with a constant of ones for the additive ones) rather than broadcast products/sums. Their gradients
# are then einsums contracting batch and sequence, which the partitioner reduces locally and reduce-scatters
# when the gradient is wanted split (weight-update sharding); the VJP of a broadcast is a ``reduce``, whose
# partition rule instead all-to-alls the whole batch-split cotangent onto the gradient's split first.
def positional(pos, batch: int):
    """The (seq, d) positional table broadcast over ``batch``."""
    return snp.einsum("b,sd->bsd", snp.ones((batch,), pos.dtype), pos)


def layer_norm(x, gain, bias, eps=1e-5):
    """LayerNorm over the last dim of (batch, seq, d) ``x`` (or (stages, batch, seq, d) with a per-stage gain, or
    one gain for every stage: its gradient then one contraction over stages, batch and seq)."""
    mu = snp.mean(x, axis=-1, keepdims=True)
    centred = x - mu
    xhat = centred / snp.sqrt(snp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    z = _staged(x)
    return snp.einsum(f"{z}bsd,{_staged_row(x, gain)}d->{z}bsd", xhat, gain) + _broadcast_row(x, bias)


def _broadcast_row(x, row):
    """The last-dim vector ``row`` (per stage with a leading stage dim, or one for every stage) broadcast to ``x``'s
    shape (see above)."""
    z = _staged(x)
    return snp.einsum(f"{z}bs,{_staged_row(x, row)}d->{z}bsd", snp.ones(x.shape[:-1], x.dtype), row)


def _staged_row(x, row) -> str:
    """The stage letter of a last-dim vector: "z" where both ``x`` and ``row`` have the stage dim."""
    return _staged(x) if row.ndim == 2 else ""


def attention(cfg: LMConfig, w: dict, a, annotate=no_annotation):
    """Causal multi-head self-attention of the normalised residual ``a`` (batch, seq, d) (or with a leading
    stage dim, every stage with its own weights)."""
    z = _staged(a)
    *lead, s, d = a.shape
    h, hd = cfg.heads, cfg.head_size
    q, k, v = (_linear(a, w, name).reshape(*lead, s, h, hd) for name in ("wq", "wk", "wv"))
    scores = snp.einsum(f"{z}bqhd,{z}bkhd->{z}bhqk", q, k) * (1.0 / math.sqrt(hd))
    causal = snp.asarray(np.tril(np.ones((s, s), dtype=bool)))  # query q sees keys k <= q
    masked = max(MASKED_SCORE, -float(dtypes.finfo(scores.dtype).max) / 2)
    probs = safe_softmax(snp.where(causal, scores, masked))
    heads = annotate(snp.einsum(f"{z}bhqk,{z}bkhd->{z}bqhd", probs, v).reshape(*lead, s, h * hd), "hidden")
    return _linear(heads, w, "wo")


def safe_softmax(x):
    e = snp.exp(x - stop_gradient(snp.max(x, axis=-1, keepdims=True)))
    return e / snp.sum(e, axis=-1, keepdims=True)


def log_softmax(z):
    """log softmax over the last dim, shifted by the row max so exp never overflows."""
    shifted = z - stop_gradient(snp.max(z, axis=-1, keepdims=True))
    return shifted - snp.log(snp.sum(snp.exp(shifted), axis=-1, keepdims=True))


def cross_entropy(logits, labels, axis=None):
    """Mean over tokens of -log p(label) (over ``axis`` of the token dims, all by default: e.g. per pipeline stage);
    labels picked by a one-hot compare (partitions over a vocab split)."""
    picked = snp.sum(snp.where(snp.expand_dims(labels, -1) == snp.asarray(np.arange(logits.shape[-1],
                                                                                    dtype=labels.dtype)),
                               log_softmax(logits), 0.0), axis=-1)
    return -snp.mean(picked, axis=axis)


__all__ = ["LMConfig", "param_shapes", "param_kind", "param_role", "param_roles", "PARAM_ROLES", "is_stacked",
           "layer_key", "stacked_layers",
           "layer_views", "pipelined_layers", "init_params", "lm_loss", "lm_loss_and_metrics", "lm_logits",
           "cross_entropy", "embed"]
