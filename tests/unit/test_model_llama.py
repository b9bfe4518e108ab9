"""models/llama.py (llama2.c's Transformer on the public API) against the NumPy Llama of tests/llama_reference.py:
logits and loss, every gradient (directional central differences of the reference in float64, x64 on), at 1
rank and on simulated 4-rank meshes under the dp, megatron, fsdp, megatron_sp and seq presets, with grouped kv heads
(n_kv_heads < n_heads) and head / kv-head / vocab counts the model axis does not divide; dropout masks applied
where llama2.c applies them and the same on every mesh; generation with a KV cache (greedy and sampled) the
same as llama2.c's generate re-running the NumPy model, at 1 rank and tensor-parallel on 4; the pipelined step of
the stacked layers (``llama.pipelined_loss``) equal to the per-layer model's 1-rank step."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.random as srandom
from spmd_runtime import pytree
from spmd_runtime.comm import run_simulated
from spmd_runtime.models import llama
from spmd_runtime.train import build_train_step, model_layout, train_mesh

import llama_cases
import llama_reference as ref
from simulated import collectives, run_everywhere, train_simulated

# 6 query heads sharing 3 kv heads (head dim 4); on a 4-wide model axis neither count divides, nor the vocab
ARGS = llama.ModelArgs(dim=24, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=37, multiple_of=16,
                       max_seq_len=8)
BATCH, SEQ = 4, 6
MESHES = [("dp", (2, 2)), ("megatron", (2, 2)), ("megatron", (4,)), ("fsdp", (2, 2)), ("megatron_sp", (2, 2)),
          ("seq", (4,))]


@pytest.fixture
def x64():
    before = sr.config.enable_x64
    sr.config.update("enable_x64", True)
    yield
    sr.config.update("enable_x64", before)


def data(args=ARGS, dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    params = {n: (w + 0.3 * rng.standard_normal(w.shape) if n.endswith("norm.weight") else w * 5).astype(dtype)
              for n, w in llama.init_params(args, seed).items()}  # larger than llama2.c's init: softmax not flat
    tokens = rng.integers(0, args.vocab_size, (BATCH, SEQ)).astype("int32")
    targets = rng.integers(0, args.vocab_size, (BATCH, SEQ)).astype("int32")
    targets[1, 2] = -1  # ignored, as llama2.c's ignore_index=-1
    return params, tokens, targets


def loss_and_grads(args, mesh, preset, params, tokens, targets, key=None):
    """(loss, grads by name) of llama.loss under ``preset`` on ``mesh``: the layout's input specs for the
    parameters and batch, its activation annotations in the model, the weights gathered where FSDP holds them
    sharded."""
    layout = model_layout(mesh, preset, llama.param_shapes(args), llama.param_roles(args))
    batch = sr.P(*layout.specs["batch.tokens"])

    def fn(p, x, y, k):
        return sr.value_and_grad(lambda p: llama.loss(args, layout.used(p), x, y, k, annotate=layout.activation))(p)
    in_specs = ({n: sr.P(*s) for n, s in layout.param_specs().items()}, batch, batch, sr.P())
    key = srandom.key(0) if key is None else key
    program = sr.jit(fn, mesh=mesh, in_specs=in_specs).lower(params, tokens, targets, key)
    outs = run_everywhere(program, *pytree.flatten((params, tokens, targets, key))[0])
    for rank, other in enumerate(outs[1:], 1):
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank}")
    value, grads = pytree.flatten((0.0, params))[1].unflatten(outs[0])
    layout.program = program
    return float(value), grads, layout


def test_logits_and_loss_match_numpy_in_float32_at_one_rank():
    params, tokens, targets = data(dtype="float32")
    mesh = train_mesh(1, "dp")
    logits, value = sr.jit(lambda p, x, y: llama.transformer(ARGS, p, x, y), mesh=mesh)(params, tokens, targets)
    p64 = {n: w.astype("float64") for n, w in params.items()}
    want = ref.logits(ARGS, p64, tokens)
    assert np.asarray(logits).dtype == np.float32
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(np.asarray(value)), ref.cross_entropy(want, targets), rtol=2e-6)
    last = sr.jit(lambda p, x: llama.transformer(ARGS, p, x), mesh=mesh)(params, tokens)  # inference: last position
    np.testing.assert_allclose(np.asarray(last), want[:, [-1]], rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def reference():
    """The float64 data, the reference loss and each parameter's direction and directional derivative."""
    params, tokens, targets = data()
    rng = np.random.default_rng(7)
    directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
    return (params, tokens, targets, ref.loss(ARGS, params, tokens, targets), directions,
            ref.directional_derivatives(ARGS, params, tokens, targets, directions))


