"""Training: ONE traced step (forward, backward, optimizer update) partitioned by a preset.

``build_train_step(cfg, mesh, preset, optimizer)`` traces

    step(params, opt_state, batch) -> (new_params, new_opt_state, metrics, loss)

on pytrees (``params`` a dict name -> weight, ``opt_state`` the optimizer's
state tree, ``batch`` ``{"tokens", "labels"}``) with ``value_and_grad`` of the
language-model loss (``models.lm``) and the optimizer's traced update
(``optim``), and partitions it over ``mesh``. The program's inputs are named by
their leaf paths (``params.wq``, ``opt_state.m.wq``, ``batch.tokens``), and so
are checkpoint tensors. A preset is nothing but annotations: in_specs for the
parameters, optimizer state and tokens, and ``mesh_split`` on the residual
stream, the logits, the gradients, the new optimizer state and the new
parameters. Every output is laid out like the matching input, so the step
iterates on local shards with ``sr.run_local``.

Presets (roles -> mesh axes; an axis the mesh lacks is dropped, so the
single-role presets use every axis of a 2-d mesh):

- ``dp``: batch on every axis; parameters and optimizer state replicated; one
  all-reduce per gradient.
- ``megatron``: batch on "data"; heads (QKV columns, out-projection rows), the
  MLP hidden dim and the vocab of embedding and output layer on "model".
- ``wus``: data parallel with weight-update sharding (Xu et al. 2020,
  "Automatic Cross-Replica Sharding of Weight Update"): gradients are
  reduce-scattered, the optimizer state and the update live on 1/n of each
  tensor (its outermost dim divisible by n), the new weights are all-gathered.
- ``seq``: the sequence dim of the tokens and activations on every axis.
- ``megatron_wus``: megatron, with the update sharded over "data" too.
- ``dp_seq``: batch on "data", sequence on "model".
- ``moe`` (GShard, for configs with MoE blocks): experts on "data", batch on ("model", "data") (the expert
  axis minor, so tokens reach their experts by one all-to-all over it), experts replicated over "model".
- ``moe_megatron``: experts on "data", each expert's hidden dim (and the dense blocks) Megatron-split on
  "model", batch on "data".
- ``fsdp``: fully sharded data parallel (ZeRO-3): like ``wus``, but the weights themselves are held in
  the update layout between steps and all-gathered where the model uses them (kept live from the forward
  to their last backward use: one all-gather per weight per step).
- ``fsdp_megatron``: megatron, with weights, gradients and optimizer state also sharded over "data".
- ``pipeline`` (GSPMD pipelining, scanned layers): the stacked layer dim on "stage" (S stages of L/S
  consecutive layers, each rank holding its stage's parameters and optimizer state), run as ONE loop of
  M + S - 1 iterations over ``microbatches`` = M micro-batches (GPipe), the stage shift one
  collective_permute per iteration; batch on "data", megatron dims on "model" where the mesh has them.

Mixed precision (``LMConfig(dtype="bfloat16" | "float16")``): the inputs (master weights, optimizer
state) are ``cfg.master_dtype`` (float32); the step casts the weights to ``cfg.dtype`` before use, so
activations, gradients and their collectives are 16-bit, and casts the reduced gradients back for the
update. float16 steps use ``DynamicLossScale``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .autodiff import value_and_grad
from .checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from .exec.backend import to_host
from .comm import watchdog
from .comm.communicator import agree
from .exec.runner import Runtime, communicator, run_local_checked, shard, unshard
from .mesh import Mesh
from .models.lm import (BLOCK_PARAMS, STACKED, LMConfig, block_shapes, init_params, is_stacked, layer_views,
                        lm_loss_and_metrics, param_kind, param_shapes, pipelined_layers, scan_layers)
from . import numpy as snp
from . import pytree
from .ops.control import scan
from .optim import AdamW, DynamicLossScale, Optimizer, slot_tree
from .partition import partition
from .program import SPMDProgram
from .reference import evaluate
from .sharding import parse_spec
from .trace import mesh_split, trace

TOKEN_DTYPE = "int32"


# ---------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    """Mesh axes per role: ``batch``/``seq`` split the tokens and activations, ``model`` splits the
    Megatron weight dims, ``update`` shards the optimizer state and the weight update, ``experts`` splits
    the expert dim of MoE blocks."""
    name: str
    batch: tuple[str, ...] = ()
    seq: tuple[str, ...] = ()
    model: tuple[str, ...] = ()
    update: tuple[str, ...] = ()
    doc: str = ""
    experts: tuple[str, ...] = ()
    shard_params: bool = False  # FSDP: weights held in their update layout, all-gathered before use
    stage: tuple[str, ...] = ()  # pipeline: the stacked layer dim split into stages over these axes

    def on(self, mesh: Mesh) -> "Preset":
        """This preset with the axes ``mesh`` lacks dropped."""
        keep = lambda axes: tuple(a for a in axes if a in mesh.axis_names)
        return dataclasses.replace(self, batch=keep(self.batch), seq=keep(self.seq), model=keep(self.model),
                                   update=keep(self.update), experts=keep(self.experts), stage=keep(self.stage))


BOTH = ("data", "model")
PRESETS = {
    "dp": Preset("dp", batch=BOTH, doc="batch on every axis; one all-reduce per gradient"),
    "megatron": Preset("megatron", batch=("data",), model=("model",),
                       doc="batch on data; heads, MLP hidden and vocab on model"),
    "wus": Preset("wus", batch=BOTH, update=BOTH,
                  doc="data parallel; gradients reduce-scattered, optimizer state and update sharded, "
                      "weights all-gathered"),
    "seq": Preset("seq", seq=BOTH, doc="sequence dim of tokens and activations on every axis"),
    "megatron_wus": Preset("megatron_wus", batch=("data",), model=("model",), update=("data",),
                           doc="megatron, with the weight update sharded over data"),
    "dp_seq": Preset("dp_seq", batch=("data",), seq=("model",), doc="batch on data, sequence on model"),
    "moe": Preset("moe", batch=("model", "data"), experts=("data",),
                  doc="GShard: experts on data (one all-to-all each way per MoE block), batch on every axis"),
    "moe_megatron": Preset("moe_megatron", batch=("data",), model=("model",), experts=("data",),
                           doc="experts on data; expert hidden dim, heads, MLP hidden and vocab on model"),
    "fsdp": Preset("fsdp", batch=BOTH, update=BOTH, shard_params=True,
                   doc="fully sharded data parallel (ZeRO-3): weights, gradients and optimizer state sharded; "
                       "weights all-gathered before use"),
    "fsdp_megatron": Preset("fsdp_megatron", batch=("data",), model=("model",), update=("data",), shard_params=True,
                            doc="megatron, with weights, gradients and optimizer state also sharded over data"),
    "pipeline": Preset("pipeline", batch=("data",), model=("model",), stage=("stage",),
                       doc="GPipe: layer stages on stage (one collective_permute per iteration), batch on data, "
                           "megatron dims on model"),
}
PIPELINE_AXES = ("stage", "data", "model")


def train_mesh(shape, preset: str = "dp") -> Mesh:
    """The mesh a preset expects: 2-d meshes are ("data", "model"); a 1-d mesh is ("model",) for
    ``megatron`` (pure tensor parallelism) and ("data",) otherwise. ``pipeline`` meshes are ("stage",),
    ("stage", "data") or ("stage", "data", "model")."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if preset == "pipeline" and 1 <= len(shape) <= 3:
        return Mesh(shape, PIPELINE_AXES[:len(shape)])
    if len(shape) == 2:
        return Mesh(shape, BOTH)
    if len(shape) == 1:
        return Mesh(shape, ("model",) if preset == "megatron" else ("data",))
    raise ValueError(f"a training mesh is 1-d or 2-d; got shape {shape}")


