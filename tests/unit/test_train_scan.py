"""The LM's layers as ONE scan over stacked parameters, rematerialisation and gradient accumulation
(simulated world): the same loss as the unrolled model, partitioned steps equal to the reference step,
a program whose size does not grow with depth, and remat's lower peak memory."""
from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import pytree
from simulated import run_everywhere
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.runner import shard
from spmd_runtime.models.lm import LMConfig, init_params, lm_loss, param_shapes
from spmd_runtime.optim import AdamW

CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=4, dtype="float64", scan_layers=True)
OPT = AdamW(lr=1e-2)


def batch(cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype("int32") for _ in range(2)]


def build(cfg, shape, preset, microbatches=1, donate=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sr.build_train_step(cfg, sr.train_mesh(shape, preset), preset, OPT, microbatches=microbatches,
                                   donate=donate)


def test_layers_are_scanned_by_default_for_dense_models_and_unrolled_for_moe():
    assert LMConfig().scanned and not LMConfig(moe_every=2, experts=2).scanned
    assert "layers_wq" in param_shapes(LMConfig()) and "l1_we1" in param_shapes(LMConfig(moe_every=2, experts=2))


@pytest.mark.parametrize("shape, preset, remat", [((1,), "dp", "none"), ((4,), "moe", "none"),
                                                  ((4,), "moe", "full_save_all_to_all"), ((2, 2), "moe", "full")],
                         ids=["dp-1", "moe-4", "moe-4-remat", "moe-2x2-full"])
def test_moe_layers_scanned_in_groups_step_as_unrolled_in_a_program_that_does_not_grow(shape, preset, remat):
    """scan_layers=True with MoE blocks: ONE scan over groups of moe_every blocks ("layers<r>_<kind>" stacks
    block r of every group): the same initial parameters (stacked), the same loss and updated state as the
    unrolled model, on every rank against the reference step, the same all-to-all bytes, and a program that
    does not grow with the groups."""
    cfg = dataclasses.replace(MOE, experts=8, capacity_factor=2.0, remat=remat)
    tokens, labels = batch(cfg)
    unrolled, scanned = (build(dataclasses.replace(cfg, scan_layers=s), shape, preset, donate=True)
                         for s in (False, True))
    assert [n for n in param_shapes(scanned.cfg) if "we1" in n] == ["layers1_we1"]
    flat, stacked = unrolled.init(0), scanned.init(0)
    for name, value in stacked["params"].items():  # group g's block r is unrolled layer g * moe_every + r
        layers = [f"l{i}_{name.split('_', 1)[1]}" for i in sr.models.lm.stacked_layers(cfg, name)] \
            if sr.models.lm.is_stacked(name) else None
        want = np.stack([flat["params"][n] for n in layers]) if layers else flat["params"][name]
        np.testing.assert_array_equal(value, want, err_msg=name)
    (want_state, want_loss), (got_state, got_loss) = (ts.reference_step(st, tokens, labels)
                                                      for ts, st in ((unrolled, flat), (scanned, stacked)))
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    for name, value in got_state["params"].items():
        layers = sr.models.lm.stacked_layers(cfg, name) if sr.models.lm.is_stacked(name) else None
        want = (np.stack([want_state["params"][f"l{i}_{name.split('_', 1)[1]}"] for i in layers]) if layers
                else want_state["params"][name])
        np.testing.assert_allclose(value, want, rtol=1e-9, atol=1e-12, err_msg=name)
    for outs in run_everywhere(scanned.program, stacked["params"], stacked["opt_state"], {"tokens": tokens,
                                                                                         "labels": labels}):
        assert float(outs[-1]) == pytest.approx(want_loss, rel=1e-10)
    if preset == "moe":
        assert all_to_alls(scanned.program)[1] == all_to_alls(unrolled.program)[1] > 0
    deeper = build(dataclasses.replace(cfg, scan_layers=True, layers=8), shape, preset)
    assert len(deeper.program.instrs) == len(build(dataclasses.replace(cfg, scan_layers=True), shape,
                                                   preset).program.instrs) < len(unrolled.program.instrs)


def test_scanned_layers_compute_the_unrolled_loss():
    tokens, labels = batch()

    def loss_of(cfg):
        params = list(init_params(cfg).values())
        graph = sr.trace(lambda *a: lm_loss(cfg, a[:-2], a[-2], a[-1]), *params, tokens, labels)
        return sr.evaluate(graph, *params, tokens, labels)[0], graph
    (unrolled, _), (scanned, graph) = loss_of(dataclasses.replace(CFG, scan_layers=False)), loss_of(CFG)
    assert sum(n.op == "scan" for n in graph.nodes) == 1
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-13)


@pytest.mark.parametrize("shape,preset,microbatches", [((2, 2), "megatron_wus", 1), ((2, 2), "dp", 2),
                                                       ((3,), "wus", 2)], ids=str)
