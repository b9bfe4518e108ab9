"""Allocation-free planning: programs built from abstract leaves (TensorSpecs, ShapeDtypeStruct-likes), the
training step of a 175B-parameter model planned on 64 ranks without allocating it, and the ``plan`` CLI verb."""
import time
import tracemalloc

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.__main__ import main
from spmd_runtime.optim import SGD, AdamW, DynamicLossScale, is_abstract
from spmd_runtime.train import build_train_step, input_specs, train_mesh
from spmd_runtime.train.plan import plan_train_step

MB = 1 << 20


class ShapeDtype:
    """Like jax.ShapeDtypeStruct: a shape and a dtype, no data."""
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def traced_peak(fn):
    """(fn(), the peak of Python-traced allocations while it ran, in bytes)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


GPT3 = sr.LMConfig(layers=96, d=12288, heads=96, ffn=4 * 12288, vocab=51200, seq=2048, batch=64, dtype="bfloat16",
                   remat="full")


def test_a_175b_parameter_step_plans_without_allocating():
    mesh = sr.Mesh((8, 8), ("data", "model"))
    start = time.perf_counter()
    step, peak = traced_peak(lambda: build_train_step(GPT3, mesh, "megatron"))
    seconds = time.perf_counter() - start
    assert peak < 200 * MB, f"planning allocated {peak / MB:.0f} MB"
    assert seconds < 60
    l, h, v, s, t = GPT3.layers, GPT3.d, GPT3.vocab, GPT3.seq, 8
    # the hand count of this model's parameters (no biases but LayerNorm's; untied output layer)
    whole = 12 * l * h * h + 4 * l * h + 2 * v * h + s * h + 2 * h
    assert 174e9 < whole < 176e9
    report = step.memory_report()
    assert report["params_global"] == 4 * whole
    # megatron: every matrix and the vocab split over the 8 model ranks; LayerNorm and positions replicated
    assert report["params"] == 4 * ((12 * l * h * h + 2 * v * h) // t + 4 * l * h + s * h + 2 * h)
    assert report["opt_state"] == 2 * report["params"] + 4  # Adam's m and v, and the step counter
    assert report["peak"] > report["params"] + report["opt_state"]
    kinds = {(g["kind"], g["axes"]) for g in step.comm_summary()}
    assert ("all_reduce", ("model",)) in kinds and ("all_reduce", ("data",)) in kinds


@pytest.mark.parametrize("preset,shape,cfg,micro", [
    ("pipeline", (4, 2, 2), sr.LMConfig(layers=8, d=4096, heads=32, ffn=16384, vocab=32000, seq=1024, batch=32,
                                        dtype="bfloat16", remat="full"), 4),
    ("fsdp_megatron", (4, 4), sr.LMConfig(layers=8, d=4096, heads=32, ffn=16384, vocab=32000, seq=1024, batch=32,
                                          dtype="bfloat16"), 1),
    ("moe", (8, 1), sr.LMConfig(layers=4, d=2048, heads=16, ffn=8192, vocab=32000, seq=512, batch=16, moe_every=2,
                                experts=64, dtype="bfloat16"), 1),
])
def test_every_preset_family_plans_from_shapes(preset, shape, cfg, micro):
    """Several GiB of parameters, planned with a few MB of Python allocations."""
    step, peak = traced_peak(lambda: build_train_step(cfg, train_mesh(shape, preset), preset, microbatches=micro))
    assert step.memory_report()["params_global"] > 1 << 30
    assert peak < 100 * MB, f"planning {preset} allocated {peak / MB:.0f} MB"


def test_input_specs_and_init_state_are_abstract():
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=50, seq=8, batch=2)
    params, state, batch = input_specs(cfg, AdamW())
    leaves = [*params.values(), *state["m"].values(), *state["v"].values(), state["step"], *batch.values()]
    assert all(isinstance(x, sr.TensorSpec) for x in leaves)
    assert state["m"]["embed"] == sr.TensorSpec((50, 32), "float32") and state["step"] == sr.TensorSpec((), "float32")
    # any leaf with a shape and a dtype that holds no data is abstract; arrays are not
    jaxlike = {"w": ShapeDtype((1 << 20, 1 << 20), "float32")}  # 4 TiB: never built
    assert is_abstract(jaxlike) and not is_abstract({"w": np.zeros(3)})
    scaled = DynamicLossScale(SGD()).init_state(jaxlike)
    assert scaled["inner"]["mom"]["w"] == sr.TensorSpec((1 << 20, 1 << 20), "float32")
    assert scaled["loss_scale"] == sr.TensorSpec((), "float32")
    concrete = DynamicLossScale(SGD()).init_state({"w": np.ones((2, 3), "float32")})  # unchanged for arrays
    assert float(concrete["loss_scale"]) == 2.0 ** 15 and concrete["inner"]["mom"]["w"].shape == (2, 3)


def test_jit_lower_takes_abstract_arguments():
    mesh = sr.Mesh((4, 2), ("data", "model"))
    f = lambda x, w: snp.tanh(x @ w)
    specs = (sr.P("data", None), sr.P(None, "model"))
    big, peak = traced_peak(lambda: sr.jit(f, mesh=mesh, in_specs=specs).lower(
        sr.TensorSpec((1 << 16, 1 << 14)), ShapeDtype((1 << 14, 1 << 16), "float32")))  # 4 GiB each
    assert peak < 20 * MB
    assert big.peak_bytes() >= (2 << 30) // 8 * 2  # the local blocks of x and w at least
    # the same program as from arrays of those shapes
    x, w = np.ones((12, 6), "float32"), np.ones((6, 4), "float32")
    from_arrays = sr.jit(f, mesh=mesh, in_specs=specs).lower(x, w)
    from_specs = sr.jit(f, mesh=mesh, in_specs=specs).lower(sr.TensorSpec((12, 6)), ShapeDtype((6, 4), "float32"))
    assert from_specs.hash == from_arrays.hash


def test_plan_cli_prints_a_model_that_could_never_fit(tmp_path, capsys):
    """A 1T-parameter layout, shrunk in depth and batch so the unit suite stays fast; nothing is allocated."""
    argv = ["plan", "--preset", "pipeline", "--mesh", "4,2,8", "--layers", "8", "--d", "25600", "--heads", "160",
            "--seq", "2048", "--batch", "16", "--microbatches", "4", "--remat", "full",
            "--save", str(tmp_path / "p.json")]
    rc, peak = traced_peak(lambda: main(argv))
    out = capsys.readouterr().out
    assert rc == 0 and peak < 200 * MB
    for line in ("partition seconds", "instructions", "parameters", "optimizer state", "peak",
                 "pipeline: 4 stages, 4 micro-batches, GPipe bubble (S-1)/(M+S-1) = 0.429",
                 "all_reduce", "model", "collective_permute", "total wire bytes per rank per step"):
        assert line in out
    saved = sr.load_program(tmp_path / "p.json")
    assert saved.mesh.shape == (4, 2, 8) and saved.wire_bytes > 0


def test_plan_cli_refuses_a_bad_config(capsys):
    rc = main(["plan", "--preset", "megatron", "--mesh", "2,2", "--d", "100", "--heads", "3"])
    assert rc == 2 and "d to be a multiple of heads" in capsys.readouterr().err


def test_plan_train_step_counts_body_instructions():
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=50, seq=8, batch=4)
    plan = plan_train_step(cfg, train_mesh((2, 2)), "megatron")
    assert plan.instructions > len(plan.step.program.instrs)  # the scanned layers' body counted too
    assert sum(plan.wire_by_axis().values()) == pytest.approx(sum(g["wire_bytes"] for g in plan.comm))
