"""Training presets: mesh axes per role, the mesh each expects, and what a preset needs of the config.

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
- ``megatron_sp`` (Megatron-SP, Korthikanti et al. 2022): megatron, with the activations outside the
  tensor-parallel regions (LayerNorm, residual) split over the sequence on "model": each all-reduce of the
  (b, s, h) activation becomes a reduce-scatter into the sequence split (after the row-parallel matmul) and an
  all-gather out of it (before the column-parallel one): the same bytes, 1/t of those activations per rank.
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
  collective_permute per iteration; batch on "data", megatron dims on "model" where the mesh has them. The
  parameters outside the stacked layers (embedding, positional table, final LayerNorm, head), which have no layer
  dim, are held split over "stage" as well, with their optimizer state (``layout.update_axes``): their 16-bit copies
  are all-gathered once per step before the loops and their gradients reduced once after them, so no stage holds
  their master weights and Adam state whole (Megatron keeps them on the first / last stage only).
- ``pipeline_1f1b``: the same layout on the 1F1B schedule (``sr.pipeline_loss``): one loop of 2 (M + S - 1)
  slots of one forward or one backward per stage, the head and loss inside it; at most S micro-batches held.
- ``megatron_wus_sp``, ``fsdp_megatron_sp``, ``pipeline_sp``, ``pipeline_1f1b_sp``: those presets with
  Megatron-SP's sequence split on "model" (``sequence_parallel``, as ``megatron_sp`` adds it to ``megatron``):
  beside the update (or the weights too) sharded over "data", or inside each pipeline stage.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..mesh import Mesh
from ..models.lm import LMConfig


@dataclass(frozen=True)
class Preset:
    """Mesh axes per role: ``batch``/``seq`` split the tokens and activations, ``model`` splits the
    Megatron weight dims (the tensor dim of each parameter's role), ``update`` shards the optimizer state and
    the weight update, ``experts`` splits the expert dim of MoE blocks."""
    name: str
    batch: tuple[str, ...] = ()
    seq: tuple[str, ...] = ()
    model: tuple[str, ...] = ()
    update: tuple[str, ...] = ()
    doc: str = ""
    experts: tuple[str, ...] = ()
    shard_params: bool = False  # FSDP: weights held in their update layout, all-gathered before use
    stage: tuple[str, ...] = ()  # pipeline: the stacked layer dim split into stages over these axes
    schedule: str = "gpipe"  # pipeline: "gpipe" (autodiff reverses the forward loop) or "1f1b" (pipeline_loss)

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
    "megatron_sp": Preset("megatron_sp", batch=("data",), seq=("model",), model=("model",),
                          doc="megatron with sequence parallelism: layernorm, dropout and residual regions split "
                              "over seq on model; all-gather / reduce-scatter replace the all-reduces"),
    "pipeline": Preset("pipeline", batch=("data",), model=("model",), stage=("stage",),
                       doc="GPipe: layer stages on stage (one collective_permute per iteration), batch on data, "
                           "megatron dims on model"),
    "pipeline_1f1b": Preset("pipeline_1f1b", batch=("data",), model=("model",), stage=("stage",), schedule="1f1b",
                            doc="1F1B (PipeDream-flush): the pipeline preset with each micro-batch's backward started "
                                "as soon as its forward (and loss) is done: at most S micro-batches held per stage"),
}


def sequence_parallel(base: Preset) -> Preset:
    """``base`` with Megatron-SP (as ``megatron_sp`` is ``megatron``'s): the sequence split, outside the
    tensor-parallel regions, over the axes that split the weights (``Layout._tensor_parallel_region``)."""
    return dataclasses.replace(base, name=f"{base.name}_sp", seq=base.model,
                               doc=f"{base.doc}; sequence parallel (Megatron-SP) on {'x'.join(base.model)}")


SP_COMBINED = tuple(f"{n}_sp" for n in ("megatron_wus", "fsdp_megatron", "pipeline", "pipeline_1f1b"))
PRESETS.update((n, sequence_parallel(PRESETS[n[:-len("_sp")]])) for n in SP_COMBINED)
PIPELINE_AXES = ("stage", "data", "model")


def train_mesh(shape, preset: str = "dp") -> Mesh:
    """The mesh a preset expects: 2-d meshes are ("data", "model"); a 1-d mesh is ("model",) for
    ``megatron`` and ``megatron_sp`` (pure tensor parallelism) and ("data",) otherwise. ``pipeline`` meshes are ("stage",),
    ("stage", "data") or ("stage", "data", "model")."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if preset in PRESETS and PRESETS[preset].stage and 1 <= len(shape) <= 3:
        return Mesh(shape, PIPELINE_AXES[:len(shape)])
    if len(shape) == 2:
        return Mesh(shape, BOTH)
    if len(shape) == 1:
        return Mesh(shape, ("model",) if preset in ("megatron", "megatron_sp") else ("data",))
    raise ValueError(f"a training mesh is 1-d or 2-d; got shape {shape}")


def as_preset(preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or a Preset; got {preset!r}")
    return PRESETS[preset]


def check_experts(cfg: LMConfig, mesh: Mesh, preset: Preset) -> None:
    """Experts split over mesh axes need at least one expert per shard: fewer would leave empty expert
    shards and make the partitioner gather expert weights."""
    if cfg.moe_every and preset.experts and cfg.experts < mesh.axis_size(preset.experts):
        n = mesh.axis_size(preset.experts)
        raise ValueError(f"preset {preset.name!r} splits the experts over mesh axes {preset.experts} of size {n}, "
                         f"which needs experts >= {n}; got experts={cfg.experts} (use more experts or a mesh "
                         f"with a smaller {'x'.join(preset.experts)} axis)")


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
    if not cfg.scanned or cfg.moe_every:
        what = "MoE blocks (a pipeline of MoE groups is not built)" if cfg.moe_every else "an unrolled model"
        raise ValueError(f"preset {preset.name!r} pipelines the scanned dense layers; got {what} "
                         f"(scan_layers={cfg.scan_layers}, moe_every={cfg.moe_every})")
    if cfg.layers % stages:
        raise ValueError(f"preset {preset.name!r} needs the stage count to divide the layers; got {stages} stages "
                         f"(mesh axis {preset.stage[0]!r}) for layers={cfg.layers}")