def check_against_reference(value, grads, reference):
    params, _, _, want_loss, directions, derivatives = reference
    np.testing.assert_allclose(value, want_loss, rtol=1e-12)
    assert set(grads) == set(params)
    for name, g in grads.items():
        got = float(np.sum(np.asarray(g) * directions[name]))
        np.testing.assert_allclose(got, derivatives[name], rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.fixture(scope="module")
def one_rank(reference):
    """(loss, grads) at 1 rank, x64 on, checked against the reference."""
    before = sr.config.enable_x64
    sr.config.update("enable_x64", True)
    try:
        params, tokens, targets = reference[:3]
        value, grads, _ = loss_and_grads(ARGS, train_mesh(1, "dp"), "dp", params, tokens, targets)
    finally:
        sr.config.update("enable_x64", before)
    return value, grads


def test_loss_and_every_gradient_match_numpy_at_one_rank(reference, one_rank):
    check_against_reference(*one_rank, reference)


@pytest.mark.parametrize("preset,shape", MESHES, ids=[f"{p}-{'x'.join(map(str, s))}" for p, s in MESHES])
def test_loss_and_every_gradient_on_four_ranks(x64, reference, one_rank, preset, shape):
    params, tokens, targets = reference[:3]
    value, grads, layout = loss_and_grads(ARGS, train_mesh(shape, preset), preset, params, tokens, targets)
    check_against_reference(value, grads, reference)
    for name, g in grads.items():  # and elementwise the 1-rank gradient the reference checked
        np.testing.assert_allclose(np.asarray(g), np.asarray(one_rank[1][name]), rtol=1e-10, atol=1e-13, err_msg=name)
    wq = layout.param_specs()["layers.0.attention.wq.weight"]
    model_only = [c for c in collectives(layout.program) if c[1] == ("model",)]
    assert bool(model_only) == preset.startswith("megatron")  # megatron's partial sums are reduced over "model"
    assert wq == {"dp": (None, None), "megatron": (("model",), None), "fsdp": (("data", "model"), None),
                  "megatron_sp": (("model",), None), "seq": (None, None)}[preset], wq


def test_dropout_masks_where_llama2c_applies_them_and_the_same_on_every_mesh(x64):
    args = llama.ModelArgs(**{**ARGS.__dict__, "dropout": 0.25})
    params, tokens, targets = data(args)
    key = srandom.key(3)
    with train_mesh(1, "dp"):  # the masks the model draws: fold_in(key, site) for the sites in order
        shapes = [(BATCH, SEQ, args.dim)] + [(BATCH, args.n_heads, SEQ, SEQ), (BATCH, SEQ, args.dim),
                                             (BATCH, SEQ, args.dim)] * args.n_layers
        masks = [np.asarray(srandom.bernoulli(srandom.fold_in(key, i + 1), 0.75, s)) / 0.75
                 for i, s in enumerate(shapes)]
    assert 0.15 < np.mean([m == 0 for m in masks[0]]) < 0.35
    sites = iter(masks)
    want = ref.loss(args, params, tokens, targets, lambda x: x * next(sites))
    assert abs(want - ref.loss(args, params, tokens, targets)) > 1e-3  # dropout changes the loss
    rng = np.random.default_rng(8)
    directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
    derivatives = ref.directional_derivatives(args, params, tokens, targets, directions, dropout_masks=masks)
    losses = []
    for preset, shape in [("dp", (1,)), ("dp", (2,)), ("dp", (2, 2)), ("megatron", (2, 2))]:  # 1, 2, 4 ranks
        value, grads, _ = loss_and_grads(args, train_mesh(shape, preset), preset, params, tokens, targets, key)
        check_against_reference(value, grads, (params, tokens, targets, want, directions, derivatives))
        losses.append(value)
    np.testing.assert_allclose(losses, losses[0], rtol=1e-13)


def test_tied_head_and_multi_query_attention(x64):
    args = llama.ModelArgs(dim=16, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=20, multiple_of=8,
                           max_seq_len=SEQ, tie_embeddings=True)
    params, tokens, targets = data(args)
    assert "output.weight" not in params
    value, grads, _ = loss_and_grads(args, train_mesh((2, 2), "megatron"), "megatron", params, tokens, targets)
    np.testing.assert_allclose(value, ref.loss(args, params, tokens, targets), rtol=1e-12)
    rng = np.random.default_rng(9)
    directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
    derivatives = ref.directional_derivatives(args, params, tokens, targets, directions)
    for name, g in grads.items():
        np.testing.assert_allclose(np.sum(np.asarray(g) * directions[name]), derivatives[name], rtol=1e-6,
                                   err_msg=name)


def test_llama2c_names_shapes_and_roles():
    shapes = llama.param_shapes(ARGS)
    assert list(shapes)[:4] == ["tok_embeddings.weight", "layers.0.attention.wq.weight",
                                "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"]
    assert shapes["layers.1.attention.wk.weight"] == (12, 24) and shapes["layers.1.feed_forward.w1.weight"] == (64, 24)
    assert list(shapes)[-2:] == ["norm.weight", "output.weight"]
    roles = llama.param_roles(ARGS)
    assert roles["layers.0.attention.wo.weight"].tensor == 1 and roles["output.weight"].tensor == 0
    assert roles["layers.1.ffn_norm.weight"].tensor is None
    assert llama.ModelArgs(dim=288, n_heads=6, multiple_of=32).ffn_dim == 768  # llama2.c's stories15M


@pytest.mark.parametrize("kwargs,match", [
    (dict(dim=24, n_heads=5), "dim to be n_heads times an even head dim .*got dim=24, n_heads=5"),
    (dict(dim=24, n_heads=6, n_kv_heads=4), "multiple of n_kv_heads.*got n_heads=6, n_kv_heads=4"),
    (dict(dropout=1.0), "dropout is a probability in \\[0, 1\\); got 1.0"),
])
def test_bad_args_say_what_and_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llama.ModelArgs(**kwargs)


def test_too_long_a_sequence_is_refused():
    params, tokens, _ = data(llama.ModelArgs(**{**ARGS.__dict__, "max_seq_len": 4}))
    with pytest.raises(ValueError, match="at most max_seq_len=4 tokens per sequence; got 6"):
        sr.trace(lambda p, x: llama.logits(llama.ModelArgs(**{**ARGS.__dict__, "max_seq_len": 4}), p, x),
                 params, tokens)


def greedy_reference(args, params, prompt, new):
    """llama2.c's generate at temperature 0 on the NumPy model: the whole sequence re-run for every token."""
    idx = prompt
    for _ in range(new):
        idx = np.concatenate([idx, ref.logits(args, params, idx)[:, -1].argmax(-1)[:, None]], axis=1)
    return idx


def test_generate_with_a_kv_cache_at_one_and_four_ranks(x64):
    args = llama.ModelArgs(**{**ARGS.__dict__, "max_seq_len": 10, "n_layers": 1})  # one layer: compiles fast
    params, tokens, _ = data(args)
    prompt, new = tokens[:2, :4], 6
    want = greedy_reference(args, params, prompt, new)
    with train_mesh(1, "dp"):
        np.testing.assert_array_equal(llama.generate(args, params, prompt, new, temperature=0.0), want)
        sampled = llama.generate(args, params, prompt, new, temperature=0.8, top_k=4, key=srandom.key(5))
        top1 = llama.generate(args, params, prompt, new, temperature=0.8, top_k=1, key=srandom.key(5))
    np.testing.assert_array_equal(top1, want)  # top_k=1 leaves only the argmax to draw
    assert (sampled[:, 4:] != want[:, 4:]).any() and (sampled[:, :4] == prompt).all()
    mesh = train_mesh((2, 2), "megatron")  # tensor-parallel decode: the weights split as megatron trains them
    specs = model_layout(mesh, "megatron", llama.param_shapes(args), llama.param_roles(args)).param_specs()

    def body(comm):
        local = {n: sr.device_put(w, sr.P(*specs[n]), mesh, comm=comm) for n, w in params.items()}
        return (llama.generate(args, local, prompt, new, temperature=0.0, mesh=mesh),
                llama.generate(args, local, prompt, new, temperature=0.8, top_k=4, key=srandom.key(5), mesh=mesh))
    for greedy, drawn in run_simulated(mesh.size, body):
        np.testing.assert_array_equal(greedy, want)
        np.testing.assert_array_equal(drawn, sampled)  # the same draws on any mesh


def test_generate_refuses_more_tokens_than_the_cache_holds():
    params, tokens, _ = data()
    with pytest.raises(ValueError, match="at most max_seq_len=8 tokens in its cache; got a prompt of 6 and "
                                         "max_new_tokens=3"):
        llama.generate(ARGS, params, tokens, 3)


# ================================================================ the pipeline presets (llama.pipelined_loss)
def test_stacked_layout_is_llama2cs_per_layer_one_stacked():
    shapes, roles = llama.stacked_param_shapes(ARGS), llama.stacked_param_roles(ARGS)
    assert list(shapes)[:2] == ["tok_embeddings.weight", "layers.attention.wq.weight"]
    assert list(shapes)[-2:] == ["norm.weight", "output.weight"]
    assert shapes["layers.attention.wk.weight"] == (2, 12, 24) and roles["layers.attention.wk.weight"].stacked
    assert roles["layers.attention.wo.weight"].spec(3, tensor="model", layers="stage") == ("stage", None, "model")
    params = llama.init_params(ARGS, 0)
    back = llama.unstack_layers(ARGS, llama.stack_layers(ARGS, params))
    assert list(back) == list(params) and all(np.array_equal(back[n], params[n]) for n in params)


@pytest.mark.parametrize("shape", [(2,), (2, 1, 2), (4,)], ids=str)
def test_pipelined_train_step_equals_the_per_layer_one_rank_step(shape):
    """2 or 4 stages of the stacked layers (megatron's splits on "model" on the (2, 1, 2) mesh), 2 micro-batches,
    AdamW: the losses and every parameter after two steps are the per-layer model's at 1 rank."""
    data = llama_cases.batches()
    mesh = train_mesh(shape, "pipeline")
    ts = build_train_step(llama_cases.pipelined_model(mesh), mesh, "pipeline", llama_cases.OPT)
    got, losses = train_simulated(ts, ts.init(0), data)
    llama_cases.assert_same_step(losses, got["params"], llama_cases.one_rank(data), str(shape))
    assert any(c["kind"] == "collective_permute" and "stage" in c["axes"] for c in ts.program.comm_summary())


def test_pipelined_loss_refuses_what_it_cannot_run():
    mesh = train_mesh((2,), "pipeline")
    with pytest.raises(ValueError, match="pipelines the built-in LM's stacked layers.*llama.pipelined_loss"):
        build_train_step(llama_cases.pipelined_model(mesh, "pipeline_1f1b"), mesh, "pipeline_1f1b",
                         llama_cases.OPT)
    three = train_mesh((3,), "pipeline")
    with pytest.raises(ValueError, match="needs the 3 stages \\(mesh axis 'stage'\\) to divide n_layers=4"):
        build_train_step(llama_cases.pipelined_model(three), three, "pipeline", llama_cases.OPT)