def test_partitioned_scan_step_matches_the_reference_step(shape, preset, microbatches):
    ts = build(CFG, shape, preset, microbatches)
    state = ts.init(0)
    tokens, labels = batch()
    want_state, want_loss = ts.reference_step(state, tokens, labels)
    batch_ = {"tokens": np.asarray(tokens, np.int32), "labels": np.asarray(labels, np.int32)}
    for outs in run_everywhere(ts.program, state["params"], state["opt_state"], batch_):
        assert float(outs[-1]) == pytest.approx(want_loss, rel=1e-12)
        for got, want in zip(outs[:-1], ts.named(want_state).values()):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_scanned_step_updates_like_the_unrolled_step():
    """Stacking changes no update: LayerNorm gains stacked to [layers, d] are still not weight-decayed."""
    tokens, labels = batch()
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    steps = [sr.build_train_step(dataclasses.replace(CFG, scan_layers=s), sr.train_mesh((1,), "dp"), "dp", opt)
             for s in (False, True)]
    (flat, flat_loss), (stacked, stacked_loss) = (ts.reference_step(ts.init(0), tokens, labels) for ts in steps)
    assert stacked_loss == pytest.approx(flat_loss, rel=1e-13)
    for name, got in steps[1].named(stacked).items():
        if "layers_" in name:
            want = np.stack([steps[0].named(flat)[name.replace("layers_", f"l{i}_")] for i in range(CFG.layers)])
        else:
            want = steps[0].named(flat)[name]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=name)


