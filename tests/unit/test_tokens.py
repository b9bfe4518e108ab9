"""Token files and the loader (``tokens``), and the training loop (``train.loop.fit``) in the simulated world.

Files whose id at position k is k (mod vocab) show which tokens a rank read: a row starting at s holds s, s + 1,
...; the loader's blocks over any split of rows and columns (the layout rule's, even and uneven) tile the 1-rank
batch, read exactly the tokens of the block, and repeat after a resume. ``fit`` resumed from a checkpoint gives the
same losses to the bit as an uninterrupted run; its loss curve at 1 rank equals 4 ranks' (float64 rounding).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated
from spmd_runtime.data import ALPHABET, corpus, encode
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW, CosineSchedule
from spmd_runtime.sharding import parse_spec
from spmd_runtime.tokens import TokenLoader, prepare_corpus, read_meta, token_dtype, write_meta, write_tokens
from spmd_runtime.train import build_train_step, fit, token_loaders, train_mesh

from simulated import errors_on_every_rank


def positions_file(tmp_path, n=500, vocab=1000, name="train.bin"):
    """A token file whose id at position k is k (n < vocab)."""
    path = tmp_path / name
    write_tokens(path, np.arange(n), vocab)
    return path


def test_prepare_corpus_writes_nanogpt_files_of_the_bundled_text(tmp_path):
    meta = prepare_corpus(tmp_path, sentences=200, val_fraction=0.1)
    ids = encode(corpus(200))
    cut = int(len(ids) * 0.9)
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)  # read as nanoGPT's get_batch does
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    np.testing.assert_array_equal(train, ids[:cut])
    np.testing.assert_array_equal(val, ids[cut:])
    assert meta == json.load(open(tmp_path / "meta.json"))
    assert (meta["vocab_size"], meta["dtype"], meta["alphabet"]) == (len(ALPHABET), "uint16", ALPHABET)


def test_files_are_uint16_up_to_65536_ids_and_uint32_above(tmp_path):
    assert token_dtype(2 ** 16) == np.uint16 and token_dtype(2 ** 16 + 1) == np.uint32
    write_tokens(tmp_path / "big.bin", np.array([0, 70_000, 5]), 100_000)
    assert os.path.getsize(tmp_path / "big.bin") == 12
    loader = TokenLoader(tmp_path / "big.bin", 1, 2, 100_000, shuffle=False)
    tokens, labels = next(loader)
    assert tokens.dtype == np.int32 and tokens.tolist() == [[0, 70_000]] and labels.tolist() == [[70_000, 5]]


def test_rows_are_next_token_windows_at_seeded_offsets(tmp_path):
    loader = TokenLoader(positions_file(tmp_path), batch=6, seq=7, vocab=1000, seed=3)
    for position in range(3):
        tokens, labels = next(loader)
        starts = np.random.default_rng([3, position]).integers(0, 500 - 7, size=6)  # nanoGPT's offsets, seeded
        np.testing.assert_array_equal(tokens, starts[:, None] + np.arange(7))
        np.testing.assert_array_equal(labels, tokens + 1)
    assert loader.position == 3


def test_unshuffled_batches_are_consecutive_windows_wrapping_around(tmp_path):
    loader = TokenLoader(positions_file(tmp_path, n=50), batch=2, seq=8, vocab=1000, shuffle=False)
    assert [next(loader)[0][:, 0].tolist() for _ in range(4)] == [[0, 8], [16, 24], [32, 40], [6, 14]]  # mod 42


# (mesh shape, spec of the batch): dp's rows over all ranks, megatron's over "data" only, sequence splits,
# uneven rows (5 over 2 and 3) and columns (7 over 2)
BLOCKS = [((1,), ("x", None)), ((2,), ("x", None)), ((3,), ("x", None)), ((4,), ("x", None)),
          ((2, 2), ("x", None)), ((2, 2), (("x", "y"), None)), ((2,), (None, "x")), ((2, 3), ("x", "y")),
          ((6,), ("x", None))]


def blocks_of(shape, spec, batch, seq):
    mesh = sr.Mesh(shape, ("x", "y")[:len(shape)])
    sharding = parse_spec(spec, mesh, 2, "batch")
    return [sharding.block_slices((batch, seq), mesh, rank) for rank in range(mesh.size)]


@pytest.mark.parametrize("shape, spec", BLOCKS, ids=[f"{s}-{p}" for s, p in BLOCKS])
def test_each_rank_reads_exactly_its_block_and_the_blocks_tile_the_one_rank_batch(tmp_path, shape, spec):
    path, batch, seq = positions_file(tmp_path), 5, 7
    whole = TokenLoader(path, batch, seq, 1000, seed=1)
    want = [next(whole) for _ in range(3)]
    for rows, cols in blocks_of(shape, spec, batch, seq):
        loader = TokenLoader(path, batch, seq, 1000, seed=1, rows=rows, cols=cols)
        read = []
        loader._data = Recording(loader._data, read)
        for tokens, labels in want:
            got_tokens, got_labels = next(loader)
            np.testing.assert_array_equal(got_tokens, tokens[rows, cols])
            np.testing.assert_array_equal(got_labels, labels[rows, cols])
            own = np.unique(np.concatenate([tokens[rows, cols].ravel(), labels[rows, cols].ravel()]))
            np.testing.assert_array_equal(np.unique(read.pop()), own)  # the block's tokens, nothing else


class Recording:
    """A memmap stand-in that records the positions each read touches."""
    def __init__(self, data, log):
        self.data, self.log = data, log

    def __getitem__(self, index):
        self.log.append(np.asarray(index).ravel())
        return self.data[index]


def test_a_restored_position_draws_the_same_batches(tmp_path):
    path = positions_file(tmp_path)
    first = TokenLoader(path, 4, 6, 1000, seed=9)
    [next(first) for _ in range(5)]
    saved, after = first.state_dict(), [next(first) for _ in range(2)]
    again = TokenLoader(path, 4, 6, 1000, seed=9)
    again.load_state_dict(saved)
    for (t, l), (t2, l2) in zip(after, [next(again) for _ in range(2)]):
        np.testing.assert_array_equal(t, t2)
        np.testing.assert_array_equal(l, l2)
    with pytest.raises(ValueError, match="state of seed 9 loaded into a loader of seed 1; make the loader with seed=9"):
        TokenLoader(path, 4, 6, 1000, seed=1).load_state_dict(saved)


def test_bad_files_fail_naming_the_value(tmp_path):
    short = positions_file(tmp_path, n=8, name="short.bin")
    with pytest.raises(ValueError, match="must hold at least seq \\+ 1 = 9 tokens; got 8"):
        TokenLoader(short, 2, 8, 1000)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="must hold whole uint16 ids; got 7 bytes, not a multiple of 2"):
        TokenLoader(tmp_path / "odd.bin", 1, 2, 1000)
    with pytest.raises(ValueError, match="ids below the model's vocab=100; got id 100 at token 100 \\(a file for"):
        next(TokenLoader(positions_file(tmp_path), 2, 8, 100, shuffle=False, position=6))
    with pytest.raises(ValueError, match="dtype must be uint16 or uint32 .*; got int32"):
        TokenLoader(short, 1, 2, 1000, dtype="int32")
    data = tmp_path / "data"
    data.mkdir()
    write_tokens(data / "train.bin", np.arange(100), 1000)
    write_meta(data, 1000)
    assert read_meta(data)["dtype"] == "uint16"
    with pytest.raises(ValueError, match="meta.json says vocab_size 1000, more ids than the model's vocab=500"):
        TokenLoader(data / "train.bin", 1, 4, 500)
    with pytest.raises(ValueError, match="meta.json says dtype uint16; got dtype uint32 \\(from vocab=70000\\)"):
        TokenLoader(data / "train.bin", 1, 4, 70_000)
    with pytest.raises(ValueError, match="ids must lie in \\[0, vocab=10\\); got ids in \\[0, 10\\]"):
        write_tokens(tmp_path / "x.bin", np.arange(11), 10)


# ---------------------------------------------------------------- fit
CFG = LMConfig(layers=1, d=16, heads=2, ffn=32, vocab=len(ALPHABET), seq=8, batch=4)
OPT = AdamW(lr=CosineSchedule(1e-2, 2, 12, 1e-3), clip_norm=1.0)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("corpus")
    prepare_corpus(where, sentences=200)
    return where


def fit_simulated(ts, data, steps, directory=None, crash_after=None, **kw):
    """Every rank's fit on its own loader blocks; returns rank 0's result after checking every rank agrees.
    ``crash_after``: every rank's step raises after that many steps (the job dies there)."""
    ts.eval_program()  # built once here, not by every simulated rank at once

    def body(comm):
        train, val = token_loaders(ts, data, comm.Get_rank())
        step = ts if crash_after is None else Crashing(ts, crash_after)
        r = fit(step, train, steps, eval_loader=val, directory=directory, comm=comm, log=None, **kw)
        return r.losses, r.evals, r.resumed_from
    results = run_simulated(ts.mesh.size, body)
    assert all(r == results[0] for r in results)
    return results[0]


