"""models/gpt2.py (nanoGPT's GPT-2 on the public API) against an independent NumPy GPT-2 (tests/gpt2_reference.py):
logits, loss and every gradient at 1 and 4 simulated ranks under dp, megatron and fsdp; dropout masks the same
on every mesh and sharding for one key; KV-cache decode giving the tokens of argmax over the uncached forward."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gpt2_reference as ref
import spmd_runtime as sr
import spmd_runtime.random as srandom
from spmd_runtime.comm import run_simulated
from spmd_runtime.models import gpt2
from spmd_runtime.models.roles import ParamRole
from spmd_runtime.train import PRESETS, param_layout, train_mesh

# vocab 62 splits unevenly over 4 ranks (megatron splits the tied embedding's vocab)
CFG = gpt2.GPTConfig(block_size=12, vocab_size=62, n_layer=2, n_head=4, n_embd=16)
NOBIAS_TANH = gpt2.GPTConfig(block_size=12, vocab_size=62, n_layer=2, n_head=4, n_embd=16, bias=False,
                             gelu_approximate=True)
MESHES = [("dp", (1,)), ("dp", (4,)), ("megatron", (4,)), ("megatron", (2, 2)), ("fsdp", (2, 2))]
VOCAB64 = dataclasses.replace(CFG, vocab_size=64)  # splits over 4 ranks: fsdp's vocab-parallel tied head
# every mesh with biases and exact GELU; without biases, with tanh GELU, at 1 rank and on the 2x2 megatron mesh
CASES = [(CFG,) + m for m in MESHES] + [(NOBIAS_TANH,) + m for m in (MESHES[0], MESHES[3])] + [
    (VOCAB64, "fsdp", (2, 2)), (VOCAB64, "fsdp", (4,))]
CASE_IDS = [f"{'bias' if c.bias else 'nobias'}-v{c.vocab_size}-{p}-{'x'.join(map(str, s))}" for c, p, s in CASES]


def _batch(cfg, b=4, t=8, seed=1):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (b, t)).astype("int32")
    targets = rng.integers(0, cfg.vocab_size, (b, t)).astype("int32")
    targets[0, :2] = -1  # nanoGPT's ignore_index
    return idx, targets


def _perturbed(cfg, seed=0, dtype="float32"):
    """nanoGPT's init, with LayerNorms and biases moved off 1 / 0 so their gradients are not special."""
    rng = np.random.default_rng(seed + 100)
    return {n: (w + (rng.normal(0, 0.1, w.shape) if w.ndim == 1 else 0)).astype(dtype)
            for n, w in gpt2.init_params(cfg, seed, dtype).items()}


def on_mesh(preset_name, shape, fn, params, *batch):
    """Every simulated rank runs ``sr.jit(fn)(params, *batch)`` with the parameters laid out by the preset from
    the model's roles (``param_layout``; fsdp gathers each weight where used) and the batch split on the preset's
    batch axes; returns rank 0's outputs as NumPy after checking every rank got the same."""
    mesh = train_mesh(shape, preset_name)
    preset = PRESETS[preset_name].on(mesh)
    layout = param_layout({n: w.shape for n, w in params.items()}, {n: gpt2.param_role(n) for n in params}, mesh,
                          preset)

    def used(p):
        return {n: w if layout.use[n] == layout.held[n] else
                sr.mesh_split(w, mesh, layout.use[n], grad_spec=layout.held[n]) for n, w in p.items()}
    specs = ({n: sr.P(*layout.held[n]) for n in params},) + tuple(sr.P(preset.batch or None) for _ in batch)
    held = layout.hold(params)  # c_attn as its (3, d, ...) view, split over heads within the q, k, v blocks

    def body(comm):
        out = sr.jit(lambda p, *b: fn(used(p), *b), mesh=mesh, in_specs=specs, comm=comm)(held, *batch)
        return sr.pytree.tree_map(np.asarray, out)
    results = run_simulated(mesh.size, body)
    for got in results[1:]:
        for a, b in zip(sr.pytree.flatten(got)[0], sr.pytree.flatten(results[0])[0]):
            np.testing.assert_array_equal(a, b)
    return results[0]


