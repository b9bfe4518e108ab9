"""models/llama.py under real MPI, for any world size: the loss and every gradient of llama2.c's Transformer
(grouped kv heads; head, kv-head and vocab counts a 4-wide model axis does not divide) under the dp, megatron,
megatron_sp and fsdp presets on the 1-d and 2-d meshes of the world, against the NumPy Llama of tests/llama_reference.py
(float64 with x64 on; gradients by directional central differences), float32 logits under megatron, and the
pipelined training step of the stacked layers (``llama.pipelined_loss``) against the per-layer 1-rank step.

Run: ``mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_model_llama_mpi.py -p no:cacheprovider``.
Every rank computes the reference; assertions come after all collectives so one failing rank cannot hang
the rest.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.random as srandom
from spmd_runtime.models import llama
from spmd_runtime.train import build_train_step_on_root, model_layout, train_mesh

import llama_cases
import llama_reference as ref

pytestmark = pytest.mark.mpi

N = MPI.COMM_WORLD.Get_size()
ARGS = llama.ModelArgs(dim=24, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=37, multiple_of=16, max_seq_len=8)
BATCH, SEQ = 4, 6


def cases() -> list[tuple[tuple, str]]:
    """megatron and megatron_sp (the sequence split over the model axis outside the tensor-parallel regions) on the
    1-d mesh (the model axis the whole world), and dp, megatron and fsdp on the first 2-d mesh (dp on the 1-d mesh
    where the world has no 2-d one)."""
    pairs = [(a, N // a) for a in range(2, N) if N % a == 0]
    return [((N,), "megatron"), ((N,), "megatron_sp")] + ([(pairs[0], p) for p in ("dp", "megatron", "fsdp")] if pairs else [((N,), "dp")])


def data(dtype):
    rng = np.random.default_rng(0)
    params = {n: (w + 0.3 * rng.standard_normal(w.shape) if n.endswith("norm.weight") else w * 5).astype(dtype)
              for n, w in llama.init_params(ARGS, 0).items()}
    tokens = rng.integers(0, ARGS.vocab_size, (BATCH, SEQ)).astype("int32")
    targets = rng.integers(0, ARGS.vocab_size, (BATCH, SEQ)).astype("int32")
    targets[1, 2] = -1
    return params, tokens, targets


def shardings(shape, preset):
    mesh = train_mesh(shape, preset)
    layout = model_layout(mesh, preset, llama.param_shapes(ARGS), llama.param_roles(ARGS))
    return mesh, layout, {n: sr.P(*s) for n, s in layout.param_specs().items()}, sr.P(*layout.specs["batch.tokens"])


@pytest.fixture
def x64():
    before = sr.config.enable_x64
    sr.config.update("enable_x64", True)
    yield
    sr.config.update("enable_x64", before)


def test_loss_and_every_gradient_on_every_mesh_match_numpy(x64):
    params, tokens, targets = data("float64")
    rng = np.random.default_rng(7)
    directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
    want_loss = ref.loss(ARGS, params, tokens, targets)
    derivatives = ref.directional_derivatives(ARGS, params, tokens, targets, directions)
    results = []
    for shape, preset in cases():
        mesh, layout, param_specs, batch = shardings(shape, preset)

        def loss_and_grads(p, x, y, key):
            return sr.value_and_grad(lambda p: llama.loss(ARGS, layout.used(p), x, y, key,
                                                          annotate=layout.activation))(p)
        f = sr.jit(loss_and_grads, mesh=mesh, in_specs=(param_specs, batch, batch, sr.P()))
        with mesh:
            value, grads = f({n: sr.device_put(w, param_specs[n]) for n, w in params.items()},
                             sr.device_put(tokens, batch), sr.device_put(targets, batch), srandom.key(0))
            results.append(((shape, preset), float(np.asarray(value)),
                            {n: float(np.sum(np.asarray(g) * directions[n])) for n, g in grads.items()}))
    for case, value, got in results:
        np.testing.assert_allclose(value, want_loss, rtol=1e-12, err_msg=str(case))
        assert set(got) == set(params), case
        for name, d in got.items():
            np.testing.assert_allclose(d, derivatives[name], rtol=1e-6, atol=1e-9, err_msg=f"{case} {name}")


def test_float32_logits_under_megatron_match_numpy():
    params, tokens, targets = data("float32")
    shape = next((s for s, p in cases()[1:] if p == "megatron"), (N,))
    mesh, layout, param_specs, batch = shardings(shape, "megatron")
    f = sr.jit(lambda p, x, y: llama.transformer(ARGS, p, x, y, annotate=layout.activation), mesh=mesh,
               in_specs=(param_specs, batch, batch))
    logits, value = f(params, tokens, targets)
    logits, value = np.asarray(logits), float(np.asarray(value))
    want = ref.logits(ARGS, {n: w.astype("float64") for n, w in params.items()}, tokens)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(value, ref.cross_entropy(want, targets), rtol=2e-6)


def pipeline_meshes() -> list[tuple]:
    """N stages where N divides the 4 layers; with 4 ranks also 2 stages of 2 megatron ranks."""
    return ([(N,)] if llama_cases.ARGS.n_layers % N == 0 else []) + ([(2, 1, N // 2)] if N % 2 == 0 and N > 2 else [])


@pytest.mark.parametrize("shape", pipeline_meshes(), ids=str)
def test_pipelined_train_step_equals_the_per_layer_one_rank_step(shape):
    """llama.pipelined_loss's stages of the stacked layers (train.Model under the pipeline preset), 2 micro-batches,
    two AdamW steps: losses and every parameter those of llama2.c's per-layer model stepped at 1 rank."""
    data = llama_cases.batches()
    mesh = train_mesh(shape, "pipeline")
    ts = build_train_step_on_root(llama_cases.pipelined_model(mesh), mesh, "pipeline", llama_cases.OPT)
    local, losses = ts.shard_state(ts.init(0), MPI.COMM_WORLD.Get_rank()), []
    for tokens, labels in data:
        local, loss = ts.step(local, tokens, labels)
        losses.append(loss)
    params = ts.gather(local)["params"]
    llama_cases.assert_same_step(np.array(losses), params, llama_cases.one_rank(data), str(shape))
