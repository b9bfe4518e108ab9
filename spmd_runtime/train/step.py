"""The traced training step: forward, backward (``value_and_grad``) and optimizer update of the language
model, annotated by a layout; the preset-specific ways to run the scanned layers (FSDP, pipeline) and
gradient accumulation.

Mixed precision (``LMConfig(dtype="bfloat16" | "float16")``): the inputs (master weights, optimizer
state) are ``cfg.master_dtype`` (float32); the step casts the weights to ``cfg.dtype`` before use, so
activations, gradients and their collectives are 16-bit, and casts the reduced gradients back for the
update. float16 steps use ``DynamicLossScale``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import dtypes
from .. import numpy as snp
from .. import pytree
from .. import random as srandom
from ..autodiff import value_and_grad
from ..autodiff.scheduled import pipeline_loss, ring_slots
from ..graph import TensorSpec
from ..models.lm import (STACKED, LMConfig, cross_entropy, dense_block, embed, layer_norm, lm_loss_and_metrics,
                         param_shapes, pipelined_layers, scan_layers)
from ..ops.control import scan
from ..optim import DynamicLossScale, Optimizer
from ..pipeline import micro_batches, stages_of_layers
from ..trace import mesh_split
from .layout import Layout

TOKEN_DTYPE = "int32"


def train_step_fn(cfg: LMConfig, optimizer: Optimizer, layout: Layout, microbatches: int = 1):
    """``step(params, opt_state, batch) -> (new_params, new_opt_state, metrics, loss)``, annotated: ``params``
    a dict name -> weight, ``opt_state`` the optimizer's state tree, ``batch`` ``{"tokens", "labels"}``,
    ``metrics`` a dict of scalars ({} for a dense model)."""
    order = list(param_shapes(cfg))  # the model takes its weights in this order
    run_layers = _run_layers(cfg, layout, microbatches)
    if run_layers and not layout.preset.stage and microbatches > 1:  # FSDP's scanned layers run the whole batch
        raise ValueError(f"preset {layout.preset.name!r} gathers each scanned layer's weights once for the whole "
                         f"batch and does not accumulate micro-batches; got microbatches={microbatches}. Use "
                         f"microbatches=1, or LMConfig(scan_layers=False) to accumulate over unrolled layers")
    # 1F1B: the head and loss run inside the pipeline loop, so the pipeline computes the whole loss
    pipelined_loss = pipeline_1f1b_loss(cfg, layout, microbatches) if layout.preset.schedule == "1f1b" else None

    def loss_fn(ps, tokens, labels, key=None):
        if pipelined_loss:
            return pipelined_loss(ps, tokens, labels), {}
        return lm_loss_and_metrics(cfg, [ps[n] for n in order], tokens, labels, layout.activation, run_layers)
    # the pipeline takes the micro-batches itself (FSDP's scanned layers take M = 1, above)
    return update_step_fn(loss_fn, lambda params: compute_weights(cfg, layout, params), optimizer, layout,
                          param_shapes(cfg), 1 if run_layers else microbatches, metric_names(cfg))


def update_step_fn(loss_fn, compute_fn, optimizer: Optimizer, layout: Layout, shapes: dict, microbatches: int,
                   metrics_kept=(), key_of_step=None):
    """The traced step of ANY model: ``loss_fn(compute weights, tokens, labels, key) -> (loss, metrics)``
    differentiated (its weights from ``compute_fn(params)``), the gradients annotated with their update specs
    and accumulated over ``microbatches`` slices of the batch, then the optimizer's update. ``key_of_step``:
    ``opt_state -> the step's random key`` (None: the loss draws no random numbers, key None)."""
    scaled = isinstance(optimizer, DynamicLossScale)
    # weight decay on matrices only, whether or not the layers are stacked on a leading dim
    matrices = {n for n, shape in shapes.items() if len(shape) - layout.roles[n].stacked >= 2}
    groups = norm_groups(layout)

    def step(params, opt_state, batch):
        compute = compute_fn(params)
        scale = optimizer.loss_scale(opt_state)
        key = None if key_of_step is None else key_of_step(opt_state)

        def loss_and_grads(compute, tokens, labels, key=None):
            def scaled_loss(ps):
                loss, metrics = loss_fn(ps, tokens, labels, key)
                return (loss * scale, metrics) if scaled else (loss, metrics)
            (loss, metrics), grads = value_and_grad(scaled_loss, has_aux=True)(compute)
            loss = loss / scale if scaled else loss
            return loss, metrics, {n: layout.gradient(n, g) for n, g in grads.items()}
        if microbatches == 1:
            loss, metrics, grads = loss_and_grads(compute, batch["tokens"], batch["labels"], key)
        else:
            loss, metrics, grads = accumulate(loss_and_grads, compute, batch["tokens"], batch["labels"],
                                              microbatches, key)
        grads = {n: snp.astype(g, params[n].dtype) for n, g in grads.items()}  # reduced in 16 bits, updated in master
        new_params, new_state = optimizer.update(params, grads, opt_state, matrices, groups)
        new_params = {n: layout.annotate(p, layout.update[n]) for n, p in new_params.items()}
        return new_params, layout.annotate_state(new_state), {k: metrics[k] for k in metrics_kept}, loss
    return step