# ================================================================ parameters
def test_parameters_are_nanogpts_names_shapes_and_init():
    cfg = gpt2.GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=4)
    d = 4
    assert dict(gpt2.param_shapes(cfg)) == {
        "transformer.wte.weight": (10, d), "transformer.wpe.weight": (8, d),
        "transformer.h.0.ln_1.weight": (d,), "transformer.h.0.ln_1.bias": (d,),
        "transformer.h.0.attn.c_attn.weight": (3 * d, d), "transformer.h.0.attn.c_attn.bias": (3 * d,),
        "transformer.h.0.attn.c_proj.weight": (d, d), "transformer.h.0.attn.c_proj.bias": (d,),
        "transformer.h.0.ln_2.weight": (d,), "transformer.h.0.ln_2.bias": (d,),
        "transformer.h.0.mlp.c_fc.weight": (4 * d, d), "transformer.h.0.mlp.c_fc.bias": (4 * d,),
        "transformer.h.0.mlp.c_proj.weight": (d, 4 * d), "transformer.h.0.mlp.c_proj.bias": (d,),
        "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    nobias = gpt2.param_shapes(gpt2.GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=4, bias=False))
    assert not [n for n in nobias if n.endswith(".bias")] and len(nobias) == 9
    assert gpt2.TIED == {"lm_head.weight": "transformer.wte.weight"}
    big = gpt2.init_params(gpt2.GPTConfig(block_size=64, vocab_size=512, n_layer=8, n_head=4, n_embd=64))
    assert abs(big["transformer.wte.weight"].std() - 0.02) < 1e-3
    assert abs(big["transformer.h.3.mlp.c_fc.weight"].std() - 0.02) < 1e-3
    assert abs(big["transformer.h.3.mlp.c_proj.weight"].std() - 0.02 / 4) < 2e-4  # 0.02 / sqrt(2 * 8)
    assert not big["transformer.h.0.attn.c_attn.bias"].any() and (big["transformer.ln_f.weight"] == 1).all()
    assert all(w.dtype == np.float32 for w in big.values())


def test_megatron_splits_heads_hidden_and_vocab_by_role():
    mesh = train_mesh((2, 2), "megatron")
    layout = param_layout(gpt2.param_shapes(CFG), gpt2.param_roles(CFG), mesh, PRESETS["megatron"])
    h, M = "transformer.h.1.", ("model",)
    assert layout.held["transformer.wte.weight"] == (M, None)
    assert layout.held["transformer.wpe.weight"] == (None, None)
    # c_attn's q, k and v blocks each split over heads: held as (3, d, d) and (3, d), split within the blocks
    assert layout.held[h + "attn.c_attn.weight"] == (None, M, None) and layout.held[h + "attn.c_attn.bias"] == (None, M)
    assert layout.held_shapes[h + "attn.c_attn.weight"] == (3, 16, 16) and layout.shapes[h + "attn.c_attn.bias"] == (48,)
    assert layout.held[h + "mlp.c_fc.weight"] == (M, None)
    assert layout.held[h + "attn.c_proj.weight"] == (None, M) and layout.held[h + "mlp.c_proj.bias"] == (None,)
    assert layout.held[h + "ln_2.weight"] == (None,)
    fsdp = param_layout(gpt2.param_shapes(CFG), gpt2.param_roles(CFG), mesh, PRESETS["fsdp"])
    assert fsdp.use[h + "mlp.c_fc.weight"] == (None, None)
    assert fsdp.held[h + "mlp.c_fc.weight"] == (("data", "model"), None)  # sharded between steps, gathered for use
    with pytest.raises(ValueError, match="needs a sharding role for every parameter"):
        param_layout({"w": (2, 2)}, {}, mesh, PRESETS["dp"])


def test_fsdp_uses_the_tied_embedding_in_its_vocab_split():
    """The tied embedding is vocab_parallel: FSDP uses it as held (split on the vocab), so the lookup and the
    head's logits run vocab-parallel; the other weights are gathered where used."""
    mesh = train_mesh((2, 2), "fsdp")
    fsdp = param_layout(gpt2.param_shapes(VOCAB64), gpt2.param_roles(VOCAB64), mesh, PRESETS["fsdp"])
    wte, c_fc = "transformer.wte.weight", "transformer.h.1.mlp.c_fc.weight"
    assert fsdp.held[wte] == (("data", "model"), None) and fsdp.use[wte] == fsdp.held[wte]
    assert fsdp.use[c_fc] == (None, None) != fsdp.held[c_fc]
    assert fsdp.use["transformer.wpe.weight"] == (None, None)
    odd = param_layout(gpt2.param_shapes(CFG), gpt2.param_roles(CFG), mesh, PRESETS["fsdp"])  # 62 splits no 4 ways
    assert odd.held[wte] == (None, ("data", "model")) and odd.use[wte] == (None, None)  # held on d: gathered


# ================================================================ forward and gradients
@pytest.mark.parametrize("cfg, preset, shape", CASES, ids=CASE_IDS)
def test_logits_and_loss_equal_numpy(cfg, preset, shape):
    params, (idx, targets) = _perturbed(cfg), _batch(cfg)
    got_logits, got_loss = on_mesh(preset, shape, lambda p, i, t: gpt2.forward(cfg, p, i, t), params, idx, targets)
    np.testing.assert_allclose(got_logits, ref.logits(cfg, params, idx), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_loss, ref.loss(cfg, params, idx, targets), rtol=2e-6)
    assert got_logits.dtype == np.float32 and got_loss.dtype == np.float32
    last, none = on_mesh(preset, shape, lambda p, i: gpt2.forward(cfg, p, i), params, idx)
    assert none is None and last.shape == (4, 1, cfg.vocab_size)  # nanoGPT's inference path: x[:, [-1], :]
    np.testing.assert_allclose(last[:, 0], ref.logits(cfg, params, idx)[:, -1], rtol=2e-5, atol=2e-5)


@pytest.fixture
def x64():
    sr.config.update("enable_x64", True)
    try:
        yield
    finally:
        sr.config.update("enable_x64", False)


_DERIVATIVES = {}


def _reference_derivatives(cfg):
    """Directional derivatives of the NumPy loss along one random direction per parameter (cached per config)."""
    if cfg not in _DERIVATIVES:
        params, (idx, targets) = _perturbed(cfg, dtype="float64"), _batch(cfg)
        rng = np.random.default_rng(7)
        directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
        _DERIVATIVES[cfg] = directions, ref.directional_derivatives(cfg, params, idx, targets, directions)
    return _DERIVATIVES[cfg]


@pytest.mark.parametrize("cfg, preset, shape", CASES, ids=CASE_IDS)
def test_every_gradient_equals_numpy_finite_differences(cfg, preset, shape, x64):
    params, (idx, targets) = _perturbed(cfg, dtype="float64"), _batch(cfg)
    directions, want = _reference_derivatives(cfg)
    value, grads = on_mesh(preset, shape, lambda p, i, t: sr.value_and_grad(
        lambda q: gpt2.loss(cfg, q, i, t))(p), params, idx, targets)
    assert value.dtype == np.float64 and set(grads) == set(params)
    np.testing.assert_allclose(value, ref.loss(cfg, params, idx, targets), rtol=1e-12)
    for name, g in grads.items():
        assert g.shape == gpt2.param_role(name).held_shape(params[name].shape)
        g = np.reshape(g, params[name].shape)
        np.testing.assert_allclose(np.vdot(g, directions[name]), want[name], rtol=1e-6, atol=1e-9, err_msg=name)


# ================================================================ dropout
DROP = gpt2.GPTConfig(block_size=12, vocab_size=62, n_layer=2, n_head=4, n_embd=16, dropout=0.25)


@pytest.mark.parametrize("preset, shape", [("dp", (2,)), ("dp", (4,)), ("megatron", (2, 2))])
def test_dropout_masks_are_the_same_on_every_mesh_and_sharding(preset, shape):
    params, (idx, targets) = _perturbed(DROP), _batch(DROP)
    key = srandom.key(3)
    train = lambda p, i, t, k: sr.value_and_grad(lambda q: gpt2.loss(DROP, q, i, t, key=k, train=True))(p)
    want_loss, want_grads = on_mesh("dp", (1,), train, params, idx, targets, key)
    got_loss, got_grads = on_mesh(preset, shape, train, params, idx, targets, key)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-7, err_msg=name)
    # the masks did something, and another key draws other ones; train=False is the plain model
    plain = ref.loss(DROP, params, idx, targets)
    other, _ = on_mesh("dp", (1,), train, params, idx, targets, srandom.key(4))
    assert abs(want_loss - plain) > 1e-3 and abs(other - want_loss) > 1e-3
    evaluated = on_mesh(preset, shape, lambda p, i, t, k: gpt2.loss(DROP, p, i, t, key=k), params, idx, targets, key)
    np.testing.assert_allclose(evaluated, plain, rtol=2e-6)


