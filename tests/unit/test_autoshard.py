"""sr.autoshard: candidates built, predicted, pruned by memory and ranked (spmd_runtime/autoshard.py)."""
from __future__ import annotations

import dataclasses
import math

import pytest

import spmd_runtime as sr
from spmd_runtime.autoshard import autoshard, held_bytes, mesh_shapes
from spmd_runtime.hardware import Hardware, Link
from spmd_runtime.models.lm import param_shapes
from spmd_runtime.optim import AdamW

CFG = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=16, batch=4)
A100 = Hardware.load("dgx-a100-80gb")


def test_mesh_shapes_cover_every_factorisation():
    assert mesh_shapes("dp", 6, CFG) == [(6,)]
    assert mesh_shapes("megatron", 6, CFG) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert mesh_shapes("pipeline", 4, CFG) == [(2, 1, 2), (2, 2, 1)]  # stages dividing the 2 layers
    assert mesh_shapes("pipeline_1f1b", 4, CFG) == mesh_shapes("pipeline", 4, CFG)  # stage x data x model


def test_candidates_are_ranked_by_predicted_step(capsys):
    found = autoshard(CFG, 2, A100, presets=["dp", "megatron", "fsdp"])
    built = [c for c in found if c.step_s is not None]
    assert {(c.preset, c.mesh_shape) for c in found} == {("dp", (2,)), ("fsdp", (2,)), ("megatron", (1, 2)),
                                                         ("megatron", (2, 1))}
    assert [c.step_s for c in built] == sorted(c.step_s for c in built) and all(c.fits for c in built)
    for c in built:  # each prediction is the layout's own program's, not a table value
        step = c.build(CFG)
        assert c.step_s == pytest.approx(max(step.program.estimate(A100, r).step_s for r in range(2)))
    out = capsys.readouterr().out
    assert "best predicted first" in out and out.count("fits") == len(built)


def test_refused_layouts_say_why():
    moe = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=16, batch=4, moe_every=2, experts=2)
    found = autoshard(moe, 4, A100, presets=["moe"], verbose=False)
    refused = [c for c in found if c.error]
    assert refused and all("experts" in c.error for c in refused)  # experts=2 cannot split over 4


def test_held_bytes_are_parameters_and_adam_moments_per_rank():
    n = sum(math.prod(s) for s in param_shapes(CFG).values())
    dp = held_bytes(CFG, (2,), "dp", AdamW())
    assert 12 * n <= dp <= 12 * n + 64  # float32 weights, m and v replicated; a step counter
    assert held_bytes(CFG, (1, 2), "megatron", AdamW()) < 0.75 * dp  # the big matrices split in two
    assert held_bytes(CFG, (2,), "fsdp", AdamW()) <= dp / 2 + 64  # everything split over both ranks


def test_a_layout_whose_state_alone_is_too_big_is_refused_unpartitioned():
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=4, batch=4)
    n = sum(math.prod(s) for s in param_shapes(cfg).values())
    small = Hardware("small", (("float32", 1e12),), 11 * n, 1e12, 8, Link(1e9, 0), Link(1e9, 0))
    found = autoshard(cfg, 4, small, presets=["dp", "fsdp"], verbose=False)  # dp holds 12 n, fsdp 3 n per rank
    dp, fsdp = [c for c in found if c.preset == "dp"], [c for c in found if c.preset == "fsdp"]
    assert len(dp) == 1 and dp[0].step_s is None and "parameters and optimizer state alone" in dp[0].error
    assert fsdp[0].step_s is not None and fsdp[0].fits