def test_accumulated_step_equals_the_whole_batch_step():
    tokens, labels = batch()
    state = build(CFG, (1,), "dp").init(0)
    (s1, l1), (s4, l4) = (build(CFG, (1,), "dp", m).reference_step(state, tokens, labels) for m in (1, 4))
    assert l4 == pytest.approx(l1, rel=1e-12)
    for a, b in zip(pytree.flatten(s1)[0], pytree.flatten(s4)[0]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_program_size_does_not_grow_with_depth():
    shallow, deep = (build(dataclasses.replace(CFG, layers=n), (2, 2), "megatron", 1).program for n in (2, 7))
    assert len(shallow.instrs) == len(deep.instrs)
    assert [i.op for i in shallow.instrs] == [i.op for i in deep.instrs]


def test_remat_lowers_peak_memory_of_the_step():
    """Peak with the state updated in place (donated): without it the new state's buffers, allocated while the
    caller holds the old, set the peak whatever the remat policy."""
    peak = {r: build(dataclasses.replace(CFG, layers=4, remat=r), (1,), "dp", donate=True).program.peak_bytes()
            for r in ("none", "dots", "full")}
    assert peak["full"] < peak["dots"] < peak["none"], peak


def test_bad_accumulation_and_remat_settings_raise():
    with pytest.raises(ValueError, match="microbatches must be a positive int dividing the batch; got "
                                         "microbatches=3 for batch=4"):
        build(CFG, (1,), "dp", 3)
    with pytest.raises(ValueError, match="remat must be one of"):
        LMConfig(remat="some")
    with pytest.raises(ValueError, match="scans whole groups of moe_every blocks; got layers=3, moe_every=2"):
        LMConfig(layers=3, scan_layers=True, moe_every=2, experts=2)


MOE = dataclasses.replace(CFG, scan_layers=None, layers=4, moe_every=2, experts=4, capacity_factor=4.0)


@pytest.mark.parametrize("cfg,shape,preset", [(MOE, (1,), "dp"), (MOE, (4,), "moe"),
                                              (dataclasses.replace(CFG, scan_layers=False), (2, 2), "megatron")],
                         ids=["moe-1", "moe-4", "unrolled-dense-2x2"])
def test_unrolled_blocks_rematerialised_one_by_one_step_as_without_and_hold_less(cfg, shape, preset):
    """Unrolled layers (MoE models run so) remat block by block: the same step to rounding as without remat,
    on every rank against the reference step, and a lower peak."""
    tokens, labels = batch(cfg)
    plain, full = (build(dataclasses.replace(cfg, remat=r), shape, preset, donate=True) for r in ("none", "full"))
    state = plain.init(0)
    (want_state, want_loss), (got_state, got_loss) = (ts.reference_step(state, tokens, labels) for ts in (plain, full))
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    for got, want in zip(pytree.flatten(got_state)[0], pytree.flatten(want_state)[0]):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
    batch_ = {"tokens": tokens, "labels": labels}
    for outs in run_everywhere(full.program, state["params"], state["opt_state"], batch_):
        assert float(outs[-1]) == pytest.approx(want_loss, rel=1e-10)
    assert full.program.peak_bytes() < plain.program.peak_bytes()


def all_to_alls(program) -> tuple[int, float]:
    sent = [c for c in program.comm_summary() if c["kind"].startswith("all_to_all")]
    return len(sent), sum(c["wire_bytes"] for c in sent)


def test_full_remat_that_saves_the_all_to_alls_sends_none_twice_and_steps_as_without():
    """remat="full_save_all_to_all": each block recomputed, but an MoE layer's two all-to-all results are saved
    (``checkpoint_name`` + ``save_only_these_names``): the step sends the plain step's 4 all-to-alls per MoE
    layer where "full" sends 6 (its recomputed forward's two again), and is the same step to rounding, on
    every rank (experts 8: the partitioner moves the tokens, not the dispatch mask, as at GShard's size)."""
    cfg = dataclasses.replace(MOE, experts=8, capacity_factor=2.0)
    tokens, labels = batch(cfg)
    steps = {r: build(dataclasses.replace(cfg, remat=r), (4,), "moe", donate=True)
             for r in ("none", "full", "full_save_all_to_all")}
    sent = {r: all_to_alls(ts.program) for r, ts in steps.items()}
    moe_layers = cfg.layers // cfg.moe_every
    assert sent["full_save_all_to_all"] == sent["none"] and sent["none"][0] == 4 * moe_layers, sent
    assert sent["full"][0] == 6 * moe_layers and sent["full"][1] == 1.5 * sent["none"][1], sent
    saved = steps["full_save_all_to_all"]
    state = saved.init(0)
    want_state, want_loss = steps["none"].reference_step(state, tokens, labels)
    got_state, got_loss = saved.reference_step(state, tokens, labels)
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    for got, want in zip(pytree.flatten(got_state)[0], pytree.flatten(want_state)[0]):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
    for outs in run_everywhere(saved.program, state["params"], state["opt_state"], {"tokens": tokens,
                                                                                     "labels": labels}):
        assert float(outs[-1]) == pytest.approx(want_loss, rel=1e-10)


LAYOUT_CASES = [  # the unrolled config, (saver mesh, preset), (loader mesh, preset)
    (dataclasses.replace(CFG, layers=3, scan_layers=False), ((2, 2), "megatron_wus"), ((4,), "wus")),
    (dataclasses.replace(CFG, layers=4, scan_layers=False, moe_every=2, experts=4), ((4,), "moe"), ((2, 2), "moe")),
]


@pytest.mark.parametrize("saved_scanned", [False, True], ids=["unrolled->stacked", "stacked->unrolled"])
@pytest.mark.parametrize("unrolled, saving, loading", LAYOUT_CASES, ids=["dense", "moe-groups"])
def test_checkpoints_load_across_the_stacked_and_unrolled_layouts(tmp_path, saved_scanned, unrolled, saving, loading):
    """The stacked layout is a view of the same parameters: a checkpoint saved in one layout (and on one
    mesh) loads into the other, every rank's blocks equal to its blocks of the same state in that layout (MoE:
    block r of group g is unrolled layer g * moe_every + r)."""
    scanned = dataclasses.replace(unrolled, scan_layers=True)
    saver = build(scanned if saved_scanned else unrolled, *saving)
    loader = build(unrolled if saved_scanned else scanned, *loading)
    rng = np.random.default_rng(3)  # optimizer state too, so m and v differ from the weights
    state = sr.pytree.tree_map(lambda v: (v + rng.standard_normal(np.shape(v))).astype(v.dtype), saver.init(0))
    path = str(tmp_path / "ckpt")

    def body(comm):
        saver.save(path, saver.shard_state(state, comm.Get_rank()), step=1, comm=comm)
        return loader.named(loader.load(path, comm=comm))
    saved = saver.named(state)
    k = unrolled.moe_every or 1
    stack = (lambda r: f"layers{r}_") if unrolled.moe_every else (lambda r: "layers_")

    def in_loader_layout(name):  # the same tensor, read from the saved state by hand
        if name in saved:
            return saved[name]
        grouped = re.search(r"\.layers(\d*)_", name)
        if grouped:
            r = int(grouped.group(1) or 0)
            return np.stack([saved[name.replace(grouped.group(0), f".l{i}_")] for i in range(r, unrolled.layers, k)])
        i = int(re.search(r"\.l(\d+)_", name).group(1))
        return saved[re.sub(r"\.l\d+_", "." + stack(i % k), name)][i // k]
    assert any("layers" in n for n in loader.state_names + saver.state_names) and len(loader.state_names) > 20
    ios = {io.name: io for io in loader.program.inputs}
    for rank, blocks in enumerate(run_simulated(4, body)):
        assert list(blocks) == loader.state_names
        for name, got in blocks.items():
            want = shard(np.asarray(in_loader_layout(name)), ios[name].sharding, loader.mesh, rank)
            np.testing.assert_array_equal(got, want, err_msg=name)
