"""sr.autoshard_tensors / sr.autoshard_jit: per-tensor shardings searched from a layout (spmd_runtime/autoshard_tensors.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.autoshard_tensors import Choice, Group, autoshard_jit, autoshard_tensors, train_moves, use_candidates
from spmd_runtime.hardware import Hardware, Link

from simulated import assert_all_ranks, assert_trains_like_reference

CFG = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=64, seq=16, batch=4)
CFG64 = dataclasses.replace(CFG, dtype="float64")
A100 = Hardware.load("dgx-a100-80gb")
MESH = sr.Mesh((2, 2), ("data", "model"))
D, M, DM = ("data",), ("model",), ("data", "model")


def test_candidates_are_every_legal_split_of_one_or_two_dims():
    got = set(use_candidates(Group("w", (0,), (8, 6), 0), MESH))
    assert got == {(None, None), (D, None), (M, None), (DM, None), (None, D), (None, M), (None, DM), (D, M), (M, D)}
    # never more shards than elements: 3 rows do not split 4 ways
    assert (DM, None) not in set(use_candidates(Group("w", (0,), (3, 6), 0), MESH))
    # a stacked layer dim keeps its entry; a pipeline's stage axis is taken by it
    stacked = use_candidates(Group("w", (0,), (2, 8), 0, {0: None}), MESH)
    assert {c[0] for c in stacked} == {None} and len(stacked) == 4
    mesh3 = sr.Mesh((2, 1, 2), ("stage", "data", "model"))
    staged = use_candidates(Group("w", (0,), (2, 8), 0, {0: ("stage",)}), mesh3)
    assert staged == [(("stage",), None), (("stage",), M)]  # the data axis of size 1 splits nothing


def test_moves_keep_the_update_mode_and_offer_the_others():
    g = Group("w", (0,), (8, 6), 0)
    moves = train_moves(g, Choice((None, M), (None, M), (None, M)), MESH)
    assert Choice((D, None), (D, None), (D, None)) in moves  # a new use spec, update as used
    assert Choice((None, M), (None, M), (D, M)) in moves  # weight-update sharding over the free axis
    assert Choice((D, M), (None, M), (D, M)) in moves  # FSDP: held as updated
    wus = train_moves(g, Choice((None, M), (None, M), (D, M)), MESH)
    # a new use spec keeps the update sharded: the free axis minor on the outermost dim that divides (update_spec)
    assert Choice((M, None), (M, None), (("model", "data"), None)) in wus
    assert Choice((M, None), (M, None), (M, D)) not in wus


def assert_consistent(result, cfg=CFG, hardware=A100):
    """Never predicted slower than the start (nor a larger peak when the start did not fit), each move an
    improvement, and the prediction that of the found layout's own program."""
    assert result.final.fits and result.step_s <= result.start.step_s
    for m in result.moves:
        assert m.step_after < m.step_before or m.peak_after < result.start.peak_bytes
    step = result.build(cfg)
    ranks = range(step.mesh.size)
    assert result.step_s == pytest.approx(max(step.program.estimate(hardware, r).step_s for r in ranks))
    assert result.peak_bytes == step.program.peak_bytes()
    return step


@pytest.mark.parametrize("start", [("megatron", (2, 2)), ("megatron", (1, 4)), ("dp", (4,)), None],
                         ids=["megatron-2x2", "megatron-1x4", "dp-4", "best"])
def test_the_search_never_ends_slower_than_its_start(start, capsys):
    presets = ["dp", "megatron", "fsdp"]
    result = autoshard_tensors(CFG, 4, A100, start=start, presets=presets, budget=20)
    assert_consistent(result)
    if start is None:  # the best preset on 4 devices, as autoshard ranks them
        best = sr.autoshard(CFG, 4, A100, presets=presets, verbose=False)[0]
        assert (result.baseline.preset, result.baseline.mesh_shape) == (best.preset, best.mesh_shape)
        assert result.start.step_s == pytest.approx(best.step_s)
    out = capsys.readouterr().out
    assert "autoshard_tensors on dgx-a100-80gb" in out and out.count("->") == len(result.moves)


def test_free_communication_keeps_the_start_or_improves_it():
    free = Hardware("free-comm", A100.flops, A100.memory_bytes, A100.memory_bandwidth, 8, Link(1e30, 0.0),
                    Link(1e30, 0.0))
    result = autoshard_tensors(CFG, 4, free, start=("megatron", (2, 2)), budget=20, verbose=False)
    assert_consistent(result, hardware=free)
    assert result.build(CFG).program.estimate(free).comm_s == pytest.approx(0.0, abs=1e-9)


