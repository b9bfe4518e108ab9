"""Any model as a training citizen: ``Model`` states a loss written with snp / snn, its parameters' shapes (or
abstract specs) and sharding roles, and the token batch it trains on; ``build_train_step(model, mesh, preset,
optimizer, microbatches)`` then traces and partitions its step as it does the built-in LM's, and the
``TrainStep`` it returns works with ``fit``, ``save`` / ``load``, ``memory_report`` and ``comm_summary``, and
``plan_train_step`` (from shapes alone: nothing allocated)::

    cfg = gpt2.GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
    model = Model(lambda p, batch, key: gpt2.loss(cfg, p, batch["tokens"], batch["labels"], key, train=True),
                  params=gpt2.param_shapes(cfg), roles=gpt2.param_roles(cfg), batch=8, seq=64,
                  vocab=cfg.vocab_size, init=lambda seed: gpt2.init_params(cfg, seed), dropout_seed=0)
    ts = build_train_step(model, train_mesh((2, 2), "megatron"), "megatron", AdamW(lr=CosineSchedule(...)))

Dropout: with ``dropout_seed`` the loss takes a third argument, the step's key ``fold_in(key(dropout_seed),
step)`` (``step`` the optimizer's update counter, part of the state and of every checkpoint, so a resumed run
draws the same masks); evaluation calls it with key None (dropout off). The masks are the same on any mesh.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import numpy as snp
from .. import random as srandom
from ..graph import TensorSpec
from ..mesh import Mesh
from ..models.roles import ParamRole
from ..optim import Optimizer
from .layout import Layout, held_views, model_layout
from .presets import Preset
from .step import TOKEN_DTYPE, update_step_fn


@dataclass(frozen=True, eq=False)
class Model:
    """A model the trainer takes: ``loss(params, batch)`` (or ``loss(params, batch, key)`` with
    ``dropout_seed``) -> the mean loss, ``params`` a dict name -> weight, ``batch`` ``{"tokens", "labels"}``
    (batch, seq) int32 token ids in [0, ``vocab``); ``params``: name -> ``TensorSpec`` (or a shape: float32,
    or an array: its shape and dtype), one float dtype for all; ``roles``: name -> ``models.roles.ParamRole``
    (the model's sharding hints, e.g. ``gpt2.param_roles``); ``init``: ``seed -> params`` (NumPy arrays; needed
    by ``TrainStep.init`` only)."""
    loss: Callable
    params: dict
    roles: dict
    batch: int
    seq: int
    vocab: int
    init: Callable | None = None
    dropout_seed: int | None = None
    name: str = "model"
    specs: "OrderedDict[str, TensorSpec]" = field(init=False, repr=False)

    def __post_init__(self):
        specs = OrderedDict((n, _as_spec(n, p)) for n, p in self.params.items())
        object.__setattr__(self, "specs", specs)
        for what in ("batch", "seq", "vocab"):
            value = getattr(self, what)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Model {what} must be a positive int; got {value!r}")
        missing = [n for n in specs if not isinstance(self.roles.get(n), ParamRole)]
        if missing:
            raise ValueError(f"Model roles needs a models.roles.ParamRole for every parameter; got none for "
                             f"{missing[:3]} (a replicated one: models.roles.NORM)")
        dtypes = sorted({s.dtype for s in specs.values()})
        if len(dtypes) != 1 or np.dtype(dtypes[0]).kind != "f":
            raise ValueError(f"Model params must share one float dtype (the optimizer state is kept in it); got "
                             f"{dtypes}")
        if self.dropout_seed is not None and not isinstance(self.dropout_seed, (int, np.integer)):
            raise ValueError(f"Model dropout_seed must be an int or None; got {self.dropout_seed!r}")

    @property
    def dtype(self) -> str:
        return next(iter(self.specs.values())).dtype

    def param_shapes(self) -> "OrderedDict[str, tuple]":
        """The declared shapes (a state dict's)."""
        return OrderedDict((n, s.shape) for n, s in self.specs.items())

    @property
    def held_specs(self) -> "OrderedDict[str, TensorSpec]":
        """The parameters as the step holds them: the declared shapes, but a blocked role's view
        (``ParamRole.held_shape``: gpt2's fused q, k, v as (3, d, d)); the optimizer state follows them."""
        return OrderedDict((n, TensorSpec(self.roles[n].held_shape(s.shape), s.dtype)) for n, s in self.specs.items())

    def held_params(self, arrays: dict) -> dict:
        """Arrays of the declared shapes as the held ones (row-major views, no copy)."""
        return held_views(arrays, {n: s.shape for n, s in self.held_specs.items()})

    def __repr__(self):
        count = sum(int(np.prod(s.shape)) for s in self.specs.values())
        size = f"{count / 1e6:.1f}M" if count >= 100_000 else str(count)
        return f"Model({self.name!r}, {size} {self.dtype} params, batch {self.batch} x {self.seq})"


def _as_spec(name: str, p) -> TensorSpec:
    if isinstance(p, TensorSpec):
        return p
    if isinstance(p, (tuple, list)):
        return TensorSpec(tuple(p), "float32")
    if hasattr(p, "shape") and hasattr(p, "dtype"):
        return TensorSpec(p.shape, np.dtype(p.dtype).name)
    raise ValueError(f"Model params maps each name to a TensorSpec, a shape or an array; got {type(p).__name__} "
                     f"for {name!r}")


def check_model_preset(model: Model, preset: Preset) -> None:
    """The presets a Model trains under: every preset but the pipelines (they cut the model's own stacked
    layers into stages, which a loss written as one function does not expose), unless the Model holds stacked
    layers (a role with ``stacked``) and its loss runs them as GPipe stages itself (``llama.pipelined_loss``:
    the preset lays their layer dim over the stage axis)."""
    pipelines_itself = preset.schedule == "gpipe" and any(r.stacked for r in model.roles.values())
    if preset.stage and not pipelines_itself:
        raise ValueError(f"preset {preset.name!r} pipelines the built-in LM's stacked layers; a Model's loss is one "
                         f"function the trainer cannot cut into stages. Use dp, fsdp, megatron, wus, "
                         f"fsdp_megatron, ... (or hold the layers stacked, roles with stacked=True, and run them "
                         f"as stages in the loss with sr.pipeline under the GPipe preset: llama.pipelined_loss)")
    if preset.experts and not any(r.experts is not None for r in model.roles.values()):
        raise ValueError(f"preset {preset.name!r} splits experts; got a Model with no expert parameters (no "
                         f"ParamRole with an experts dim)")


def layout_for(model: Model, mesh: Mesh, preset: Preset, optimizer: Optimizer) -> Layout:
    """The step's layout of ``model`` (``layout.model_layout`` of its shapes and roles, with the optimizer's
    state slots)."""
    held = OrderedDict((n, s.shape) for n, s in model.held_specs.items())
    return model_layout(mesh, preset, model.param_shapes(), model.roles, optimizer.state_layout(held, model.dtype))


def model_input_specs(model: Model, optimizer: Optimizer) -> tuple:
    """The step's inputs (params, opt_state, batch) as trees of TensorSpecs."""
    params = dict(model.held_specs)
    batch = TensorSpec((model.batch, model.seq), TOKEN_DTYPE)
    return params, optimizer.init_state(params), {"tokens": batch, "labels": batch}


def model_step_fn(model: Model, optimizer: Optimizer, layout: Layout, microbatches: int = 1):
    """The traced training step of ``model`` (``update_step_fn``), the weights used as FSDP gathers them."""
    key_of_step = None if model.dropout_seed is None else lambda state: step_key(model.dropout_seed, state)
    return update_step_fn(_loss_fn(model), lambda params: used_weights(layout, params), optimizer, layout,
                          OrderedDict((n, s.shape) for n, s in model.held_specs.items()), microbatches, (),
                          key_of_step)


def model_eval_fn(model: Model, layout: Layout):
    """``loss(params, batch)``: the model's loss without a key (dropout off), for evaluation."""
    loss = _loss_fn(model)
    return lambda params, batch: loss(used_weights(layout, params), batch["tokens"], batch["labels"], None)[0]


def _loss_fn(model: Model):
    def loss(params, tokens, labels, key):
        batch = {"tokens": tokens, "labels": labels}
        value = model.loss(params, batch) if model.dropout_seed is None else model.loss(params, batch, key)
        return value, {}
    return loss


def used_weights(layout: Layout, params: dict) -> dict:
    """The weights where the model uses them: FSDP gathers each (held sharded) to its ``use`` spec there, its
    gradient reduce-scattered back."""
    return layout.used(params)


def step_key(seed: int, opt_state: dict):
    """The step's random key, ``fold_in(key(seed), step)``, ``step`` the optimizer's update counter."""
    return srandom.fold_in(srandom.key(int(seed)), snp.astype(update_count(opt_state), "int32"))


def update_count(opt_state: dict):
    """The optimizer's 0-d update counter in its state (``step``; under ``DynamicLossScale``, the inner one's)."""
    state = opt_state
    while "step" not in state and "inner" in state:
        state = state["inner"]
    if "step" not in state:
        raise ValueError("a Model with dropout_seed draws each step's key from the optimizer's update counter; got "
                         "an optimizer state without one (AdamW and Adafactor count, SGD with a Schedule lr)")
    return state["step"]


def check_model_optimizer(model: Model, optimizer: Optimizer) -> None:
    """Fail before tracing when the dropout key would have no step to come from."""
    if model.dropout_seed is not None:
        update_count(optimizer.init_state(dict(model.specs)))


__all__ = ["Model", "layout_for", "model_input_specs", "model_step_fn", "model_eval_fn", "step_key"]