def test_micro_batches_ascend_until_a_layout_fits():
    big = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=64, batch=16)
    one = [c for c in autoshard(big, 2, A100, presets=["dp"], microbatches=(1,), verbose=False)][0]
    need = held_bytes(big, (2,), "dp", AdamW())
    room = Hardware("room", (("float32", 1e12),), (need + one.peak_bytes) // 2, 1e12, 8, Link(1e9, 0), Link(1e9, 0))
    found = autoshard(big, 2, room, presets=["dp"], verbose=False)
    counts = sorted(c.microbatches for c in found)
    assert not [c for c in found if c.microbatches == 1][0].fits  # the whole batch at once is over
    assert counts[-1] > 1 and [c.fits for c in sorted(found, key=lambda c: c.microbatches)][-1]
    assert sum(c.fits for c in found) == 1  # it stopped at the first count that fits


def test_no_layout_that_fits_is_an_error_naming_the_sizes():
    tiny = Hardware("tiny", (("float32", 1e12),), 1 << 10, 1e12, 8, Link(1e9, 0), Link(1e9, 0))
    with pytest.raises(ValueError, match=r"no layout .* fits in 0\.00 GiB per device; got no layout built: the "
                                         r"smallest parameters and optimizer state 0\.00 GiB per rank"):
        autoshard(CFG, 2, tiny, presets=["dp"], verbose=False)
    n = sum(math.prod(s) for s in param_shapes(CFG).values())
    roomy = Hardware("roomy", (("float32", 1e12),), 13 * n, 1e12, 8, Link(1e9, 0), Link(1e9, 0))
    with pytest.raises(ValueError, match=r"fits in 0\.00 GiB per device; got the smallest peak 0\.00 GiB"):
        autoshard(CFG, 2, roomy, presets=["dp"], verbose=False)  # state fits, activations don't: built, too big


def test_device_count_must_match_the_profile():
    with pytest.raises(ValueError, match="plans 4 devices on hardware 'dgx-a100-80gb' of 16 devices"):
        autoshard(CFG, 4, A100.with_nodes(2), verbose=False)
    with pytest.raises(ValueError, match="presets must be among"):
        autoshard(CFG, 2, A100, presets=["zero3"], verbose=False)


def test_the_cli_verbs(capsys):
    from spmd_runtime.__main__ import main
    small = ["--layers", "2", "--d", "32", "--heads", "4", "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch", "4"]
    assert main(["autoshard", "--devices", "2", "--hardware", "dgx-h100", "--presets", "dp,megatron", *small]) == 0
    assert "autoshard on dgx-h100: 3 candidates" in capsys.readouterr().out
    assert main(["plan", "--preset", "megatron", "--mesh", "1,2", "--predict", "tpu-v3", *small]) == 0
    assert "predicted on tpu-v3 (rank 0)" in capsys.readouterr().out
    assert main(["autoshard", "--devices", "2", "--hardware", "dgx-a300", *small]) == 2
    assert "got 'dgx-a300'" in capsys.readouterr().err


def test_the_cli_takes_the_jobs_placement(tmp_path, capsys):
    """8 ranks on a 2-core host: each rank gets a quarter core, so the same plan predicts a slower step."""
    from spmd_runtime.__main__ import main
    host = tmp_path / "host.json"
    Hardware("host", (("float32", 1e11),), 2**34, 1e10, 2, Link(1e9, 1e-6), Link(1e9, 1e-6),
             cores_per_node=2).save(host)
    small = ["--layers", "2", "--d", "32", "--heads", "4", "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch",
             "8", "--dtype", "float32"]

    def step_ms(*placement):
        assert main(["plan", "--preset", "dp", "--mesh", "8", "--predict", str(host), *placement, *small]) == 0
        return float(capsys.readouterr().out.split("predicted on host (rank 0): step ")[1].split(" ms")[0])
    assert step_ms("--ranks-per-node", "8") > 3 * step_ms()  # the profile's 2 per node: 4 nodes of 2 cores


# ---------------------------------------------------------------- the pruned search (branch and bound)
from spmd_runtime.autoshard import compute_bound, probe_layout  # noqa: E402
from spmd_runtime.train import build_train_step, train_mesh  # noqa: E402

WIDE = sr.LMConfig(layers=4, d=64, heads=4, ffn=256, vocab=128, seq=32, batch=16)


def _same_best(pruned, full):
    a, b = next(c for c in pruned if c.fits), next(c for c in full if c.fits)
    assert (a.preset, a.mesh_shape, a.microbatches) == (b.preset, b.mesh_shape, b.microbatches)
    assert a.step_s == pytest.approx(b.step_s) and a.probe is None  # built at full size


@pytest.mark.parametrize("cfg,devices,presets", [
    (CFG, 4, ["dp", "megatron", "megatron_sp", "pipeline"]),
    (WIDE, 8, ["megatron", "megatron_wus"]),
])
def test_pruning_keeps_the_best_of_the_full_search(cfg, devices, presets):
    full = autoshard(cfg, devices, A100, presets=presets, verbose=False, prune=False)
    pruned = autoshard(cfg, devices, A100, presets=presets, verbose=False, probe_above=0)
    _same_best(pruned, full)
    built = [c for c in pruned if c.step_s is not None and c.probe is None]
    assert len(built) < len([c for c in full if c.step_s is not None])  # it did skip work


def test_a_tight_memory_keeps_the_best_too():
    one = autoshard(WIDE, 4, A100, presets=["megatron", "megatron_wus"], microbatches=(1,), verbose=False,
                    prune=False)
    need = sorted(c.peak_bytes for c in one if c.peak_bytes)[len(one) // 2]  # about half of them fit at M=1
    room = Hardware("room", (("float32", 1e12),), need, 1e12, 4, Link(1e10, 1e-6), Link(1e9, 5e-6))
    full = autoshard(WIDE, 4, room, presets=["megatron", "megatron_wus"], verbose=False, prune=False)
    _same_best(autoshard(WIDE, 4, room, presets=["megatron", "megatron_wus"], verbose=False, probe_above=0), full)


def test_compute_bound_is_below_every_prediction():
    for preset, shape, m in [("dp", (4,), 1), ("megatron", (2, 2), 2), ("pipeline", (2, 1, 2), 4),
                             ("pipeline_1f1b", (2, 2, 1), 2)]:
        step = build_train_step(WIDE, train_mesh(shape, preset), preset, microbatches=m)
        predicted = max(step.program.estimate(A100, r).step_s for r in range(4))
        stages = shape[0] if "pipeline" in preset else 1
        assert 0 < compute_bound(WIDE, 4, A100, stages, m) <= predicted, (preset, shape, m)
    # the bubble: 2 stages and 2 micro-batches run 3 iterations of work for 2
    assert compute_bound(WIDE, 4, A100, 2, 2) > compute_bound(WIDE, 4, A100, 2, 8) > compute_bound(WIDE, 4, A100)
    moe = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=16, batch=4, moe_every=2, experts=2)
    assert compute_bound(moe, 4, A100) == 0.0


def test_a_probe_cuts_the_data_axis_and_bounds_the_layout_from_below():
    assert probe_layout(WIDE, "megatron", (4, 2)) == (dataclasses.replace(WIDE, batch=8), (2, 2))
    assert probe_layout(WIDE, "pipeline", (2, 4, 1)) == (dataclasses.replace(WIDE, batch=8), (2, 2, 1))
    assert probe_layout(WIDE, "dp", (8,)) == (dataclasses.replace(WIDE, batch=4), (2,))
    assert probe_layout(WIDE, "megatron", (2, 4)) == (WIDE, (2, 4))  # data already 2
    assert probe_layout(WIDE, "seq", (8,)) == (WIDE, (8,))  # "data" splits the sequence: no cut
    for preset, shape in [("megatron", (4, 2)), ("megatron_sp", (4, 2)), ("dp", (8,))]:
        pcfg, pshape = probe_layout(WIDE, preset, shape)
        real = build_train_step(WIDE, train_mesh(shape, preset), preset)
        probe = build_train_step(pcfg, train_mesh(pshape, preset), preset)
        full = max(real.program.estimate(A100, r).step_s for r in range(8))
        cheap = max(probe.program.estimate(A100, r).step_s for r in range(math.prod(pshape)))
        assert cheap <= full, preset
        if preset != "dp":  # state not split over "data": about the same bytes per rank (a few small buffers differ)
            assert probe.program.peak_bytes() == pytest.approx(real.program.peak_bytes(), rel=1e-3), preset


def test_pruned_candidates_say_why(capsys):
    found = autoshard(WIDE, 8, A100, presets=["megatron", "pipeline"], probe_above=0)
    pruned = [c for c in found if c.pruned]
    assert pruned and all(c.step_s is None for c in pruned)
    assert all(any(w in c.pruned for w in (">= best", ">= 2.0 x best", "compute bound", "4 heads", "did not drop"))
               for c in pruned)
    assert any("model axis of 8 ranks splits 4 heads" in c.pruned for c in pruned)  # megatron (1, 8)
    assert capsys.readouterr().out.count("pruned:") == len(pruned)