def compute_weights(cfg: LMConfig, layout: Layout, params: dict) -> dict:
    """The weights the model runs on. Mixed precision: 16-bit copies, so activations, gradients and the
    collectives on them are 16-bit; FSDP gathers the (16-bit) copy of each sharded weight where it is used."""
    compute = {n: snp.astype(p, cfg.dtype) for n, p in params.items()}
    # FSDP's stacked layer weights: gathered one layer at a time in the loop; the rest held apart from their use
    # layout (FSDP's, and a pipeline's outside its stacked layers) gathered here, once per step
    return {n: layout.annotate(p, layout.use[n]) if layout.gathered(n) and not layout.roles[n].stacked else p
            for n, p in compute.items()}


def _run_layers(cfg: LMConfig, layout: Layout, microbatches: int):
    return (pipeline_layers(cfg, layout, microbatches) if layout.preset.stage
            else fsdp_layers(layout) if layout.preset.shard_params and cfg.scanned else None)


def norm_groups(layout: Layout) -> list[list[str]]:
    """The parameter names grouped by the mesh axes splitting their gradients (``Layout.update``), for the
    optimizer's global gradient norm: one reduction per group (dp: one group of replicated gradients, none)."""
    groups: dict = {}
    for name, spec in layout.update.items():
        axes = tuple(a for e in spec if e for a in ((e,) if isinstance(e, str) else e))  # in order: a partial
        # sum over ("model", "data") is another pending sum than one over ("data", "model")
        groups.setdefault(axes, []).append(name)
    return list(groups.values())


def eval_loss_fn(cfg: LMConfig, layout: Layout, microbatches: int = 1):
    """``loss(params, batch) -> mean loss``: the train step's forward alone (no gradient, no update), for
    evaluation; the 1F1B preset evaluates through the GPipe loop (forward only, the same stages)."""
    order, run_layers = list(param_shapes(cfg)), _run_layers(cfg, layout, microbatches)

    def loss(params, batch):
        compute = compute_weights(cfg, layout, params)
        return lm_loss_and_metrics(cfg, [compute[n] for n in order], batch["tokens"], batch["labels"],
                                   layout.activation, run_layers)[0]
    return loss


def fsdp_layers(layout: Layout):
    """FSDP's ``run_layers`` for scanned layers: the stacked weights stay sharded and the loop body gathers each
    layer's slice where it is used (one layer's weights at a time, as with unrolled layers); the slice's
    gradient is annotated sharded, so the backward body reduce-scatters it instead of all-reducing it."""
    use, update = layout.layer_specs(layout.use), layout.layer_specs(layout.update)

    def gathered(w, k):
        return mesh_split(w, layout.mesh, use[k], grad_spec=update[k]) if layout.mesh.size > 1 else w

    def run(cfg, block, x, stacked):
        return scan_layers(cfg, lambda x, layer: block(x, {k: gathered(w, k) for k, w in layer.items()}), x, stacked)
    return run


