"""Fully sharded parameters (``fsdp``, ``fsdp_megatron`` presets) in the simulated world: parameters and
optimizer state per rank are 1/N of the total at 2, 4 and 8 ranks; every weight is all-gathered once
before use and every gradient reduce-scattered; the new weights stay sharded; the loss curve and the
state equal data parallelism's. (Both presets also run in test_train.py's preset x mesh table against
the unpartitioned reference, and in tests/mpi/test_train_mpi.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

from spmd_runtime.models.lm import LMConfig, param_shapes
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step, train_mesh
from spmd_runtime.cost import collective_kind

from simulated import train_simulated

CFG = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
OPT = AdamW(lr=1e-2, weight_decay=0.1)
N_PARAMS = len(param_shapes(CFG))
_steps: dict = {}


def step_for(shape, preset, cfg=CFG):
    key = (shape, preset, cfg)
    if key not in _steps:
        _steps[key] = build_train_step(cfg, train_mesh(shape, preset), preset, OPT)
    return _steps[key]


def kinds(ts):
    return [(c["kind"], c["axes"]) for c in ts.program.comm_summary()]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fsdp_holds_one_nth_of_parameters_and_optimizer_state_per_rank(n):
    mem = step_for((n,), "fsdp").memory_report()
    assert mem["params"] * n == mem["params_global"]
    counter = 4  # AdamW's float32 step counter: one scalar, replicated
    assert (mem["opt_state"] - counter) * n == mem["opt_state_global"] - counter
    dp = step_for((n,), "dp").memory_report()
    assert (dp["params"], dp["opt_state"]) == (dp["params_global"], dp["opt_state_global"])


def test_fsdp_gathers_each_weight_once_reduce_scatters_each_gradient_and_keeps_weights_sharded():
    ts, dp = step_for((4,), "fsdp"), step_for((4,), "dp")
    got = kinds(ts)
    assert got.count(("all_gather", ("data",))) == N_PARAMS
    assert got.count(("reduce_scatter", ("data",))) == N_PARAMS
    assert got.count(("all_reduce", ("data",))) == 1 and len(got) == 2 * N_PARAMS + 1  # only the loss
    producer = {ins.out: ins for ins in ts.program.instrs}
    inputs = {io.slot for io in ts.program.inputs[:N_PARAMS]}
    gathers = [ins for ins in ts.program.instrs if collective_kind(ins.op) == "all_gather"]  # or its start
    assert all(producer[ins.args[0]].op == "parameter" or ins.args[0] in inputs for ins in gathers), \
        "each all-gather must read a held weight shard"
    assert all(producer[o.slot].op not in ("all_gather", "all_gather_done") for o in ts.program.outputs[:N_PARAMS]), \
        "new weights must stay sharded"
    for io in ts.program.inputs[:N_PARAMS]:
        assert not io.sharding.is_replicated, f"{io.name} must be held sharded; got {io.sharding}"
    assert ts.program.wire_bytes == pytest.approx(dp.program.wire_bytes, rel=1e-12)  # RS + AG = AR


def test_fsdp_megatron_shards_weights_over_data_inside_each_model_block():
    ts = step_for((2, 4), "fsdp_megatron")
    spec = {io.name: io.sharding for io in ts.program.inputs}
    assert spec["params.layers_wq"].dims == ((), ("data",), ("model",))
    assert spec["params.embed"].dims == (("model", "data"), ())  # data minor to model on the outermost dim
    assert spec["params.layers_ln1_g"].dims == ((), ("data",))
    assert spec["opt_state.m.layers_wq"] == spec["params.layers_wq"]
    got = set(kinds(ts))
    assert {("all_gather", ("data",)), ("reduce_scatter", ("data",)), ("all_reduce", ("model",))} <= got
    mega = step_for((2, 4), "megatron").memory_report()
    assert ts.memory_report()["params"] * 2 == mega["params"]  # megatron's blocks, halved again over data


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_fsdp_gathers_one_layer_at_a_time_inside_the_layer_loop(remat):
    """With scanned layers the stacked weights stay sharded: the loop body gathers each layer's slice where it is
    used (trips = layers; with remat, again in the backward loop) and reduce-scatters its gradient there."""
    cfg = LMConfig(layers=3, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64", remat=remat)
    ts = step_for((4,), "fsdp", cfg)
    stacked = [n for n in param_shapes(cfg) if n.startswith("layers_")]
    body_gathers = [c for c in ts.program.comm_summary() if c["kind"] == "all_gather" and c.get("trips", 1) > 1]
    assert sum(c["trips"] for c in body_gathers) == len(stacked) * cfg.layers * (1 if remat == "none" else 2)
    body_scatters = [c for c in ts.program.comm_summary() if c["kind"] == "reduce_scatter" and c.get("trips", 1) > 1]
    assert sum(c["trips"] for c in body_scatters) == len(stacked) * cfg.layers
    names = {io.slot: io.name for io in ts.program.inputs}
    top = [ins for ins in ts.program.instrs if collective_kind(ins.op) == "all_gather"]
    assert not [ins for ins in top if names.get(ins.args[0], "").startswith("params.layers_")], \
        "a stacked weight must not be gathered whole before the layer loop"


def test_scanned_fsdp_with_remat_holds_less_than_without():
    peak = {r: step_for((4,), "fsdp", LMConfig(layers=3, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8,
                                                dtype="float64", remat=r)).program.peak_bytes()
            for r in ("none", "full")}
    assert peak["full"] < peak["none"]


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_fsdp_loss_curve_and_state_equal_data_parallel(shape):
    rng = np.random.default_rng(0)
    feed = [(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)), rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)))
            for _ in range(3)]
    fsdp, dp = step_for(shape, "fsdp"), step_for(shape, "dp")
    state = dp.init(seed=1)
    (s_fsdp, l_fsdp), (s_dp, l_dp) = train_simulated(fsdp, state, feed), train_simulated(dp, state, feed)
    np.testing.assert_allclose(l_fsdp, l_dp, rtol=1e-12)
    assert l_fsdp[-1] < l_fsdp[0]
    s_fsdp, s_dp = dp.named(s_fsdp), dp.named(s_dp)
    for name in s_dp:
        np.testing.assert_allclose(s_fsdp[name], s_dp[name], rtol=1e-10, atol=1e-13, err_msg=name)


def test_bfloat16_fsdp_gathers_16bit_weights_and_reduce_scatters_16bit_gradients():
    pytest.importorskip("ml_dtypes")
    f32 = step_for((4,), "fsdp", LMConfig(**{**CFG.__dict__, "dtype": "float32"}))
    bf16 = step_for((4,), "fsdp", LMConfig(**{**CFG.__dict__, "dtype": "bfloat16"}))
    for kind in ("all_gather", "reduce_scatter"):
        moved = lambda ts: sum(c["wire_bytes"] for c in ts.program.comm_summary() if c["kind"] == kind)
        assert moved(bf16) * 2 == moved(f32) > 0
    # float32 master shards either way: 1/4 of the float32 parameters per rank
    assert bf16.memory_report()["params"] == f32.memory_report()["params"] == f32.memory_report()["params_global"] // 4