# ================================================================ generation
def _placed(preset_name, shape, params, comm):
    mesh = train_mesh(shape, preset_name)
    layout = param_layout(gpt2.param_shapes(CFG), gpt2.param_roles(CFG), mesh, PRESETS[preset_name])
    return {n: sr.device_put(w, sr.P(*layout.held[n]), mesh, comm=comm) for n, w in layout.hold(params).items()}


@pytest.mark.parametrize("preset, shape", [("dp", (1,)), ("dp", (4,)), ("megatron", (2, 2))])
def test_kv_cache_decode_gives_argmax_of_the_uncached_forward(preset, shape):
    params = _perturbed(CFG)
    prompt = _batch(CFG, b=4, t=3)[0]
    want = ref.greedy(CFG, params, prompt, 12)  # 3 + 12 > block_size 12: the last steps crop the context

    def body(comm):
        placed = _placed(preset, shape, params, comm)
        batch = PRESETS[preset].on(train_mesh(shape, preset)).batch
        tokens = gpt2.generate(CFG, placed, prompt, 12, temperature=0.0, batch_axes=batch)
        heads = gpt2._head_axes(placed, batch)
        placed = gpt2._head_major(CFG, placed, heads)
        token, cache = gpt2._jitted(gpt2.prefill, CFG.n_layer, batch, heads)(
            CFG, placed, prompt, srandom.key(0), 0.0, None)
        decode = gpt2._jitted(gpt2.decode_step, CFG.n_layer, batch, heads).lower(
            CFG, placed, cache, token, np.int32(3), srandom.key(0), 0.0, None)
        return tokens, cache[0]["k"].sharding.dims, {c["kind"] for c in decode.comm_summary()}
    results = run_simulated(train_mesh(shape, preset).size, body)
    for tokens, _, _ in results:
        np.testing.assert_array_equal(tokens, want)
    mesh = train_mesh(shape, preset)  # tensor-parallel decode: each rank holds its heads' keys and values
    assert results[0][1] == (PRESETS[preset].on(mesh).batch, (), PRESETS[preset].on(mesh).model, ())
    # a decode step moves no weight and no cache: megatron's all-reduces of partial sums, nothing under dp
    assert results[0][2] == ({"all_reduce"} if preset == "megatron" else set()), results[0][2]


