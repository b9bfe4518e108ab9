"""A zoo model as a training citizen (``train.Model``): GPT-2 (``models.gpt2``, a tiny config) trained by
``build_train_step`` under dp, fsdp and megatron on simulated meshes follows the 1-rank run to float32 rounding,
with dropout on too (the masks are the same on any mesh); gradient accumulation, ``fit`` with a kill and resume
(the same losses to the bit, dropout included: each step's key comes from the checkpointed update counter), plans
from abstract specs, and the errors.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated
from spmd_runtime.data import ALPHABET
from spmd_runtime.graph import TensorSpec
from spmd_runtime.models import gpt2
from spmd_runtime.models.roles import NORM
from spmd_runtime.optim import SGD, AdamW, CosineSchedule
from spmd_runtime.tokens import prepare_corpus
from spmd_runtime.train import Model, build_train_step, plan_train_step, train_mesh

from test_tokens import fit_simulated

CFG = gpt2.GPTConfig(block_size=16, vocab_size=len(ALPHABET), n_layer=2, n_head=2, n_embd=16)
OPT = AdamW(lr=CosineSchedule(1e-2, 2, 10, 1e-3), clip_norm=1.0)


def gpt2_model(cfg=CFG, batch=4, seq=16, dropout_seed=None, params=None):
    """GPT-2 stated as a user states any model: its loss, parameter shapes, roles and init."""
    if dropout_seed is None:
        loss = lambda p, b: gpt2.loss(cfg, p, b["tokens"], b["labels"])
    else:
        loss = lambda p, b, key: gpt2.loss(cfg, p, b["tokens"], b["labels"], key, train=True)
    return Model(loss, params=params or gpt2.param_shapes(cfg), roles=gpt2.param_roles(cfg), batch=batch, seq=seq,
                 vocab=cfg.vocab_size, init=lambda seed: gpt2.init_params(cfg, seed), dropout_seed=dropout_seed,
                 name="gpt2")


BATCHES = [tuple(np.random.default_rng(k).integers(0, CFG.vocab_size, (2, 4, 16))) for k in range(3)]


def losses(model, shape, preset, microbatches=1):
    with warnings.catch_warnings():  # megatron's c_attn reshapes warn (models/gpt2.py's own business)
        warnings.simplefilter("ignore", UserWarning)
        ts = build_train_step(model, train_mesh(shape, preset), preset, OPT, microbatches=microbatches)

    def body(comm):
        state, out = ts.shard_state(ts.init(0), comm.Get_rank()), []
        for tokens, labels in BATCHES:
            state, loss = ts.step(state, tokens, labels, comm=comm)
            out.append(loss)
        return out
    results = run_simulated(ts.mesh.size, body)
    assert all(r == results[0] for r in results)
    return np.array(results[0])


@pytest.fixture(scope="module")
def one_rank():
    return losses(gpt2_model(), (1,), "dp")


@pytest.mark.parametrize("shape, preset", [((2,), "dp"), ((4,), "fsdp"), ((2, 2), "megatron")], ids=str)
def test_gpt2_trains_under_each_preset_as_at_one_rank(one_rank, shape, preset):
    got = losses(gpt2_model(), shape, preset)
    np.testing.assert_allclose(got, one_rank, rtol=2e-6)
    assert one_rank[-1] < one_rank[0]  # it learns


def test_dropout_masks_are_the_same_on_any_mesh_and_change_the_losses(one_rank):
    cfg = gpt2.GPTConfig(**{**CFG.__dict__, "dropout": 0.2})
    one = losses(gpt2_model(cfg, dropout_seed=3), (1,), "dp")
    four = losses(gpt2_model(cfg, dropout_seed=3), (2, 2), "megatron")
    np.testing.assert_allclose(four, one, rtol=2e-6)
    other_seed = losses(gpt2_model(cfg, dropout_seed=4), (1,), "dp")
    assert np.all(np.abs(one - one_rank) > 1e-4) and np.all(np.abs(one - other_seed) > 1e-4)


def test_gradient_accumulation_equals_the_whole_batch(one_rank):
    np.testing.assert_allclose(losses(gpt2_model(), (2,), "dp", microbatches=2), one_rank, rtol=2e-6)


def test_dropout_with_accumulation_draws_each_micro_batchs_masks_alike_on_any_mesh():
    cfg = gpt2.GPTConfig(**{**CFG.__dict__, "dropout": 0.2})
    one = losses(gpt2_model(cfg, dropout_seed=3), (1,), "dp", microbatches=2)
    np.testing.assert_allclose(losses(gpt2_model(cfg, dropout_seed=3), (2,), "fsdp", microbatches=2), one, rtol=2e-6)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("corpus")
    prepare_corpus(where, sentences=200)
    return where


def test_fit_with_dropout_resumed_from_its_checkpoint_gives_the_same_losses_to_the_bit(corpus_dir, tmp_path):
    cfg = gpt2.GPTConfig(**{**CFG.__dict__, "dropout": 0.1})
    ts = build_train_step(gpt2_model(cfg, dropout_seed=0), train_mesh((2,), "fsdp"), "fsdp", OPT)
    straight, straight_evals, _ = fit_simulated(ts, corpus_dir, 5, eval_every=2)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="the job dies here"):
        fit_simulated(ts, corpus_dir, 5, ckpt, crash_after=3, eval_every=2, checkpoint_every=2)
    tail, tail_evals, start = fit_simulated(ts, corpus_dir, 5, ckpt, eval_every=2)
    assert start == 2 and tail == straight[2:] and tail_evals == straight_evals[1:]  # exact: == on floats
    assert sorted(sr.checkpoint_info(ckpt)["tensors"])[:2] == ["extra.loader.position", "extra.loader.seed"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        other = build_train_step(gpt2_model(cfg, dropout_seed=0), train_mesh((2, 2), "megatron"), "megatron", OPT)
    saved = run_simulated(2, lambda comm: ts.gather(ts.load(ckpt, comm=comm), comm=comm))[0]
    moved = run_simulated(4, lambda comm: other.gather(other.load(ckpt, comm=comm), comm=comm))[0]
    for name, value in ts.named(saved).items():  # the checkpoint loads onto another mesh and preset as it is
        np.testing.assert_array_equal(other.named(moved)[name], value, err_msg=name)


def test_a_plan_from_abstract_specs_allocates_nothing_and_counts_each_ranks_share():
    cfg = gpt2.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64)
    specs = {n: TensorSpec(s, "float32") for n, s in gpt2.param_shapes(cfg).items()}
    model = Model(lambda p, b: gpt2.loss(cfg, p, b["tokens"], b["labels"]), specs, gpt2.param_roles(cfg), 8, 64,
                  cfg.vocab_size)  # no init: a plan never needs the weights
    count = sum(int(np.prod(s.shape)) for s in specs.values())
    plan = plan_train_step(model, train_mesh((4,), "fsdp"), "fsdp", AdamW())
    assert plan.memory["params_global"] == 4 * count and plan.memory["opt_state_global"] == 4 * (2 * count + 1)
    assert plan.memory["params"] <= count and "Model('model'" in plan.format()
    with pytest.raises(ValueError, match="needs the Model's init"):
        plan.step.init(0)


def test_bad_models_and_presets_fail_naming_the_value():
    shapes, roles = gpt2.param_shapes(CFG), gpt2.param_roles(CFG)
    with pytest.raises(ValueError, match="pipelines the built-in LM's stacked layers"):
        build_train_step(gpt2_model(), train_mesh((2, 1), "pipeline"), "pipeline", OPT)
    with pytest.raises(ValueError, match="needs a models.roles.ParamRole for every parameter; got none for "
                                         "\\['transformer.wte.weight'\\]"):
        Model(lambda p, b: 0.0, shapes, {n: r for n, r in roles.items() if n != "transformer.wte.weight"}, 4, 16, 8)
    with pytest.raises(ValueError, match="share one float dtype"):
        Model(lambda p, b: 0.0, {"w": TensorSpec((2,), "float32"), "b": TensorSpec((2,), "float64")},
              {"w": NORM, "b": NORM}, 4, 16, 8)
    with pytest.raises(ValueError, match="Model batch must be a positive int; got 0"):
        Model(lambda p, b: 0.0, shapes, roles, 0, 16, 8)
    with pytest.raises(ValueError, match="an optimizer state without one"):
        build_train_step(gpt2_model(dropout_seed=0), train_mesh((1,), "dp"), "dp", SGD(lr=0.1))