class Crashing:
    """A TrainStep whose ``step_local`` raises after ``after`` steps."""
    def __init__(self, ts, after):
        self.ts, self.left = ts, after

    def __getattr__(self, name):
        return getattr(self.ts, name)

    def step_local(self, *args, **kwargs):
        if not self.left:
            raise RuntimeError("the job dies here")
        self.left -= 1
        return self.ts.step_local(*args, **kwargs)


def test_fit_resumed_from_its_checkpoint_gives_the_same_losses_to_the_bit(corpus_dir, tmp_path):
    ts = build_train_step(CFG, train_mesh((2, 2), "megatron"), "megatron", OPT)
    straight, straight_evals, _ = fit_simulated(ts, corpus_dir, 6, eval_every=2, eval_steps=2)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="the job dies here"):
        fit_simulated(ts, corpus_dir, 6, ckpt, crash_after=3, eval_every=2, eval_steps=2, checkpoint_every=2)
    assert sr.checkpoint_info(ckpt)["step"] == 2  # the last periodic one before the crash
    tail, tail_evals, start = fit_simulated(ts, corpus_dir, 6, ckpt, eval_every=2, eval_steps=2)
    assert start == 2 and tail == straight[2:] and tail_evals == straight_evals[1:]  # exact: == on floats
    assert [s for s, _ in straight_evals] == [2, 4, 6] and sr.checkpoint_info(ckpt)["step"] == 6