def test_sampling_is_reproducible_on_any_mesh_and_top_k_1_is_greedy():
    params = _perturbed(CFG)
    prompt = _batch(CFG, b=4, t=3)[0]

    def body(shape, preset, **kw):
        return run_simulated(train_mesh(shape, preset).size, lambda comm: gpt2.generate(
            CFG, _placed(preset, shape, params, comm), prompt, 6, **kw))[0]
    one = body((1,), "dp", temperature=1.3, top_k=5, key=srandom.key(5))
    four = body((2, 2), "megatron", temperature=1.3, top_k=5, key=srandom.key(5))
    np.testing.assert_array_equal(one, four)
    assert (one[:, 3:] != ref.greedy(CFG, params, prompt, 6)[:, 3:]).any()  # it sampled
    np.testing.assert_array_equal(body((1,), "dp", temperature=0.7, top_k=1), ref.greedy(CFG, params, prompt, 6))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        gpt2.generate(CFG, params, prompt, 2, temperature=-1.0)


def test_a_too_long_input_names_block_size():
    params, idx = _perturbed(CFG), np.zeros((1, 13), "int32")
    with pytest.raises(ValueError, match="block_size=12"):
        on_mesh("dp", (1,), lambda p, i: gpt2.forward(CFG, p, i), params, idx)


