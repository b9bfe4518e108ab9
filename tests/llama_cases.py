"""Llama's pipelined training step (``llama.pipelined_loss`` on the stacked layers, ``train.Model``) as its unit and
MPI tests run it, and the 1-rank step of llama2.c's per-layer model it must equal: ``ARGS`` (4 layers: 2 or 4
stages; grouped kv heads), AdamW, a few batches, and ``assert_same_step`` (losses and parameters to float32
rounding, the stacked ones compared layer by layer)."""
import numpy as np

from spmd_runtime.models import llama
from spmd_runtime.optim import AdamW
from spmd_runtime.train import Model, build_train_step, model_layout, train_mesh

ARGS = llama.ModelArgs(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=29, multiple_of=16, max_seq_len=8)
BATCH, SEQ, MICRO = 4, 6, 2
OPT = AdamW(lr=1e-2, weight_decay=0.1)


def batches(seed=0, steps=2):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, ARGS.vocab_size, (BATCH, SEQ)).astype("int32") for _ in range(2))
            for _ in range(steps)]


def init(seed=0):
    """llama2.c's init scaled up (the softmax not flat), per layer."""
    return {n: w * 5 for n, w in llama.init_params(ARGS, seed).items()}


def per_layer_model() -> Model:
    return Model(lambda p, b: llama.loss(ARGS, p, b["tokens"], b["labels"]), llama.param_shapes(ARGS),
                 llama.param_roles(ARGS), BATCH, SEQ, ARGS.vocab_size, init=init, name="llama")


def pipelined_model(mesh, preset="pipeline") -> Model:
    """The stacked Llama whose loss runs its layers as the preset's stages, ``MICRO`` micro-batches."""
    shapes, roles = llama.stacked_param_shapes(ARGS), llama.stacked_param_roles(ARGS)
    layout = model_layout(mesh, preset, shapes, roles)
    loss = lambda p, b: llama.pipelined_loss(ARGS, p, b["tokens"], b["labels"], layout, MICRO, layout.activation)
    return Model(loss, shapes, roles, BATCH, SEQ, ARGS.vocab_size, init=lambda s: llama.stack_layers(ARGS, init(s)),
                 name="llama-stacked")


def one_rank(data):
    """(losses, parameters) of the per-layer model's steps, unpartitioned (``TrainStep.reference_step``)."""
    ts = build_train_step(per_layer_model(), train_mesh((1,), "dp"), "dp", OPT)
    state, losses = ts.init(0), []
    for tokens, labels in data:
        state, loss = ts.reference_step(state, tokens, labels)
        losses.append(loss)
    return np.array(losses), state["params"]


def assert_same_step(losses, stacked_params, want, where: str):
    want_losses, want_params = want
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, err_msg=where)
    got = llama.unstack_layers(ARGS, stacked_params)
    assert set(got) == set(want_params), where
    for name, w in want_params.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=f"{where} {name}")
