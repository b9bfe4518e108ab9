"""Megatron-SP (Korthikanti et al. 2022) as the ``megatron_sp`` preset, in the simulated world: the residual and
LayerNorm regions split over the sequence on "model", each tensor-parallel all-reduce of the (b, s, h) activation
replaced by a reduce-scatter into the sequence split and an all-gather out of it (the same bytes), and the
training step equal to the unpartitioned reference on 2x2 and 2x4 meshes (even and uneven sequence splits)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW

from simulated import assert_trains_like_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("collectives_per_layer",
                                               os.path.join(ROOT, "scripts", "collectives_per_layer.py"))
counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counts)

# d large against the tokens per rank, as in the published configs: the weights are dearer to move than the
# activations, so the strategies are Megatron's
BIG = LMConfig(layers=3, d=128, heads=4, ffn=512, vocab=256, seq=16, batch=4)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2)], ids=["2x4", "2x2"])
@pytest.mark.parametrize("remat,gathers,scatters", [("none", 4, 4), ("full", 6, 5)])
def test_all_gathers_and_reduce_scatters_replace_the_all_reduces(shape, remat, gathers, scatters):
    """Per layer: forward all-gathers before the QKV and MLP-up matmuls, reduce-scatters after the output
    projection and MLP-down; backward the same pair again (the all-gather of the cotangent before the row-parallel
    matmuls' input gradient, the reduce-scatter of the QKV / MLP-up input gradients). Full remat recomputes the
    forward up to the MLP's input: two all-gathers and a reduce-scatter more. Megatron's all-reduces: none."""
    cfg = dataclasses.replace(BIG, remat=remat)
    layer, _ = counts.per_layer(cfg, shape, "megatron_sp")
    full = counts.activation_bytes(cfg, shape, "megatron_sp")
    shard = full // shape[1]
    activation = {(kind, axes, b): n for (kind, axes, b), n in layer.items() if axes == ("model",)}
    assert activation == {("all_gather", ("model",), shard): gathers, ("reduce_scatter", ("model",), full): scatters}
    plain, _ = counts.per_layer(cfg, shape, "megatron")
    assert counts.tensor_parallel_all_reduces(plain, full) == scatters  # Megatron: one all-reduce for each


def test_the_same_wire_bytes_per_layer_as_megatron():
    """reduce-scatter (n-1)/n S + all-gather (n-1)/n S == all-reduce 2(n-1)/n S, per layer."""
    def model_axis_bytes(preset):
        mesh = sr.train_mesh((2, 4), preset)
        cfg = dataclasses.replace(BIG, layers=2)
        program = sr.build_train_step(cfg, mesh, preset, sr.SGD(lr=0.1)).program
        return sum(c["wire_bytes"] for c in program.comm_summary() if c["axes"] == ("model",) and c.get("trips", 1) == 2)
    assert model_axis_bytes("megatron_sp") == pytest.approx(model_axis_bytes("megatron"), rel=1e-12)


def test_activations_outside_the_tensor_parallel_regions_are_split_over_the_sequence():
    ts = sr.build_train_step(BIG, sr.train_mesh((2, 4), "megatron_sp"), "megatron_sp", sr.SGD(lr=0.1))
    residuals = [n for n in ts.graph.nodes if n.op == "mesh_split" and n.shape == (BIG.batch, BIG.seq, BIG.d)]
    assert any(n.attrs["sharding"].dims == (("data",), ("model",), ()) for n in residuals)


SMALL = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=4, dtype="float64")


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("shape,cfg", [((2, 2), SMALL), ((2, 4), SMALL),
                                       ((2, 4), dataclasses.replace(SMALL, seq=6, remat="full")),  # uneven
                                       ((2, 2), dataclasses.replace(SMALL, tied=True, scan_layers=False))],
                         ids=["2x2", "2x4", "2x4-uneven-remat", "2x2-tied-unrolled"])
def test_two_steps_match_the_unpartitioned_reference(shape, cfg):
    ts = sr.build_train_step(cfg, sr.train_mesh(shape, "megatron_sp"), "megatron_sp", AdamW(lr=1e-2))
    state = ts.init(seed=3)
    rng = np.random.default_rng(0)
    data = [tuple(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)) for _ in range(2)) for _ in range(2)]
    assert_trains_like_reference(ts, state, data)
