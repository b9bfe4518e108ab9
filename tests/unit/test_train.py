"""Training in the in-process simulated world: the partitioned training step of the Transformer LM
matches the unpartitioned reference (``sr.evaluate`` of the same traced step) for every preset on
meshes (1), (2), (4), (2,2), (2,4); weight-update sharding holds 1/n of the optimizer state per rank
and moves exactly the data-parallel gradient bytes (reduce-scatter + all-gather = all-reduce);
checkpoints restore across meshes and resume the same loss curve; plus the model, optimizers,
layouts and data on their own.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import pytree
from spmd_runtime.comm import run_simulated
from spmd_runtime.data import ALPHABET, DICKENS, batches, corpus, decode, encode
from spmd_runtime.models.lm import LMConfig, init_params, layer_views, lm_loss, param_shapes
from spmd_runtime.optim import SGD, AdamW
from spmd_runtime.train import PRESETS, build_train_step, train_mesh, update_spec

from simulated import train_simulated

CFG = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
OPT = AdamW(lr=1e-2, weight_decay=0.1, warmup=3)
SHAPES = [(1,), (2,), (4,), (2, 2), (2, 4)]
N_PARAMS = len(param_shapes(CFG))


def feed(n, cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)), rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)))
            for _ in range(n)]


def reference(ts, state, batches_):
    losses = []
    for x, y in batches_:
        state, loss = ts.reference_step(state, x, y)
        losses.append(loss)
    return state, losses


_steps: dict = {}


def step_for(shape, preset, cfg=CFG, optimizer=OPT):
    key = (shape, preset, cfg, optimizer)
    if key not in _steps:
        _steps[key] = build_train_step(cfg, train_mesh(shape, preset), preset, optimizer)
    return _steps[key]


def assert_state_close(got, want, rtol=1e-9, atol=1e-12):
    got, want = pytree.named_leaves(got), pytree.named_leaves(want)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


# ---------------------------------------------------------------- the partitioned step vs the reference
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not PRESETS[p].stage))  # pipelines: test_pipeline*.py
def test_two_steps_match_the_unpartitioned_reference(preset, shape):
    ts = step_for(shape, preset)
    state = ts.init(seed=3)
    data = feed(2)
    want, want_losses = reference(ts, state, data)
    got, losses = train_simulated(ts, state, data)
    assert_state_close(got, want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    assert not any(np.array_equal(got["params"][n], state["params"][n]) for n in ts.param_names), \
        "every parameter must move"


def test_outputs_are_laid_out_like_inputs_so_the_step_iterates_on_local_shards():
    ts = step_for((2, 4), "megatron_wus")
    ins, outs = ts.program.inputs, ts.program.outputs
    assert len(outs) == len(ins) - 1  # tokens and labels in, loss out
    for i, o in zip(ins[:-2], outs[:-1]):
        assert (o.shape, o.dtype, o.sharding) == (i.shape, i.dtype, i.sharding), i.name
    assert outs[-1].shape == () and outs[-1].sharding.is_replicated


def test_uneven_batch_and_vocab_splits_match_the_reference():
    cfg = LMConfig(layers=1, d=12, heads=3, ffn=20, vocab=10, seq=6, batch=5, dtype="float64")
    data = feed(2, cfg)
    for shape, preset in (((3,), "dp"), ((2, 3), "megatron_wus"), ((4,), "seq")):
        ts = step_for(shape, preset, cfg)
        state = ts.init(seed=1)
        want, want_losses = reference(ts, state, data)
        got, losses = train_simulated(ts, state, data)
        assert_state_close(got, want)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-12)


@pytest.mark.parametrize("tied,embedding,optimizer", [(True, "take", OPT), (False, "onehot", SGD(lr=0.1))])
def test_tied_embedding_one_hot_lookup_and_sgd_match_the_reference(tied, embedding, optimizer):
    cfg = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, tied=tied, dtype="float64",
                   embedding=embedding)
    ts = step_for((2, 4), "megatron_wus", cfg, optimizer)
    state = ts.init(seed=2)
    want, _ = reference(ts, state, feed(2, cfg))
    got, _ = train_simulated(ts, state, feed(2, cfg))
    assert_state_close(got, want)


# ---------------------------------------------------------------- weight-update sharding
def local_bytes(io, mesh):
    return math.prod(io.sharding.local_shape(io.shape, mesh)) * np.dtype(io.dtype).itemsize


def test_wus_holds_one_eighth_of_the_optimizer_state_per_rank():
    ts = step_for((8,), "wus")
    state = [io for io in ts.program.inputs[N_PARAMS:-2]]
    counter = [io for io in state if io.name == "opt_state.step"]
    moments = [io for io in state if io.name != "opt_state.step"]
    assert len(counter) == 1 and counter[0].shape == () and len(moments) == 2 * N_PARAMS
    total = sum(math.prod(io.shape) * np.dtype(io.dtype).itemsize for io in moments)
    held = sum(local_bytes(io, ts.mesh) for io in moments)
    assert held * 8 == total
    for io in moments:
        assert io.sharding.axes == ("data",), f"{io.name} must be split over the data axis; got {io.sharding}"
    assert ts.memory_report()["opt_state"] == held + 4  # plus the float32 step counter, replicated
    dp = step_for((8,), "dp")
    assert dp.memory_report()["opt_state"] == total + 4


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["8", "2x4"])
def test_wus_reduce_scatters_gradients_all_gathers_weights_and_moves_the_dp_bytes(shape):
    wus, dp = step_for(shape, "wus"), step_for(shape, "dp")
    axes = wus.mesh.axis_names
    dp_comm, wus_comm = dp.program.comm_summary(), wus.program.comm_summary()
    assert [(c["kind"], c["axes"]) for c in dp_comm] == [("all_reduce", axes)] * (N_PARAMS + 1)  # grads + loss
    kinds = [(c["kind"], c["axes"]) for c in wus_comm]
    assert kinds.count(("reduce_scatter", axes)) == N_PARAMS
    assert kinds.count(("all_gather", axes)) == N_PARAMS
    assert kinds.count(("all_reduce", axes)) == 1 and len(kinds) == 2 * N_PARAMS + 1  # only the loss
    param_bytes = sum(math.prod(io.shape) * 8 for io in wus.program.inputs[:N_PARAMS])
    assert sum(c["bytes_in"] for c in wus_comm if c["kind"] == "reduce_scatter") == param_bytes
    assert sum(c["bytes_out"] for c in wus_comm if c["kind"] == "all_gather") == param_bytes
    # each new weight comes straight out of an all-gather (its done, where the scheduler split it)
    producer = {ins.out: ins.op for ins in wus.program.instrs}
    assert all(producer[o.slot] in ("all_gather", "all_gather_done") for o in wus.program.outputs[:N_PARAMS])
    # all-reduce 2(n-1)/n S == reduce-scatter (n-1)/n S + all-gather (n-1)/n S
    assert wus.program.wire_bytes == pytest.approx(dp.program.wire_bytes, rel=1e-12)
    assert wus.program.wire_bytes > 0


def test_megatron_wus_shards_the_update_over_data_inside_each_model_block():
    ts = step_for((2, 4), "megatron_wus")
    spec = {io.name: io.sharding for io in ts.program.inputs}
    # stacked layers (the default): the layer dim is never split, the update goes on the dims after it
    m = spec["opt_state.m.layers_wq"]
    assert spec["params.layers_wq"].dims == ((), (), ("model",)) and m.dims == ((), ("data",), ("model",))
    # the outermost dim that divides (vocab, split over model already): data minor to model there
    assert spec["params.embed"].dims == (("model",), ()) and spec["opt_state.v.embed"].dims == (("model", "data"), ())
    assert spec["params.layers_ln1_g"].is_replicated and spec["opt_state.m.layers_ln1_g"].dims == ((), ("data",))
    kinds = {(c["kind"], c["axes"]) for c in ts.program.comm_summary()}
    assert ("reduce_scatter", ("data",)) in kinds and ("all_gather", ("data",)) in kinds
    assert ("all_reduce", ("model",)) in kinds  # Megatron's activation all-reduces
    assert all(c["axes"] in (("data",), ("model",)) for c in ts.program.comm_summary())


def test_comm_summaries_of_the_presets():
    def kinds(ts):
        return {(g["kind"], g["axes"]): g["count"] for g in ts.comm_summary()}
    both = ("data", "model")
    assert kinds(step_for((2, 4), "dp")) == {("all_reduce", both): N_PARAMS + 1}
    mega = kinds(step_for((2, 4), "megatron"))
    assert mega[("all_reduce", ("data",))] == N_PARAMS + 1 and mega[("all_reduce", ("model",))] >= 2
    assert set(mega) <= {("all_reduce", ("data",)), ("all_reduce", ("model",)), ("all_gather", ("model",))}
    seq = kinds(step_for((8,), "seq"))
    # keys and values are gathered along the sequence (2 per layer; the scanned layers' backward loop gathers
    # them again from the saved sequence shards: 2 more) and their gradients reduce-scattered; the positional
    # table's rows are used only where their positions are, so its gradient is gathered
    assert CFG.scanned
    assert seq == {("all_gather", ("data",)): 4 * CFG.layers + 1, ("reduce_scatter", ("data",)): 2 * CFG.layers,
                   ("all_reduce", ("data",)): N_PARAMS}


# ---------------------------------------------------------------- checkpoints
def save_simulated(ts, state, path, step):
    run_simulated(ts.mesh.size, lambda comm: ts.save(path, ts.shard_state(state, comm.Get_rank()), step, comm))


def load_simulated(ts, path):
    return run_simulated(ts.mesh.size, lambda comm: ts.gather(ts.load(path, comm), comm))[0]


def test_checkpoint_saved_on_2x4_restores_identically_on_4_and_1(tmp_path):
    src = step_for((2, 4), "megatron_wus")
    state, _ = train_simulated(src, src.init(seed=4), feed(1))
    save_simulated(src, state, tmp_path / "ckpt", step=1)
    assert sr.checkpoint_info(tmp_path / "ckpt")["step"] == 1
    for shape, preset in (((4,), "wus"), ((1,), "dp")):
        restored = load_simulated(step_for(shape, preset), tmp_path / "ckpt")
        assert_state_close(restored, state, rtol=0, atol=0)


def test_training_resumed_from_a_checkpoint_continues_the_same_loss_curve(tmp_path):
    data = feed(3, seed=5)
    first = step_for((2, 4), "megatron_wus")
    start = first.init(seed=5)
    _, straight = train_simulated(first, start, data)
    state, head = train_simulated(first, start, data[:1])
    save_simulated(first, state, tmp_path / "ckpt", step=1)
    second = step_for((4,), "wus")  # another mesh and another sharding
    resumed = run_simulated(4, lambda comm: _steps_from_checkpoint(second, tmp_path / "ckpt", data[1:], comm))[0]
    np.testing.assert_allclose(head + resumed, straight, rtol=1e-12)


def _steps_from_checkpoint(ts, path, batches_, comm):
    local, losses = ts.load(path, comm), []
    for x, y in batches_:
        local, loss = ts.step(local, x, y, comm=comm)
        losses.append(loss)
    return losses


# ---------------------------------------------------------------- memory report
def test_memory_report_splits_the_peak_into_held_state_and_temporaries():
    ts = step_for((2, 4), "megatron_wus")
    mem = ts.memory_report()
    assert mem["peak"] == ts.program.peak_bytes()
    assert mem["params"] + mem["opt_state"] + mem["batch"] + mem["activations"] == mem["peak"]
    assert mem["params"] < mem["params_global"] and mem["batch"] * 2 == mem["batch_global"]
    assert mem["activations"] > 0


# ---------------------------------------------------------------- layouts
def test_update_spec_picks_the_outermost_dim_that_divides_and_keeps_existing_axes_major():
    mesh = train_mesh((2, 4))
    assert update_spec((24, 16), (None, None), ("data",), mesh) == (("data",), None)
    assert update_spec((16, 24), (None, None), ("data",), mesh) == (("data",), None)  # contiguous blocks
    assert update_spec((7, 16), (None, None), ("data", "model"), mesh) == (None, ("data", "model"))
    assert update_spec((7, 5), (None, None), ("data",), mesh) == (None, None)  # nothing divides: unsharded
    assert update_spec((96, 16), (("model",), None), ("data",), mesh) == (("model", "data"), None)
    assert update_spec((20, 16), (("model",), None), ("data",), mesh) == (("model",), ("data",))  # 20/4 odd
    assert update_spec((8, 6, 4), (None, None, None), ("data",), mesh, first_dim=1) == (None, ("data",), None)
    assert update_spec((24, 16), (None, None), (), mesh) == (None, None)


def test_presets_drop_the_axes_a_mesh_lacks():
    assert train_mesh((4,), "megatron").axis_names == ("model",)
    assert train_mesh((4,), "wus").axis_names == ("data",)
    assert train_mesh((2, 2)).axis_names == ("data", "model")
    on = PRESETS["megatron_wus"].on(train_mesh((4,), "megatron_wus"))
    assert (on.batch, on.model, on.update) == (("data",), (), ("data",))
    with pytest.raises(ValueError, match="preset must be one of"):
        build_train_step(CFG, train_mesh((2,)), "zero3")


@pytest.mark.parametrize("preset", ["fsdp", "fsdp_megatron"])
def test_fsdp_over_scanned_layers_refuses_micro_batches_it_would_drop(preset):
    """FSDP's scanned layers gather each layer's weights once for the whole batch: asked for micro-batches, the
    step refuses (it used to run the whole batch, silently), and unrolled layers accumulate them."""
    scanned = dataclasses.replace(CFG, scan_layers=True)
    with pytest.raises(ValueError, match=rf"preset '{preset}' .* does not accumulate micro-batches; "
                                         r"got microbatches=2\. Use microbatches=1, or LMConfig\(scan_layers=False\)"):
        build_train_step(scanned, train_mesh((2,), preset), preset, microbatches=2)
    build_train_step(dataclasses.replace(CFG, scan_layers=False), train_mesh((2,), preset), preset,
                     microbatches=2)


# ---------------------------------------------------------------- model
def numpy_loss(cfg, p, tokens, labels):
    def ln(x, g, b):
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    x = p["embed"][tokens] + p["pos"]
    b, s, d = x.shape
    h, hd = cfg.heads, d // cfg.heads
    for i in range(cfg.layers):
        w = {k: p[f"l{i}_{k}"] if f"l{i}_{k}" in p else p[f"layers_{k}"][i]  # unrolled or stacked layers
             for k in ("ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "ln2_g", "ln2_b", "w1", "w2")}
        a = ln(x, w["ln1_g"], w["ln1_b"])
        q, k, v = ((a @ w[n]).reshape(b, s, h, hd) for n in ("wq", "wk", "wv"))
        scores = np.where(np.tril(np.ones((s, s), bool)), np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d) @ w["wo"]
        x = x + gelu(ln(x, w["ln2_g"], w["ln2_b"]) @ w["w1"]) @ w["w2"]
    z = ln(x, p["lnf_g"], p["lnf_b"]) @ (p["embed"].T if cfg.tied else p["unembed"])
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1).mean()


@pytest.mark.parametrize("tied,embedding", [(False, "auto"), (True, "onehot")])
def test_lm_loss_matches_numpy(tied, embedding):
    cfg = LMConfig(layers=2, d=16, heads=2, ffn=24, vocab=20, seq=6, batch=3, tied=tied, dtype="float64",
                   embedding=embedding)
    params = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    params = OrderedDict((k, v + 0.1 * rng.standard_normal(v.shape)) for k, v in params.items())  # gains != 1
    tokens, labels = (rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32) for _ in range(2))
    graph = sr.trace(lambda *a: lm_loss(cfg, a[:-2], a[-2], a[-1]), *params.values(), tokens, labels)
    got = sr.evaluate(graph, *params.values(), tokens, labels)[0]
    assert got == pytest.approx(numpy_loss(cfg, params, tokens, labels), rel=1e-12)


def test_init_params_are_deterministic_and_the_initial_loss_is_near_uniform():
    a, b = init_params(CFG, 7), init_params(CFG, 7)
    assert list(a) == list(param_shapes(CFG)) and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed"], init_params(CFG, 8)["embed"])
    x, y = feed(1)[0]
    assert numpy_loss(CFG, a, x, y) == pytest.approx(math.log(CFG.vocab), abs=0.05)


def test_config_errors_state_the_rule():
    with pytest.raises(ValueError, match="d to be a multiple of heads; got d=10, heads=4"):
        LMConfig(d=10, heads=4)
    with pytest.raises(ValueError, match="dtype must be one of .*; got .int32."):
        LMConfig(dtype="int32")


# ---------------------------------------------------------------- optimizers
def run_update(opt, params, grads, state):
    """One traced update on dicts (params, grads) and the state tree; returns (new params, new state)."""
    graph = sr.trace(opt.update, params, grads, state)
    return graph.out_tree.unflatten(sr.evaluate(graph, *pytree.flatten((params, grads, state))[0]))


def test_adamw_matches_its_formula_for_two_steps():
    rng = np.random.default_rng(0)
    opt = AdamW(lr=0.01, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.5, warmup=4)
    params = {"w": rng.standard_normal((3, 4)), "g": rng.standard_normal(4)}
    state = opt.init_state(params)
    assert sorted(state) == ["m", "step", "v"] and sorted(state["m"]) == sorted(state["v"]) == ["g", "w"]
    assert state["step"].dtype == np.float32 and state["step"].shape == ()
    p, m, v = dict(params), {k: np.zeros_like(x) for k, x in params.items()}, {k: 0 * x for k, x in params.items()}
    for t in (1, 2):
        grads = {k: rng.standard_normal(x.shape) for k, x in params.items()}
        params, state = run_update(opt, params, grads, state)
        lr = 0.01 * min(t / 4, 1.0)
        for i in ("w", "g"):
            m[i] = 0.8 * m[i] + 0.2 * grads[i]
            v[i] = 0.9 * v[i] + 0.1 * grads[i] ** 2
            step = (m[i] / (1 - 0.8 ** t)) / (np.sqrt(v[i] / (1 - 0.9 ** t)) + 1e-6)
            p[i] = p[i] - lr * (step + (0.5 * p[i] if p[i].ndim >= 2 else 0.0))  # gains/biases not decayed
            np.testing.assert_allclose(params[i], p[i], rtol=1e-12)
            np.testing.assert_allclose(state["m"][i], m[i], rtol=1e-12)
        assert float(state["step"]) == t


def test_sgd_momentum_matches_its_formula():
    opt = SGD(lr=0.1, momentum=0.5)
    params, grads = {"w": np.array([1.0, 2.0])}, {"w": np.array([0.5, -1.0])}
    state = opt.init_state(params)
    params, state = run_update(opt, params, grads, state)
    params, state = run_update(opt, params, grads, state)
    np.testing.assert_allclose(state["mom"]["w"], [0.75, -1.5])  # 0.5 * g + g
    np.testing.assert_allclose(params["w"], [1.0 - 0.1 * 0.5 - 0.1 * 0.75, 2.0 + 0.1 + 0.15])


# ---------------------------------------------------------------- data
def test_corpus_is_deterministic_and_round_trips_through_the_alphabet():
    text = corpus(100)
    assert text == corpus(100) and text.startswith(DICKENS) and len(text) > 2000
    ids = encode(text)
    assert ids.dtype == np.int32 and ids.max() < len(ALPHABET) and decode(ids) == text
    with pytest.raises(ValueError, match="characters of ALPHABET"):
        encode("naïve")


def test_batches_are_next_character_windows_identical_for_a_seed():
    ids = encode(corpus(50))
    a, b = batches(ids, 4, 16, seed=3), batches(ids, 4, 16, seed=3)
    for _ in range(3):
        (x, y), (x2, y2) = next(a), next(b)
        assert x.shape == y.shape == (4, 16) and np.array_equal(x, x2) and np.array_equal(y, y2)
        assert np.array_equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            start = int(np.flatnonzero([np.array_equal(ids[s:s + 16], row_x) for s in range(len(ids) - 16)])[0])
            assert ids[start + 16] == row_y[-1]


# ---------------------------------------------------------------- checkpoints from before state pytrees
FLAT_CKPT = __import__("pathlib").Path(__file__).parents[1] / "data" / "flat_names_checkpoint"


@pytest.mark.parametrize("shape,preset", [((1,), "dp"), ((2, 2), "megatron_wus")], ids=["1", "2x2"])
def test_a_checkpoint_with_flat_names_from_before_state_trees_loads(shape, preset):
    """tests/data/flat_names_checkpoint was written by the code before parameter dicts (tensors 'embed',
    'm_embed', 'v_embed', 'step'; 2 ranks, wus, AdamW(lr=1e-2)) after one step from init(seed=3) on the batch
    below: it loads onto the state tree, each slot where the same step puts it now."""
    cfg = LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
    stored = sr.checkpoint_info(FLAT_CKPT)["tensors"]
    assert {"embed", "m_embed", "v_embed", "step"} <= set(stored) and not any("." in n for n in stored)
    ts = step_for(shape, preset, cfg, AdamW(lr=1e-2))
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))
    want, _ = ts.reference_step(ts.init(seed=3), x, y)
    got = load_simulated(ts, FLAT_CKPT)
    assert float(got["opt_state"]["step"]) == 1.0
    assert_state_close(got, want, rtol=1e-5, atol=1e-7)  # float32, reduced in another order
    # its layers are unrolled (l0_wq, m_l0_wq, ...); the scanned model reads them through stacking views
    legacy = set(ts.legacy_names().values())
    views = layer_views(cfg, legacy)
    assert views and {n for n in legacy if n not in views} | {p for n in views for p in views[n].parts} == set(stored)


def test_a_trace_error_on_rank_0_is_one_agreed_error_on_every_rank(monkeypatch):
    """build_train_step_on_root traces on rank 0 only: its failure must not leave the other ranks waiting."""
    from spmd_runtime import train
    monkeypatch.setattr(train.step, "lm_loss_and_metrics", lambda cfg, ps, *rest: float(ps[0]))  # float() on a Tensor
    cfg = LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)

    def body(comm):
        with pytest.raises(sr.AgreedError, match=r"tracing and partitioning the training step on rank 0 must "
                                                 r"succeed on every rank; got errors on rank\(s\) \[0\]: "
                                                 r"TypeError: float\(\) needs values") as got:
            train.build_train_step_on_root(cfg, train_mesh((2,), "dp"), "dp", SGD(lr=0.1), comm)
        return got.value.ranks
    assert run_simulated(2, body) == [[0], [0]]