def pipeline_layers(cfg: LMConfig, layout: Layout, microbatches: int):
    """The pipeline preset's ``run_layers``: stages over the stage axes, each micro-batch's residual split like
    the batch, each stage's weights split like megatron's."""
    p = layout.preset
    run = pipelined_layers(layout.mesh, microbatches, p.stage[0], layout.layer_specs(layout.use),
                           (p.batch or None, p.seq or None, None))
    return lambda cfg, block, x, stacked: run(cfg, block, _entering_pipeline(layout, x, microbatches), stacked)


def _entering_pipeline(layout: Layout, x, microbatches: int):
    """The whole batch's residual before it is cut into micro-batches: its rows stay split over the stage axis
    (as ``Layout.activation`` split them) only where each micro-batch's rows divide among the (batch, stage)
    shards; otherwise gathered over the stages here, so no micro-batch dim comes out split."""
    p = layout.preset
    rows = x.shape[0] // microbatches
    batch = p.batch + p.stage if rows % layout.mesh.axis_size(p.batch + p.stage) == 0 else p.batch
    return layout.annotate(x, (batch or None, p.seq or None, None))


def pipeline_1f1b_loss(cfg: LMConfig, layout: Layout, microbatches: int):
    """The ``pipeline_1f1b`` preset's loss ``(params dict, tokens, labels) -> mean loss``: ``sr.pipeline_loss`` with
    the 1F1B schedule over the stage axis (stages of L/S layers as in ``pipeline_layers``). Everything runs per
    micro-batch inside the loop, so no whole-batch activation is held: the embedding as the micro-batch enters stage
    0 (``input_fn``) and the final LayerNorm, logits and cross-entropy on each stage's output, of which the last
    stage's counts (``head_over_stages``: no all-reduce of its output over the stages). Full recompute, one forward
    more per micro-batch: each layer's input saved and the backward layer by layer (Megatron's) where that holds
    less (``saves_layer_inputs``), else only the stage's input saved and the stage recomputed without per-layer
    remat in its backward."""
    p, mesh, annotate = layout.preset, layout.mesh, layout.activation
    s, specs = mesh.axis_size(p.stage[0]), layout.layer_specs(layout.use)
    head_names = ("lnf_g", "lnf_b", "embed" if cfg.tied else "unembed")
    whole = dataclasses.replace(cfg, remat="none")

    def head_losses(head, ys, labels):  # ys [S, b, seq, d] -> the per-stage losses [S]
        h = layer_norm(ys, head["lnf_g"], head["lnf_b"])  # one gain for all stages: its gradient stays pending
        logits = snp.einsum("zbsd,vd->zbsv", h, head["embed"]) if cfg.tied else \
            snp.einsum("zbsd,dv->zbsv", h, head["unembed"])
        # vocab-split like the weight (a tensor-parallel region): with Megatron-SP's sequence split on the same axis
        # the partitioner would else move the logits back into it for the loss, an all-to-all of them each way
        logits = annotate(logits, "logits")
        return cross_entropy(snp.astype(logits, "float32") if dtypes.is_low_precision(logits.dtype) else logits,
                             labels, axis=(1, 2))

    def inputs(table, tokens):  # tokens [S, b, seq] -> the embedded residual [S, b, seq, d]
        positions = snp.einsum("zb,sd->zbsd", snp.ones(tokens.shape[:2], table["pos"].dtype), table["pos"])
        return embed(cfg, table["embed"], tokens) + positions

    def loss(params, tokens, labels):
        stacked = {n[len(STACKED):]: w for n, w in params.items() if n.startswith(STACKED)}
        stage_specs = {k: (None,) + tuple(specs.get(k) or (None,) * (w.ndim - 1)) for k, w in stacked.items()}
        block = lambda c: lambda x, layer: dense_block(c, x, layer, annotate)
        one_layer = lambda layer, h: dense_block(whole, h, layer, annotate)
        total = pipeline_loss(lambda ps, h: scan_layers(cfg, block(cfg), h, ps),
                              {k: stages_of_layers(w, s) for k, w in stacked.items()},
                              micro_batches(tokens, microbatches), head_losses, {n: params[n] for n in head_names},
                              micro_batches(labels, microbatches), mesh=mesh, stage_axis=p.stage[0], stage_dim=1,
                              param_specs=stage_specs, state_spec=(p.batch or None, p.seq or None, None),
                              input_fn=inputs, input_params={"embed": params["embed"], "pos": params["pos"]},
                              recompute_fn=lambda ps, h: scan_layers(whole, block(whole), h, ps),
                              layer_fn=one_layer if saves_layer_inputs(cfg, layout, microbatches) else None,
                              head_over_stages=True)
        return total * (1.0 / microbatches)
    return loss