def test_fit_at_one_rank_equals_four_ranks_and_eval_is_the_steps_forward(corpus_dir):
    cfg = LMConfig(layers=1, d=16, heads=2, ffn=32, vocab=len(ALPHABET), seq=8, batch=4, dtype="float64")
    one = fit_simulated(build_train_step(cfg, train_mesh((1,), "dp"), "dp", OPT), corpus_dir, 4, eval_every=2)
    ts = build_train_step(cfg, train_mesh((2, 2), "fsdp"), "fsdp", OPT)
    four = fit_simulated(ts, corpus_dir, 4, eval_every=2)
    np.testing.assert_allclose([l for _, l in four[0]], [l for _, l in one[0]], rtol=1e-12)
    np.testing.assert_allclose([l for _, l in four[1]], [l for _, l in one[1]], rtol=1e-12)

    def eval_and_step(comm):  # the loss a step reports is that of the parameters before its update
        train, _ = token_loaders(ts, corpus_dir, comm.Get_rank())
        local, batch = ts.shard_state(ts.init(0), comm.Get_rank()), next(train)
        return ts.eval_loss(local, *batch, comm=comm), ts.step_local(local, *batch, comm=comm)[1]
    for got, want in run_simulated(4, eval_and_step):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_fit_and_step_local_errors_name_the_value(corpus_dir, tmp_path):
    ts = build_train_step(CFG, train_mesh((1,), "dp"), "dp", OPT)
    train, _ = token_loaders(ts, corpus_dir, 0)
    with pytest.raises(ValueError, match="eval_every=2 needs an eval_loader"):
        fit(ts, train, 3, eval_every=2)
    with pytest.raises(ValueError, match="checkpoint_every=2 needs a directory"):
        fit(ts, train, 3, checkpoint_every=2)
    other = TokenLoader(corpus_dir / "train.bin", 2, 8, CFG.vocab)
    with pytest.raises(ValueError, match="loader must draw the step's \\(batch, seq\\) = \\(4, 8\\); got \\(2, 8\\)"):
        fit(ts, other, 3)
    two = build_train_step(CFG, train_mesh((2,), "dp"), "dp", OPT)
    with pytest.raises(ValueError, match="fit loader must read rank 0's block of the batch, rows 0:2 and cols 0:8 "
                                         "\\(token_loaders makes such loaders\\); got rows 0:4, cols 0:8"):
        fit(two, train, 3)
    local = ts.shard_state(ts.init(0), 0)
    with pytest.raises(sr.AgreedError, match="step_local tokens must have the shape of this rank's block 0:4, 0:8 "
                                             "of the batch, \\(4, 8\\); got \\(2, 8\\)"):
        ts.step_local(local, *next(other))
    two_train = [token_loaders(two, corpus_dir, r)[0] for r in range(2)]
    two_train[1].position = 5  # rank 1 draws another batch
    errors = errors_on_every_rank(2, lambda comm: fit(two, two_train[comm.Get_rank()], 3, comm=comm, log=None))
    assert all("DifferentValuesError: TrainStep.step_local needs every rank at the same loader position (each reads "
               "its block of that batch); got different contents for 'loader position': ranks [0] vs [1]" in e
               for e in errors), errors
    ts.save(tmp_path / "plain", local, step=1)  # a TrainStep checkpoint without the loader's position
    with pytest.raises(ValueError, match="fit resumes from checkpoints that fit saved"):
        fit(ts, train, 3, directory=tmp_path / "plain")


@pytest.mark.parametrize("preset, microbatches", [("seq", 1), ("pipeline_1f1b", 2)])
def test_eval_loss_is_the_loss_the_step_reports_under_every_kind_of_preset(preset, microbatches):
    """Sequence splits (each rank reads some columns) and both pipeline schedules (1F1B evaluates through the
    GPipe loop): the forward-only program's loss is the train step's (which reports the loss before updating)."""
    cfg = LMConfig(layers=2, d=16, heads=2, ffn=32, vocab=24, seq=8, batch=4, dtype="float64")
    ts = build_train_step(cfg, train_mesh((2, 2), preset), preset, OPT, microbatches=microbatches)
    rng = np.random.default_rng(0)
    tokens, labels = rng.integers(0, 24, (4, 8)), rng.integers(0, 24, (4, 8))

    def body(comm):
        rows, cols = ts.batch_block(comm.Get_rank())
        local, block = ts.shard_state(ts.init(0), comm.Get_rank()), (tokens[rows, cols], labels[rows, cols])
        return ts.eval_loss(local, *block, comm=comm), ts.step_local(local, *block, comm=comm)[1]
    want = ts.reference_step(ts.init(0), tokens, labels)[1]
    for got in run_simulated(4, body):
        np.testing.assert_allclose(got, (want, want), rtol=1e-12)
