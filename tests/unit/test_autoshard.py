"""sr.autoshard: candidates built, predicted, pruned by memory and ranked (spmd_runtime/autoshard.py)."""
from __future__ import annotations

import pytest

import spmd_runtime as sr
from spmd_runtime.autoshard import autoshard, mesh_shapes
from spmd_runtime.hardware import Hardware, Link

CFG = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=16, batch=4)
A100 = Hardware.load("dgx-a100-80gb")


def test_mesh_shapes_cover_every_factorisation():
    assert mesh_shapes("dp", 6, CFG) == [(6,)]
    assert mesh_shapes("megatron", 6, CFG) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert mesh_shapes("pipeline", 4, CFG) == [(2, 1, 2), (2, 2, 1)]  # stages dividing the 2 layers


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


def test_no_layout_that_fits_is_an_error_naming_the_sizes():
    tiny = Hardware("tiny", (("float32", 1e12),), 1 << 10, 1e12, 8, Link(1e9, 0), Link(1e9, 0))
    with pytest.raises(ValueError, match=r"no layout .* fits in 0\.00 GiB per device; got the smallest peak"):
        autoshard(CFG, 2, tiny, presets=["dp"], verbose=False)


def test_device_count_must_match_the_profile():
    with pytest.raises(ValueError, match="plans 4 devices on hardware 'dgx-a100-80gb' of 16 devices"):
        autoshard(CFG, 4, A100.with_nodes(2), verbose=False)
    with pytest.raises(ValueError, match="presets must be among"):
        autoshard(CFG, 2, A100, presets=["zero3"], verbose=False)