def saves_layer_inputs(cfg: LMConfig, layout: Layout, microbatches: int) -> bool:
    """Whether the 1F1B stages save each layer's input (the backward then recomputes layer by layer) rather than
    the stage's input alone (the backward recomputing the stage whole): the first holds ring x L/S residuals plus
    one layer's activations, the second ring residuals plus L/S layers' activations, so it is smaller where the
    ring (``ring_slots``: min(2 S - 1, M) micro-batches) is smaller than one layer's activations in residuals:
    s b h (10 + 24/t + 5 a s/(h t)) bytes (Korthikanti et al. 2022) over the residual's 2 s b h; with
    sequence parallelism (the sequence split over the model axes too) all of them 1/t: (34 + 5 a s/h) / 2."""
    p = layout.preset
    s, t = layout.mesh.axis_size(p.stage[0]), layout.mesh.axis_size(p.model) if p.model else 1
    split = 1 if p.model and set(p.model) <= set(p.seq) else t  # the part split t ways beside the residual
    layer = (10 + 24 / split + 5 * cfg.heads * cfg.seq / (cfg.d * split)) / 2
    return cfg.layers // s > 1 and ring_slots(microbatches, s) < layer


def accumulate(loss_and_grads, params, tokens, labels, microbatches: int, key=None):
    """Gradient accumulation: ONE scan over ``microbatches`` slices of the batch (rows m, m + M, ... form
    micro-batch m, so a batch split stays local), summing loss and gradients; returns their means, equal to
    the loss and gradients of the whole batch. ``key``: micro-batch m draws with ``split(key, M)[m]``."""
    batch, seq = tokens.shape
    split = lambda t: snp.transpose(snp.reshape(t, (batch // microbatches, microbatches, seq)), (1, 0, 2))

    def body(acc, batch_m):
        loss, _, grads = loss_and_grads(params, *batch_m)
        return (acc[0] + snp.astype(loss, acc[0].dtype), {n: a + grads[n] for n, a in acc[1].items()}), None
    dtype = np.result_type(next(iter(params.values())).dtype, np.float32)
    init = (snp.zeros((), dtype), {n: snp.zeros(p.shape, p.dtype) for n, p in params.items()})
    keys = () if key is None else (srandom.split(key, microbatches),)
    (loss, grads), _ = scan(body, init, (split(tokens), split(labels), *keys))
    return loss * (1.0 / microbatches), {}, {n: g * (1.0 / microbatches) for n, g in grads.items()}


def input_specs(cfg: LMConfig, optimizer: Optimizer) -> tuple:
    """The step's inputs as (params, opt_state, batch) trees of TensorSpecs: shapes and dtypes only, so a plan
    of any size allocates no parameter or state slot."""
    params = {k: TensorSpec(v, cfg.master_dtype) for k, v in param_shapes(cfg).items()}
    batch = TensorSpec((cfg.batch, cfg.seq), TOKEN_DTYPE)
    return params, optimizer.init_state(params), {"tokens": batch, "labels": batch}


def step_specs(graph, layout: Layout) -> tuple[list, list]:
    """(in_specs, out_specs) of the traced step, flat in the graph's order: inputs by leaf name, each new
    parameter and state slot like the input it replaces, metrics and loss replicated."""
    ins = [layout.specs[n] for n in graph.param_names]
    outs = [layout.specs[_output_name(path)] if path[0] in (0, 1) else ()
            for path in pytree.leaf_paths(graph.out_tree)]
    return ins, outs


def _output_name(path: tuple) -> str:
    """The input an output of ``(new_params, new_opt_state, ...)`` replaces: its path under that argument."""
    return pytree.keystr(path[1:], ("params", "opt_state")[path[0]])


def metric_names(cfg: LMConfig) -> tuple[str, ...]:
    """Scalars the step returns before the loss: the MoE gating statistics of ``lm_loss_and_metrics``."""
    return ("aux_loss", "dropped_fraction") if cfg.moe_every else ()