# ================================================================ megatron's step moves no c_attn weight
def _megatron_step_collectives(n_layer):
    """The collectives (kind, axes) of a megatron training step (forward, backward, AdamW) at 4 ranks."""
    cfg = gpt2.GPTConfig(block_size=12, vocab_size=64, n_layer=n_layer, n_head=4, n_embd=16)
    mesh = train_mesh((4,), "megatron")
    layout = param_layout(gpt2.param_shapes(cfg), gpt2.param_roles(cfg), mesh, PRESETS["megatron"])
    params = layout.hold(gpt2.init_params(cfg))
    opt = sr.AdamW(lr=1e-3, weight_decay=0.1)
    idx = np.zeros((4, 8), "int32")

    def step(p, s, i, t):
        value, grads = sr.value_and_grad(lambda q: gpt2.loss(cfg, q, i, t))(p)
        return opt.update(p, grads, s, matrices=gpt2.decayed(cfg)) + (value,)
    held = {n: sr.P(*layout.held[n]) for n in params}
    state = {"step": sr.P(), "m": held, "v": held}
    lowered = sr.jit(step, mesh=mesh, in_specs=(held, state, sr.P(), sr.P()), out_specs=(held, state, sr.P())).lower(
        params, opt.init_state(params), idx, idx)
    return [(c["kind"], c["axes"]) for c in lowered.comm_summary()]


def test_megatron_step_has_only_megatrons_all_reduces_per_layer():
    one, two = _megatron_step_collectives(1), _megatron_step_collectives(2)
    assert set(one) == set(two) == {("all_reduce", ("model",))}, set(two)  # no all_to_all(v) reshuffling c_attn
    assert len(two) - len(one) == 4  # per layer: attention's and the MLP's row-parallel sums, forward and backward


def test_blocked_role_holds_a_view_split_within_its_blocks():
    assert gpt2.QKV.held_shape((48, 16)) == (3, 16, 16) and gpt2.QKV_BIAS.held_shape((48,)) == (3, 16)
    assert gpt2.QKV.spec(3, tensor=("model",)) == (None, ("model",), None)
    stacked = gpt2.QKV.stack()
    assert stacked.held_shape((2, 48, 16)) == (2, 3, 16, 16)
    assert stacked.spec(4, tensor="model", layers="stage") == ("stage", None, "model", None)
    with pytest.raises(ValueError, match="3 equal blocks on dim 0; got shape"):
        gpt2.QKV.held_shape((47, 16))
    with pytest.raises(ValueError, match="needs a tensor dim"):
        ParamRole("x", blocks=3)
    layout = param_layout(gpt2.param_shapes(CFG), gpt2.param_roles(CFG), train_mesh((4,), "megatron"),
                          PRESETS["megatron"])
    params = gpt2.init_params(CFG)
    held = layout.hold(params)
    w = "transformer.h.0.attn.c_attn.weight"
    assert held[w].shape == (3, 16, 16) and np.shares_memory(held[w], params[w])  # a view: no copy
    back = layout.release(held)
    assert all(back[n].shape == params[n].shape and np.array_equal(back[n], params[n]) for n in params)