def tight(cfg, start, fraction):
    """A profile whose memory lies ``fraction`` of the way from the fsdp layout's peak to ``start``'s."""
    peak = lambda preset, shape: sr.build_train_step(cfg, sr.train_mesh(shape, preset), preset).program.peak_bytes()
    low, high = peak("fsdp", start[1]), peak(*start)
    memory = int(low + fraction * (high - low))
    return Hardware("tight", A100.flops, memory, A100.memory_bandwidth, 8, A100.intra, A100.inter), high


def test_tiny_memory_shards_parameters_until_the_peak_fits():
    small, start_peak = tight(CFG, ("dp", (4,)), 0.5)
    result = autoshard_tensors(CFG, 4, small, start=("dp", (4,)), budget=60, verbose=False)
    assert start_peak > small.memory_bytes >= result.peak_bytes  # the start did not fit; the result does
    assert not result.start.fits and result.final.fits
    assert any(any(c.held) for c in result.choices.values())  # some parameter is held sharded
    assert_consistent(result, hardware=small)


def test_nothing_fits_is_an_error_naming_the_limit():
    tiny = Hardware("tiny", A100.flops, 1 << 10, A100.memory_bandwidth, 8, A100.intra, A100.inter)
    with pytest.raises(ValueError, match=r"no layout of .* fits in 0\.000 GiB per device \(the profile's "
                                         r"memory_bytes 1024\); got the smallest peak \d+\.\d+ GiB after \d+ evaluations"):
        autoshard_tensors(CFG, 4, tiny, start=("dp", (4,)), budget=8, verbose=False)


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="plans 4 devices on hardware 'dgx-a100-80gb' of 16 devices"):
        autoshard_tensors(CFG, 4, A100.with_nodes(2), verbose=False)
    with pytest.raises(ValueError, match=r"start layout must have 4 devices; got mesh \(2, 4\)"):
        autoshard_tensors(CFG, 4, A100, start=("megatron", (2, 4)), verbose=False)


def feed(n, cfg, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)), rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)))
            for _ in range(n)]


@pytest.mark.parametrize("case", ["a100-megatron-2x2", "tight-dp-1x4"])
def test_the_found_layout_computes_what_the_reference_does(case):
    if case.startswith("a100"):
        result = autoshard_tensors(CFG64, 4, A100, start=("megatron", (2, 2)), budget=20, verbose=False)
    else:
        small, _ = tight(CFG64, ("megatron", (1, 4)), 0.3)
        result = autoshard_tensors(CFG64, 4, small, start=("megatron", (1, 4)), budget=40, verbose=False)
        assert result.moves  # the start does not fit: the layout moved
    ts = result.build(CFG64)
    assert_trains_like_reference(ts, ts.init(seed=3), feed(2, CFG64))


def mlp(params, x):
    for layer in params:
        x = sr.numpy.maximum(x @ layer["w"], 0.0) + layer["b"]
    return sr.numpy.sum(x * x)


MLP_ARGS = ([{"w": sr.TensorSpec((64, 64), "float64"), "b": sr.TensorSpec((64,), "float64")}] * 3,
            sr.TensorSpec((32, 64), "float64"))


def test_a_jitted_function_searches_its_inputs_and_computes_the_same(capsys):
    result = autoshard_jit(mlp, *MLP_ARGS, mesh=MESH, hardware=A100, in_specs=(None, sr.P("data")), budget=40)
    assert result.step_s <= result.start.step_s
    assert set(result.choices) == {"args.0.*.w", "args.0.*.b", "args.1"}  # layers grouped
    assert "autoshard_tensors on dgx-a100-80gb from the given in_specs" in capsys.readouterr().out
    program = sr.jit(mlp, mesh=MESH, in_specs=result.in_specs).lower(*MLP_ARGS)  # the in_specs are jit's
    assert max(program.estimate(A100, r).step_s for r in range(4)) == pytest.approx(result.step_s)
    rng = np.random.default_rng(0)
    params = [{"w": rng.standard_normal((64, 64)) / 8, "b": rng.standard_normal(64)} for _ in range(3)]
    x = rng.standard_normal((32, 64))
    want = x
    for layer in params:
        want = np.maximum(want @ layer["w"], 0.0) + layer["b"]
    assert_all_ranks(result.program, (params, x), [np.asarray(np.sum(want * want))], tol=1e-9)


def test_the_cli_flag(capsys):
    from spmd_runtime.__main__ import main
    small = ["--layers", "2", "--d", "32", "--heads", "4", "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch", "4"]
    assert main(["autoshard", "--devices", "2", "--hardware", "dgx-a100-80gb", "--presets", "dp,megatron",
                 "--per-tensor", "--budget", "4", *small]) == 0
    out = capsys.readouterr().out
    assert "autoshard on dgx-a100-80gb: 3 candidates" in out
    assert "autoshard_tensors on dgx-a100-80gb from " in out and "in 4 evaluations" in out
