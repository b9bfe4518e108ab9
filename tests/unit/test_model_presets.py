"""Which presets each zoo model (models/gpt2.py, llama.py, resnet.py) trains under: its training step built from
abstract shapes on an abstract 4-rank mesh (traced and partitioned, never run) for every (model, preset) pair,
each cell's outcome stated in ``TABLE``: the step builds with the parameters and optimizer state held per rank as
the preset splits them (``SHARES``: no cell builds by leaving replicated what its preset splits), or it is refused
by an error naming the reason. GPT-2 and Llama train as a ``train.Model`` (``build_train_step`` / ``plan_train_step``;
Llama under the pipeline preset as its stacked model running its own stages, ``llama.pipelined_loss``), the ResNet
by ``resnet.train_step`` (its batch is images and its BN running statistics are state)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.graph import TensorSpec
from spmd_runtime.models import gpt2, llama, resnet
from spmd_runtime.optim import AdamW
from spmd_runtime.train import Model, plan_train_step, train_mesh

import llama_cases
import resnet_cases

GPT2 = gpt2.GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
RESNET = resnet.ResNetConfig(widths=(4, 8), blocks=(1, 1), num_classes=8)  # dims 4 divides: fsdp splits each weight
LLAMA = llama.ModelArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16, max_seq_len=8)
MESHES = {"dp": (4,), "fsdp": (4,), "wus": (4,), "megatron": (2, 2), "megatron_sp": (2, 2), "pipeline": (2, 1, 2),
          "pipeline_1f1b": (2, 1, 2)}
OK = "builds"
ONE_FUNCTION = "a Model's loss is one function the trainer cannot cut into stages"  # train/model.py
NOT_UNIFORM = "a ResNet's stages differ \\(widths \\(4, 8\\).* no uniform stages to cut"
NO_SEQUENCE = "splits the sequence dim over \\('model',\\); a ResNet's .* images have none"
LMS = {"dp": OK, "fsdp": OK, "wus": OK, "megatron": OK, "megatron_sp": OK, "pipeline": ONE_FUNCTION,
       "pipeline_1f1b": ONE_FUNCTION}
TABLE = {
    "gpt2": LMS,
    # the pipeline: the stacked layers run as GPipe stages by llama.pipelined_loss (1F1B runs the built-in LM's only)
    "llama": {**LMS, "pipeline": OK},
    "resnet": {"dp": OK, "fsdp": OK, "wus": OK, "megatron": OK, "megatron_sp": NO_SEQUENCE, "pipeline": NOT_UNIFORM,
               "pipeline_1f1b": NOT_UNIFORM},
}
# per-rank share of the whole model's (parameters, optimizer state), as bounds: (low, high) each
WHOLE, QUARTER, SPLIT = (1.0, 1.0), (0.2, 0.45), (0.3, 0.9)  # 1/4 but for the few dims 4 does not divide; "model" of 2
SHARES = {"dp": (WHOLE, WHOLE), "fsdp": (QUARTER, QUARTER), "wus": (WHOLE, QUARTER), "megatron": (SPLIT, SPLIT),
          "megatron_sp": (SPLIT, SPLIT), "pipeline": (QUARTER, QUARTER)}  # 2 stages x 2 megatron ranks
CELLS = [(m, p) for m in TABLE for p in TABLE[m]]


def _specs(shapes: dict) -> dict:
    return {n: TensorSpec(s, "float32") for n, s in shapes.items()}


def lm_model(name: str, preset: str) -> Model:
    """GPT-2 or Llama as a user states it to the trainer: loss, abstract parameters, roles; no init. Under a
    pipeline preset Llama is the stacked model running its stages (``llama_cases.pipelined_model``)."""
    if name == "llama" and preset.startswith("pipeline"):
        return llama_cases.pipelined_model(train_mesh(MESHES[preset], preset), preset)
    if name == "gpt2":
        return Model(lambda p, b: gpt2.loss(GPT2, p, b["tokens"], b["labels"]), _specs(gpt2.param_shapes(GPT2)),
                     gpt2.param_roles(GPT2), 4, 8, GPT2.vocab_size, name="gpt2")
    return Model(lambda p, b: llama.loss(LLAMA, p, b["tokens"], b["labels"]), _specs(llama.param_shapes(LLAMA)),
                 llama.param_roles(LLAMA), 4, 8, LLAMA.vocab_size, name="llama")


def shares(model: str, preset: str) -> tuple[float, float]:
    """Build the step of ``model`` under ``preset`` from shapes alone; rank 0's share of the whole parameters and
    optimizer state."""
    microbatches = 2 if preset.startswith("pipeline") else 1
    if model != "resnet":
        with warnings.catch_warnings():  # megatron's c_attn reshapes warn (models/gpt2.py's own business)
            warnings.simplefilter("ignore", UserWarning)
            m = plan_train_step(lm_model(model, preset), train_mesh(MESHES[preset], preset), preset, AdamW(),
                                1 if model == "llama" else microbatches).memory  # its loss cuts the micro-batches
        return m["params"] / m["params_global"], m["opt_state"] / m["opt_state_global"]
    step, _ = resnet_cases.program(preset, MESHES[preset], cfg=RESNET)
    params, stats = _specs(resnet.param_shapes(RESNET)), _specs(resnet.stats_shapes(RESNET))
    state = resnet_cases.OPT.init_state(params)
    images = TensorSpec((resnet_cases.BATCH, 3, resnet_cases.SIZE, resnet_cases.SIZE), "float32")
    program = step.lower(params, stats, state, images, TensorSpec((resnet_cases.BATCH,), "int32"))
    held = program.input_bytes()
    whole = [int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in sr.pytree.flatten(state)[0]]
    state_at = len(params) + len(stats)
    return (sum(held[:len(params)]) / sum(4 * np.prod(s.shape) for s in params.values()),
            sum(held[state_at:state_at + len(whole)]) / sum(whole))


@pytest.mark.parametrize("model,preset", CELLS, ids=[f"{m}-{p}" for m, p in CELLS])
def test_each_model_builds_under_each_preset_or_says_why_not(model, preset):
    want = TABLE[model][preset]
    if want != OK:
        with pytest.raises(ValueError, match=want):
            shares(model, preset)
        return
    got = shares(model, preset)
    for what, value, (low, high) in zip(("parameters", "optimizer state"), got, SHARES[preset]):
        assert low <= value <= high, f"{model} under {preset}: rank 0 holds {value:.3f} of the {what}, want " \
                                     f"[{low}, {high}]"