def _preset(preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or a Preset; got {preset!r}")
    return PRESETS[preset]


# ---------------------------------------------------------------- layout: specs per value
MEGATRON_DIMS = {"embed": 0, "unembed": 1, "wq": 1, "wk": 1, "wv": 1, "w1": 1, "wo": 0, "w2": 0, "we1": 2, "we2": 1}
EXPERT_PARAMS = ("we1", "we2")  # (experts, ...): dim 0 on the expert axes


def param_spec(name: str, shape, preset: Preset) -> tuple:
    """Megatron splits a weight's head / hidden / vocab dim over the model axes, expert weights their expert
    dim over the expert axes; all else is replicated."""
    spec = [None] * len(shape)
    dim = MEGATRON_DIMS.get(param_kind(name))
    if preset.model and dim is not None:
        spec[dim + is_stacked(name)] = preset.model  # stacked layers: after the layer dim
    if preset.stage and is_stacked(name):
        spec[0] = preset.stage  # pipeline: rank j holds the layers of stage j
    if preset.experts and param_kind(name) in EXPERT_PARAMS:
        spec[0] = preset.experts
    return tuple(spec)


def update_spec(shape, spec, axes, mesh: Mesh, first_dim: int = 0) -> tuple:
    """``spec`` further split over ``axes`` (minor to what already splits it, so each rank's update block
    lies inside its parameter block) on the first dim from ``first_dim`` on whose local size divides evenly:
    the outermost, so each rank's update block is contiguous in its (row-major) parameter block and the
    gradient's reduce-scatter and the weight's all-gather move it with no packing on either side; ``spec``
    itself when there are no axes or no dim divides."""
    if not axes:
        return tuple(spec)
    have = [() if e is None else tuple(e) if isinstance(e, tuple) else (e,) for e in spec]
    k = mesh.axis_size(axes)
    fits = [d for d, (n, h) in enumerate(zip(shape, have)) if n % (mesh.axis_size(h) * k) == 0 and d >= first_dim]
    if not fits:
        return tuple(spec)
    dim = fits[0]
    return tuple(tuple(h) + tuple(axes) if d == dim else (tuple(h) or None) for d, h in enumerate(have))


@dataclass
class Layout:
    """Every input's spec by leaf name (``params.wq``, ``opt_state.m.wq``, ``batch.tokens``: the names the
    traced step gives them), and the update spec of each per-parameter value."""
    mesh: Mesh
    preset: Preset
    specs: dict  # leaf name -> spec of that input (and of the output that replaces it)
    update: dict  # parameter name -> spec of its gradient, optimizer state and updated block
    use: dict  # parameter name -> spec of the weight where the model uses it (FSDP: gathered to this)
    slots: list  # the optimizer's StateSlots

    def annotate(self, x, spec):
        """``x`` pinned to ``spec`` with ``mesh_split``; on a one-device mesh there is nothing to say."""
        return mesh_split(x, self.mesh, spec) if self.mesh.size > 1 else x

    def activation(self, x, role):
        p = self.preset
        if role in MOE_ROLES:
            return self.annotate(x, moe_activation_spec(p, role, x.ndim))
        model = p.model if role == "logits" else None
        stage = (p.stage or None,) if x.ndim == 4 else ()  # inside the pipeline: (stages, batch, seq, d)
        return self.annotate(x, stage + (p.batch or None, p.seq or None, model or None))

    def annotate_state(self, state: dict) -> dict:
        """The new optimizer state tree, each slot pinned to its input's spec (so the step iterates)."""
        paths, tree = pytree.flatten_with_path(state)
        return tree.unflatten(self.annotate(x, self.specs[pytree.keystr(p, "opt_state")]) for p, x in paths)


MOE_ROLES = ("groups", "expert_in", "expert_hidden")


def moe_activation_spec(preset: Preset, role: str, ndim: int) -> tuple:
    """'groups' (G, ...): groups split like the batch; 'expert_in' (E, G, C, M) and 'expert_hidden'
    (E, G, C, H): experts on the expert axes, groups on the rest of the batch axes, H on the model axes."""
    if role == "groups":
        return (preset.batch or None,) + (None,) * (ndim - 1)
    rest = tuple(a for a in preset.batch if a not in preset.experts) or None
    hidden = (preset.model or None) if role == "expert_hidden" else None
    return (preset.experts or None, rest, None, hidden)


def check_experts(cfg: LMConfig, mesh: Mesh, preset: Preset) -> None:
    """Experts split over mesh axes need at least one expert per shard: fewer would leave empty expert
    shards and make the partitioner gather expert weights."""
    if cfg.moe_every and preset.experts and cfg.experts < mesh.axis_size(preset.experts):
        n = mesh.axis_size(preset.experts)
        raise ValueError(f"preset {preset.name!r} splits the experts over mesh axes {preset.experts} of size {n}, "
                         f"which needs experts >= {n}; got experts={cfg.experts} (use more experts or a mesh "
                         f"with a smaller {'x'.join(preset.experts)} axis)")


def make_layout(cfg: LMConfig, mesh: Mesh, preset: Preset, optimizer: Optimizer) -> Layout:
    check_experts(cfg, mesh, preset)
    shapes = param_shapes(cfg)
    use = OrderedDict((n, param_spec(n, s, preset)) for n, s in shapes.items())
    update = {n: update_spec(s, use[n], preset.update, mesh, first_dim=int(is_stacked(n)))  # never the scanned dim
              for n, s in shapes.items()}
    slots = optimizer.state_layout(shapes, cfg.master_dtype)
    specs = {f"params.{n}": update[n] if preset.shard_params else use[n] for n in shapes}
    for slot in slots:
        specs[state_leaf_name(slot)] = update[slot.param] if slot.param else (None,) * len(slot.shape)
    specs["batch.tokens"] = specs["batch.labels"] = (preset.batch or None, preset.seq or None)
    for name, spec in specs.items():
        parse_spec(spec, mesh, len(spec), name)  # fail early, naming the value
    return Layout(mesh, preset, specs, update, use, slots)


def state_leaf_name(slot) -> str:
    """The traced step's name of an optimizer state slot: its path under ``opt_state``."""
    return pytree.keystr(slot.key, "opt_state")


# ---------------------------------------------------------------- the traced step
def train_step_fn(cfg: LMConfig, optimizer: Optimizer, layout: Layout, microbatches: int = 1):
    """``step(params, opt_state, batch) -> (new_params, new_opt_state, metrics, loss)``, annotated: ``params``
    a dict name -> weight, ``opt_state`` the optimizer's state tree, ``batch`` ``{"tokens", "labels"}``,
    ``metrics`` a dict of scalars ({} for a dense model)."""
    order = list(param_shapes(cfg))  # the model takes its weights in this order
    scaled = isinstance(optimizer, DynamicLossScale)
    run_layers = (pipeline_layers(cfg, layout, microbatches) if layout.preset.stage
                  else fsdp_layers(layout) if layout.preset.shard_params and cfg.scanned else None)
    # weight decay on matrices only, whether or not the layers are stacked on a leading dim
    matrices = {n for n, shape in param_shapes(cfg).items() if len(shape) - is_stacked(n) >= 2}

    def step(params, opt_state, batch):
        # Mixed precision: the model runs on 16-bit copies, so activations, gradients and the collectives
        # on them are 16-bit; FSDP gathers the (16-bit) copy of each sharded weight where it is used.
        compute = {n: snp.astype(p, cfg.dtype) for n, p in params.items()}
        if layout.preset.shard_params:  # stacked layer weights: gathered one layer at a time in the loop
            compute = {n: p if cfg.scanned and is_stacked(n) else layout.annotate(p, layout.use[n])
                       for n, p in compute.items()}
        scale = optimizer.loss_scale(opt_state)

        def loss_and_grads(compute, tokens, labels):
            def loss_fn(ps):
                loss, metrics = lm_loss_and_metrics(cfg, [ps[n] for n in order], tokens, labels, layout.activation,
                                                     run_layers)
                return (loss * scale, metrics) if scaled else (loss, metrics)
            (loss, metrics), grads = value_and_grad(loss_fn, has_aux=True)(compute)
            loss = loss / scale if scaled else loss
            return loss, metrics, {n: layout.annotate(g, layout.update[n]) for n, g in grads.items()}
        if microbatches == 1 or run_layers:
            loss, metrics, grads = loss_and_grads(compute, batch["tokens"], batch["labels"])
        else:
            loss, metrics, grads = accumulate(loss_and_grads, compute, batch["tokens"], batch["labels"],
                                              microbatches)
        grads = {n: snp.astype(g, params[n].dtype) for n, g in grads.items()}  # reduced in 16 bits, updated in master
        new_params, new_state = optimizer.update(params, grads, opt_state, matrices)
        new_params = {n: layout.annotate(p, layout.update[n]) for n, p in new_params.items()}
        return new_params, layout.annotate_state(new_state), {k: metrics[k] for k in metric_names(cfg)}, loss
    return step


def fsdp_layers(layout: Layout):
    """FSDP's ``run_layers`` for scanned layers: the stacked weights stay sharded and the loop body gathers each
    layer's slice where it is used (one layer's weights at a time, as with unrolled layers); the slice's
    gradient is annotated sharded, so the backward body reduce-scatters it instead of all-reducing it."""
    use = {n[len(STACKED):]: spec[1:] for n, spec in layout.use.items() if is_stacked(n)}
    update = {n[len(STACKED):]: spec[1:] for n, spec in layout.update.items() if is_stacked(n)}

    def gathered(w, k):
        return mesh_split(w, layout.mesh, use[k], grad_spec=update[k]) if layout.mesh.size > 1 else w

    def run(cfg, block, x, stacked):
        return scan_layers(cfg, lambda x, layer: block(x, {k: gathered(w, k) for k, w in layer.items()}), x, stacked)
    return run


def pipeline_layers(cfg: LMConfig, layout: Layout, microbatches: int):
    """The pipeline preset's ``run_layers``: stages over the stage axes, each micro-batch's residual split like
    the batch, each stage's weights split like megatron's."""
    p = layout.preset
    specs = {k: param_spec(STACKED + k, (cfg.layers,) + shape, dataclasses.replace(p, stage=()))[1:]
             for k, shape in block_shapes(cfg).items() if k in BLOCK_PARAMS}
    return pipelined_layers(layout.mesh, microbatches, p.stage[0], specs, (p.batch or None, p.seq or None, None))


def check_pipeline(cfg: LMConfig, mesh: Mesh, preset: Preset, microbatches: int) -> None:
    """A pipeline preset needs its stage axis in the mesh, scanned (dense) layers, and a stage count that
    divides the layers."""
    if not preset.stage:
        return
    if len(preset.stage) != 1 or preset.stage[0] not in mesh.axis_names:
        raise ValueError(f"preset {preset.name!r} runs pipeline stages over mesh axis {preset.stage}, which must "
                         f"be one axis of the mesh; got axes {mesh.axis_names} (e.g. train_mesh((2, 2, 2), "
                         f"'pipeline') names them {PIPELINE_AXES})")
    stages = mesh.axis_size(preset.stage[0])
    if not cfg.scanned:
        raise ValueError(f"preset {preset.name!r} pipelines the scanned layers; got an unrolled model "
                         f"(scan_layers={cfg.scan_layers}, moe_every={cfg.moe_every})")
    if cfg.layers % stages:
        raise ValueError(f"preset {preset.name!r} needs the stage count to divide the layers; got {stages} stages "
                         f"(mesh axis {preset.stage[0]!r}) for layers={cfg.layers}")


def accumulate(loss_and_grads, params, tokens, labels, microbatches: int):
    """Gradient accumulation: ONE scan over ``microbatches`` slices of the batch (rows m, m + M, ... form
    micro-batch m, so a batch split stays local), summing loss and gradients; returns their means, equal to
    the loss and gradients of the whole batch."""
    batch, seq = tokens.shape
    split = lambda t: snp.transpose(snp.reshape(t, (batch // microbatches, microbatches, seq)), (1, 0, 2))

    def body(acc, batch_m):
        loss, _, grads = loss_and_grads(params, *batch_m)
        return (acc[0] + snp.astype(loss, acc[0].dtype), {n: a + grads[n] for n, a in acc[1].items()}), None
    dtype = np.result_type(next(iter(params.values())).dtype, np.float32)
    init = (snp.zeros((), dtype), {n: snp.zeros(p.shape, p.dtype) for n, p in params.items()})
    (loss, grads), _ = scan(body, init, (split(tokens), split(labels)))
    return loss * (1.0 / microbatches), {}, {n: g * (1.0 / microbatches) for n, g in grads.items()}


def input_specs(cfg: LMConfig, optimizer: Optimizer) -> tuple:
    """Example arrays (shape, dtype) of the step's inputs: (params, opt_state, batch) trees."""
    params = {k: np.zeros(v, cfg.master_dtype) for k, v in param_shapes(cfg).items()}
    batch = np.zeros((cfg.batch, cfg.seq), TOKEN_DTYPE)
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


def build_train_step(cfg: LMConfig, mesh: Mesh, preset="dp", optimizer: Optimizer | None = None,
                     microbatches: int = 1, donate: bool = False) -> "TrainStep":
    """Trace and partition one training step of ``cfg`` over ``mesh`` with ``preset`` (name or Preset);
    ``microbatches`` > 1 accumulates gradients over that many slices of the batch (one optimizer update);
    with the ``pipeline`` preset they are the pipeline's micro-batches. ``donate``: the step updates the
    parameters and optimizer state in place (``partition(donate=...)``, JAX's ``donate_argnums``): no new
    buffers for the new state, and ``step`` consumes the local state it is given (use the one it returns)."""
    if not isinstance(microbatches, int) or microbatches < 1 or cfg.batch % microbatches:
        raise ValueError(f"microbatches must be a positive int dividing the batch; got microbatches="
                         f"{microbatches!r} for batch={cfg.batch}")
    if microbatches > 1 and cfg.moe_every:
        raise ValueError(f"gradient accumulation supports dense models (it returns no MoE metrics); got "
                         f"microbatches={microbatches} with moe_every={cfg.moe_every}")
    check_pipeline(cfg, mesh, _preset(preset), microbatches)
    optimizer = optimizer or AdamW()
    if np.dtype(cfg.dtype) == np.float16 and not isinstance(optimizer, DynamicLossScale):
        optimizer = DynamicLossScale(optimizer)  # float16 gradients underflow without it
    preset = _preset(preset).on(mesh)
    layout = make_layout(cfg, mesh, preset, optimizer)
    graph = trace(train_step_fn(cfg, optimizer, layout, microbatches), *input_specs(cfg, optimizer))
    in_specs, out_specs = step_specs(graph, layout)
    state = [k for k, node in enumerate(graph.params) if not graph.name_of(node).startswith("batch.")] if donate else ()
    program = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs, donate=state)
    return TrainStep(cfg, mesh, preset, optimizer, layout, graph, program)


def metric_names(cfg: LMConfig) -> tuple[str, ...]:
    """Scalars the step returns before the loss: the MoE gating statistics of ``lm_loss_and_metrics``."""
    return ("aux_loss", "dropped_fraction") if cfg.moe_every else ()


def build_train_step_on_root(cfg: LMConfig, mesh: Mesh, preset="dp", optimizer: Optimizer | None = None,
                             comm=None, microbatches: int = 1, donate: bool = False) -> "TrainStep":
    """Collective: rank 0 traces and partitions, every rank receives the same TrainStep (each rank would
    otherwise repeat the same deterministic work, N times over on shared cores)."""
    comm = comm if comm is not None else _world()
    check_experts(cfg, mesh, _preset(preset).on(mesh))  # on every rank, before rank 0 goes off alone
    check_pipeline(cfg, mesh, _preset(preset), microbatches)
    step = run_on_root(comm, lambda: build_train_step(cfg, mesh, preset, optimizer, microbatches, donate),
                       "tracing and partitioning the training step on rank 0")
    return comm.bcast(step, root=0)


def run_on_root(comm, fn, what: str = "the work done on rank 0"):
    """Collective: rank 0 runs ``fn`` (its result is returned there, None elsewhere) while the other ranks
    wait SLEEPING: an MPI wait spins, and with more ranks than cores the spinning ranks would take the
    cores rank 0 needs. An exception in ``fn`` becomes the same one-line ``AgreedError`` on every rank."""
    result = error = None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - agreed below, so the other ranks do not wait for a result
            error = f"{type(e).__name__}: {e}"
    if hasattr(comm, "Ibarrier"):
        _sleep_until_every_rank_arrives(comm, what)
    agree(comm, error, what)
    return result


@watchdog.collective(lambda frame: f"the ranks' barrier after {frame.f_locals.get('what')}")
def _sleep_until_every_rank_arrives(comm, what: str) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def _world():
    from mpi4py import MPI  # lazily: importing it initialises MPI
    return MPI.COMM_WORLD


# ---------------------------------------------------------------- running it
@dataclass
class TrainStep:
    """A partitioned training step. Its state is the pytree ``{"params": {name: weight}, "opt_state": the
    optimizer's state tree}``: global (``init``, ``gather``, ``reference_step``) or this rank's TRUE blocks
    (``shard_state``, ``step``, ``load``). ``state_names`` are the state's dotted leaf names in program order
    (``params.wq``, ``opt_state.m.wq``), the names of the program's inputs and of checkpoint tensors.
    ``metrics`` holds the last step's extra scalars (MoE: 'aux_loss', 'dropped_fraction')."""
    cfg: LMConfig
    mesh: Mesh
    preset: Preset
    optimizer: Optimizer
    layout: Layout
    graph: object  # the unpartitioned traced step (sr.evaluate runs it on global arrays)
    program: SPMDProgram
    state_names: list = field(init=False)
    param_names: list = field(init=False)
    metrics: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.param_names = list(param_shapes(self.cfg))
        self.state_names = [io.name for io in self.program.inputs if not io.name.startswith("batch.")]
        self._state_ios = self.program.inputs[:len(self.state_names)]
        self._batch_ios = self.program.inputs[len(self.state_names):]
        names = {"params": {n: f"params.{n}" for n in self.param_names},
                 "opt_state": slot_tree(self.layout.slots, map(state_leaf_name, self.layout.slots))}
        order, self._state_tree = pytree.flatten(names)
        self._order = [order.index(n) for n in self.state_names]  # program order -> tree leaf order

    def _metrics(self, outs) -> dict:
        names = metric_names(self.cfg)
        self.metrics = {k: float(v) for k, v in zip(names, outs[len(outs) - 1 - len(names):-1])}
        return self.metrics

    def _flat(self, state) -> list:
        """The leaves of a state tree in program order (the tree must be a TrainStep state)."""
        leaves = pytree.flatten_like(state, self._state_tree, "a TrainStep state")
        return [leaves[k] for k in self._order]

    def _tree(self, flat) -> dict:
        """The state tree of leaves in program order."""
        leaves = [None] * len(flat)
        for k, x in zip(self._order, flat):
            leaves[k] = x
        return self._state_tree.unflatten(leaves)

    def named(self, state) -> "OrderedDict[str, object]":
        """Dotted leaf name -> leaf of a state tree, in program order."""
        return OrderedDict(zip(self.state_names, self._flat(state)))

    def init(self, seed: int = 0) -> dict:
        """Global initial state: parameters from ``seed`` (the same on every mesh) and fresh optimizer state."""
        params = dict(init_params(self.cfg, seed))
        return {"params": params, "opt_state": self.optimizer.init_state(params)}

    def shard_state(self, state: dict, rank: int) -> dict:
        """``rank``'s TRUE blocks of the global ``state`` (sliced once; the step then keeps them local). Views of
        ``state``, or copies when the step donates its state (it would write into ``state`` itself)."""
        own = bool(self.program.donated)
        return self._tree([shard(np.asarray(x), io.sharding, self.mesh, rank, own=own)
                           for x, io in zip(self._flat(state), self._state_ios)])

    def _batch(self, tokens, labels) -> list:
        """The batch inputs in program order."""
        batch = {"batch.tokens": tokens, "batch.labels": labels}
        return [np.asarray(batch[io.name], TOKEN_DTYPE) for io in self._batch_ios]

    def step(self, local_state: dict, tokens, labels, comm=None) -> tuple[dict, float]:
        """One step on this rank's blocks; ``tokens``/``labels`` are the global batch (every rank the same).
        Returns (new local state, loss)."""
        rank = Runtime.of(comm).rank
        error = check_batch(tokens, labels, self.cfg)  # agreed on in the run's preparation: raises on every rank
        batch = [] if error else [shard(x, io.sharding, self.mesh, rank)
                                  for x, io in zip(self._batch(tokens, labels), self._batch_ios)]
        outs = run_local_checked(self.program, [*self._flat(local_state), *batch], comm=comm, error=error)
        self._metrics(outs)
        return self._tree(outs[:len(self.state_names)]), float(outs[-1])

    def reference_step(self, state: dict, tokens, labels) -> tuple[dict, float]:
        """The same step, unpartitioned, on global arrays (``sr.evaluate`` of the traced graph)."""
        outs = evaluate(self.graph, *self._flat(state), *self._batch(tokens, labels))
        self._metrics(outs)
        return self._tree(outs[:len(self.state_names)]), float(outs[-1])

    def gather(self, local_state: dict, comm=None) -> dict:
        """Collective: the global state from every rank's blocks."""
        mc = communicator(self.mesh, comm)
        out = []
        for x, io in zip(self._flat(local_state), self._state_ios):
            padded = _pad_to(to_host(x), io.sharding.local_shape(io.shape, self.mesh))
            out.append(np.asarray(unshard(padded, io.sharding, io.shape, mc)))
        return self._tree(out)

    # ------------------------------------------------------------ checkpoints
    def save(self, directory, local_state: dict, step: int | None = None, comm=None) -> None:
        """Collective: save this rank's blocks of the state (sharded, atomic; see ``checkpoint``), one tensor
        per state leaf, named by its dotted path (``params.wq``, ``opt_state.m.wq``)."""
        save_checkpoint(directory, self.named(local_state), self.program, comm=comm, step=step)

    def load(self, directory, comm=None, strict: bool = True) -> dict:
        """Collective: this rank's blocks of a saved state, whatever mesh and preset saved it.

        The checkpoint must hold exactly this model's parameters and optimizer state at their shapes and dtypes
        (a checkpoint of another config fails, naming each mismatched tensor); ``strict=False`` loads the ones
        that match and leaves None for the others. Layers saved unrolled (one tensor per layer) load into
        stacked layers and vice versa (``models.lm.layer_views``). Checkpoints written before the state was a
        pytree (flat names: ``wq``, ``m_wq``, ``step``) load too, each tensor mapped to its leaf
        (``legacy_names``)."""
        stored = _stored_names(directory)
        legacy = self.legacy_names() if stored and not any(n in stored for n in self.state_names) else {}
        name = lambda n: legacy.get(n, n)
        ios = {name(io.name): io for io in self._state_ios}
        views = layer_views(self.cfg, ios)
        blocks = load_checkpoint(directory, self.mesh, {n: io.sharding for n, io in ios.items()
                                                        if n in stored or n in views},
                                 comm=comm, expect={n: (io.shape, io.dtype) for n, io in ios.items()},
                                 strict=strict, views=views)
        return self._tree([blocks.get(name(n)) for n in self.state_names])

    def legacy_names(self) -> dict:
        """State leaf name -> the flat name checkpoints written before state trees gave it (``params.wq`` ->
        ``wq``, ``opt_state.m.wq`` -> ``m_wq``)."""
        names = {f"params.{n}": n for n in self.param_names}
        names.update((state_leaf_name(slot), slot.name) for slot in self.layout.slots)
        return names

    # ------------------------------------------------------------ reports
    def memory_report(self) -> dict:
        """Per-rank bytes: parameters, optimizer state and batch held between steps (IOSpec local shapes,
        padded), the program's peak of live buffers, and the temporaries at that peak (activations,
        gradients, updates: peak minus inputs). ``*_global`` give the unsharded sizes."""
        held = {"params": 0, "opt_state": 0, "batch": 0}
        whole = dict(held)
        for io in self.program.inputs:
            kind = io.name.split(".", 1)[0]
            item = np.dtype(io.dtype).itemsize
            held[kind] += math.prod(io.sharding.local_shape(io.shape, self.mesh)) * item
            whole[kind] += math.prod(io.shape) * item
        peak = self.program.peak_bytes()
        return {**held, "peak": peak, "activations": peak - sum(held.values()),
                **{f"{k}_global": v for k, v in whole.items()}}

    def comm_summary(self) -> list[dict]:
        """Collectives per step grouped by (kind, axes): count, bytes in, wire bytes per rank."""
        groups: "OrderedDict[tuple, dict]" = OrderedDict()
        for c in self.program.comm_summary():
            g = groups.setdefault((c["kind"], c["axes"]), {"kind": c["kind"], "axes": c["axes"], "count": 0,
                                                            "bytes_in": 0, "wire_bytes": 0.0})
            g["count"] += 1
            g["bytes_in"] += c["bytes_in"]
            g["wire_bytes"] += c["wire_bytes"]
        return list(groups.values())


def _stored_names(directory) -> set:
    """The tensor names of the checkpoint in ``directory`` (empty when it cannot be read: ``load_checkpoint``
    then fails on every rank, saying why)."""
    try:
        return set(checkpoint_info(directory)["tensors"])
    except (OSError, ValueError, KeyError):
        return set()


def check_batch(tokens, labels, cfg: LMConfig) -> str | None:
    """Why a batch is unusable (None if it is fine): integer token ids and labels in [0, vocab), shape
    (batch, seq). Checked on the host: the kernels would clip or cast them silently."""
    for what, x in (("tokens", tokens), ("labels", labels)):
        x = np.asarray(x)
        if x.shape != (cfg.batch, cfg.seq):
            return f"TrainStep.step {what} must have shape (batch, seq) = {(cfg.batch, cfg.seq)}; got {x.shape}"
        if not np.issubdtype(x.dtype, np.integer):
            return f"TrainStep.step {what} must be integer token ids; got dtype {x.dtype}"
        low, high = (int(x.min()), int(x.max())) if x.size else (0, 0)
        if low < 0 or high >= cfg.vocab:
            bad = x[(x < 0) | (x >= cfg.vocab)]
            return (f"TrainStep.step {what} must be token ids in [0, vocab={cfg.vocab}); got {bad.size} outside, "
                    f"e.g. {bad[:4].tolist()}")
    return None


def format_comm(summary: list[dict]) -> str:
    rows = [f"  {'collective':<19} {'axes':<12} {'count':>5} {'bytes in':>12} {'wire bytes':>12}"]
    for g in summary:
        rows.append(f"  {g['kind']:<19} {','.join(g['axes']):<12} {g['count']:>5} {g['bytes_in']:>12} "
                    f"{g['wire_bytes']:>12.0f}")
    rows.append(f"  total wire bytes per rank per step: {sum(g['wire_bytes'] for g in summary):.0f}")
    return "\n".join(rows)


def _pad_to(x, shape):
    widths = [(0, want - have) for have, want in zip(x.shape, shape)]
    return np.pad(x, widths) if any(w for _, w in widths) else x


__all__ = ["Preset", "PRESETS", "TrainStep", "build_train_step", "build_train_step_on_root",
           "run_on_root", "train_mesh", "param_spec", "update_spec", "format_comm"]
