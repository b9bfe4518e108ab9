"""Megatron-SP combined with weight-update sharding, FSDP and the pipeline (the ``megatron_wus_sp``,
``fsdp_megatron_sp``, ``pipeline_sp`` and ``pipeline_1f1b_sp`` presets): per layer (and pipeline tick) the
activation's all-reduces over "model" become the all-gathers and reduce-scatters of ``megatron_sp``
(test_sequence_parallel.py), one reduce-scatter for each all-reduce of the preset without SP; the head keeps its
vocab-parallel cross-entropy (no all-to-all of the logits over "model"); the pipeline shifts 1/t of the
micro-batch's residual; and the steps equal the plain 1-rank step on 2x2, 2x4 and stage x data x model meshes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.train import PRESETS, make_layout
from spmd_runtime.train.step import saves_layer_inputs

from simulated import assert_trains_like_reference
from test_sequence_parallel import counts

# d large against the tokens per rank (Megatron's strategies, as in test_sequence_parallel.py); 2 layers per stage
BIG = LMConfig(layers=4, d=128, heads=4, ffn=512, vocab=256, seq=16, batch=8)


def model_axis(counter, full: int) -> dict:
    """The collectives of the (b, s, h) activation (``full`` bytes per rank, or 1/t of it) over "model"."""
    return {(kind, b): n for (kind, axes, b), n in counter.items() if axes == ("model",) and kind != "all_to_all"
            and b in (full, full // 2, full // 4)}


@pytest.mark.parametrize("preset,shape,microbatches,remat,gathers,scatters", [
    ("megatron_wus_sp", (2, 4), 1, "none", 4, 4),
    ("megatron_wus_sp", (2, 4), 1, "full", 6, 5),
    ("fsdp_megatron_sp", (2, 4), 1, "none", 4, 4),
    ("fsdp_megatron_sp", (2, 2), 1, "full", 6, 5),
    ("pipeline_sp", (2, 2, 2), 2, "none", 4, 4),
    ("pipeline_sp", (2, 1, 4), 2, "full", 6, 5),
    ("pipeline_1f1b_sp", (2, 2, 2), 2, "none", 6, 5),  # 1F1B recomputes each stage in its backward
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_all_gathers_and_reduce_scatters_replace_the_all_reduces(preset, shape, microbatches, remat, gathers,
                                                                 scatters):
    """Per layer (pipelines: per layer and tick, M + S - 1 ticks), as megatron_sp's: forward an
    all-gather before each column-parallel matmul and a reduce-scatter after each row-parallel one, backward the
    pair again, full remat two all-gathers and a reduce-scatter more; the preset without SP all-reduces once for
    each reduce-scatter. Outside the layers no all-reduce of the activation and no all-to-all over "model"."""
    cfg = dataclasses.replace(BIG, remat=remat)
    full = counts.activation_bytes(cfg, shape, preset, microbatches)
    t = shape[-1]
    layer, rest = counts.per_layer(cfg, shape, preset, microbatches)
    assert model_axis(layer, full) == {("all_gather", full // t): gathers, ("reduce_scatter", full): scatters}
    plain, plain_rest = counts.per_layer(cfg, shape, preset[:-len("_sp")], microbatches)
    assert counts.tensor_parallel_all_reduces(plain, full) == scatters
    assert counts.tensor_parallel_all_reduces(rest, full) == 0
    assert not [k for k in rest if k[0] == "all_to_all" and k[1] == ("model",)]  # the logits stay vocab-split
    # each of the preset's reductions of the activation outside the layers (the head's) a reduce-scatter
    assert rest[("reduce_scatter", ("model",), full)] == counts.tensor_parallel_all_reduces(plain_rest, full)


@pytest.mark.parametrize("preset", ["pipeline_sp", "pipeline_1f1b_sp"])
def test_the_pipeline_shifts_the_sequence_split_residual(preset):
    """Each tick's shift between stages moves the micro-batch's residual split over the sequence: 1/t of the
    bytes the preset without SP shifts; and the partitioner notes nothing (no value it could not split)."""
    mesh = sr.train_mesh((2, 1, 4), preset)
    shifts = {}
    for p in (preset, preset[:-len("_sp")]):
        program = sr.build_train_step(BIG, mesh, p, sr.SGD(lr=0.1), microbatches=2).program
        shifts[p] = {c["bytes_in"] for c in program.comm_summary() if c["kind"] == "collective_permute"}
        assert not program.notes, p
    assert len(shifts[preset]) == 1 and {4 * b for b in shifts[preset]} == shifts[preset[:-len("_sp")]]


SMALL = LMConfig(layers=4, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")


@pytest.mark.parametrize("preset,shape,microbatches,cfg", [
    ("fsdp_megatron_sp", (2, 4), 1, dataclasses.replace(SMALL, remat="full")),
    ("pipeline_sp", (2, 2, 2), 2, dataclasses.replace(SMALL, remat="full")),
    ("pipeline_1f1b_sp", (2, 2, 2), 4, dataclasses.replace(SMALL, seq=6)),  # uneven over model
    ("pipeline_1f1b_sp", (2, 1, 4), 2, dataclasses.replace(SMALL, tied=True)),
], ids=["fsdp-2x4-remat", "gpipe-2x2x2-remat", "1f1b-2x2x2-uneven", "1f1b-2x1x4-tied"])
def test_two_steps_equal_the_plain_one_rank_step(preset, shape, microbatches, cfg):
    """Losses and every parameter and optimizer slot after two AdamW steps equal the unpartitioned, unpipelined
    step's (``sr.evaluate`` of the plain 1-rank step)."""
    ts = sr.build_train_step(cfg, sr.train_mesh(shape, preset), preset, AdamW(lr=1e-2), microbatches=microbatches)
    plain = sr.build_train_step(cfg, sr.train_mesh((1,), "dp"), "dp", AdamW(lr=1e-2))
    rng = np.random.default_rng(0)
    data = [tuple(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)) for _ in range(2)) for _ in range(2)]
    assert_trains_like_reference(ts, ts.init(seed=3), data, reference=plain)


def test_1f1b_saves_each_layer_input_where_sequence_parallelism_makes_that_smaller():
    """The 1F1B stages save each layer's input when the ring of stage inputs (min(2 S - 1, M) = 10 here) is
    smaller than a layer's activations counted in residuals: (10 + (24 + 5 a s/h) / t) / 2 = 8.3 without SP,
    (34 + 5 a s/h) / 2 = 18.3 with it (the residual split t ways too): the SP preset saves the layer inputs."""
    cfg = dataclasses.replace(BIG, layers=16, remat="full")
    mesh = sr.Mesh((8, 1, 4), ("stage", "data", "model"))
    saves = {p: saves_layer_inputs(cfg, make_layout(cfg, mesh, PRESETS[p], AdamW()), 10)
             for p in ("pipeline_1f1b", "pipeline_1f1b_sp")}
    assert saves == {"pipeline_1f1b": False, "pipeline_1f1b_sp": True}
