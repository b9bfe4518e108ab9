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

The package:

- ``presets``: the presets (mesh axes per role), ``train_mesh``, and what a preset needs of the config;
- ``layout``: every input's spec (parameters by the sharding role the model declares for each) and the
  activation annotations a preset gives the step;
- ``step``: the traced step (and the FSDP / pipeline ways to run the scanned layers, gradient accumulation);
- ``model``: ``Model``, any model (a loss written with snp / snn, its parameters' specs and sharding roles) as
  ``build_train_step`` takes it besides the built-in LM's ``LMConfig``, and its traced step;
- ``runtime``: ``build_train_step``, ``TrainStep`` (run, gather, checkpoints, reports) and the MPI helpers
  that do rank 0's work while the other ranks sleep;
- ``loop``: ``fit``, the training loop on a ``TokenLoader`` (logging, evaluation every N steps, periodic
  checkpoints with the loader's position, exact resume), ``token_loaders``, ``evaluate``;
- ``plan``: ``plan_train_step``, the step planned from shapes alone (nothing allocated, nothing run) with its
  per-rank figures (the ``python -m spmd_runtime plan`` verb).

Optimizers (``optim``), checkpoints (``checkpoint``) and the pipeline (``pipeline``) are their own modules.
"""
from .layout import (MOE_ROLES, Layout, ParamLayout, make_layout, model_layout, moe_activation_spec, param_layout,
                     param_spec, state_leaf_name, update_spec)
from .presets import (BOTH, PIPELINE_AXES, PRESETS, SP_COMBINED, Preset, as_preset, check_experts, check_pipeline,
                      train_mesh)
from .model import Model
from .plan import Plan, instruction_count, plan_train_step
from .runtime import TrainStep, build_train_step, build_train_step_on_root, check_batch, format_comm, run_on_root
from .step import (TOKEN_DTYPE, accumulate, eval_loss_fn, fsdp_layers, input_specs, metric_names, norm_groups,
                   pipeline_layers, step_specs, train_step_fn)
from .loop import FitResult, evaluate, fit, token_loaders

__all__ = ["Model", "Preset", "PRESETS", "TrainStep", "build_train_step", "build_train_step_on_root",
           "run_on_root", "train_mesh", "param_spec", "update_spec", "param_layout", "ParamLayout", "model_layout",
           "format_comm", "Plan", "plan_train_step", "fit", "FitResult", "evaluate", "token_loaders"]
