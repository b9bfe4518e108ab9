"""PyTorch-layout state dicts in and out (spmd_runtime/weights.py) in the in-process simulated world.

Files are written by safetensors' own writer (``safetensors.numpy.save_file``) and ours are read back with its
own reader (``safe_open``), so neither side checks itself. Meshes of 1-8 ranks, 1-d and 2-d, uneven shapes
(trailing blocks short or empty), float32 / float16 / bfloat16 (with ml_dtypes) / int32 / a scalar; every
rank's block is compared with the slice of the original the layout rule gives it, and the slices each rank
asks the file for are recorded: exactly its own blocks, nothing else.
"""
import json
import os
import re
import threading

import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from spmd_runtime import DArray, Mesh, parse_spec  # noqa: E402
from spmd_runtime import weights  # noqa: E402
from spmd_runtime.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from spmd_runtime.comm import run_simulated  # noqa: E402
from spmd_runtime.dtypes import BFLOAT16  # noqa: E402
from spmd_runtime.weights import (TIED_KEY, Transpose, WeightsError, checkpoint_to_safetensors,  # noqa: E402
                                  load_safetensors, safetensors_to_checkpoint, save_safetensors)

from tests.simulated import errors_on_every_rank  # noqa: E402
from weights_cases import bounds, recording_reader, true_slices  # noqa: E402


def _originals():
    rng = np.random.default_rng(0)
    out = {
        "transformer.h.0.attn.c_attn.weight": rng.standard_normal((10, 7)).astype(np.float32),
        "transformer.ln_f.bias": rng.standard_normal(13).astype(np.float16),   # 13 over 8: an empty tail block
        "ids": rng.integers(-9, 9, (7, 3)).astype(np.int32),
        "scale": np.array(2.5),
    }
    if BFLOAT16 is not None:
        out["emb"] = rng.standard_normal((5, 6)).astype(BFLOAT16)
    return out


ORIG = _originals()
MESHES = [Mesh((1,), ("x",)), Mesh((2,), ("x",)), Mesh((3,), ("x",)), Mesh((4,), ("x",)), Mesh((2, 2), ("x", "y")),
          Mesh((2, 3), ("x", "y")), Mesh((8,), ("x",)), Mesh((2, 4), ("x", "y"))]


def specs_for(mesh):
    """Every tensor split somewhere: rows over x, columns over the last axis, a vector over every axis."""
    last, every = mesh.axis_names[-1], tuple(mesh.axis_names)
    specs = {"transformer.h.0.attn.c_attn.weight": ("x", last if last != "x" else None),
             "transformer.ln_f.bias": (every,), "ids": (None, "x"), "scale": ()}
    if BFLOAT16 is not None:
        specs["emb"] = (last, None)
    return specs


@pytest.fixture
def file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(ORIG, str(path))
    return path


def read_back(path):
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_bit_equal(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.fixture
def requests(monkeypatch):
    """(rank, file key, bounds) of every slice the loader asks of the file; a whole-tensor read fails."""
    seen, lock = [], threading.Lock()

    def record(key, where):
        rank = int(threading.current_thread().name.rsplit("-", 1)[1])
        with lock:
            seen.append((rank, key, where))

    monkeypatch.setattr(weights, "safe_open", recording_reader(record))
    return seen


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_each_rank_reads_only_its_blocks_and_the_save_reproduces_the_file(mesh, file, tmp_path, requests):
    specs = specs_for(mesh)
    out = tmp_path / "out.safetensors"

    def body(comm):
        loaded = load_safetensors(file, mesh, specs, comm=comm)
        save_safetensors(out, loaded, {n: (ORIG[n].shape, specs[n]) for n in loaded}, mesh, comm=comm)
        return loaded

    results = run_simulated(mesh.size, body)
    for rank, blocks in enumerate(results):
        want = {n: ORIG[n][true_slices(ORIG[n].shape, specs[n], mesh, rank)] for n in ORIG}
        assert_bit_equal(blocks, want)
        asked = sorted((k, s) for r, k, s in requests if r == rank)
        nonempty = sorted((n, bounds(true_slices(ORIG[n].shape, specs[n], mesh, rank)))
                          for n in ORIG if want[n].size)
        assert asked == nonempty, f"rank {rank} must ask the file for exactly its own blocks"
    stored, meta = read_back(out)
    assert_bit_equal(stored, ORIG)
    assert meta is None and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.parametrize("mesh", [MESHES[2], MESHES[5]], ids=str)
def test_a_sharded_save_is_byte_identical_to_safetensors_own_writer(mesh, file, tmp_path):
    specs, out = specs_for(mesh), tmp_path / "out.safetensors"
    run_simulated(mesh.size, lambda comm: save_safetensors(
        out, {n: x[true_slices(x.shape, specs[n], mesh, comm.Get_rank())] for n, x in ORIG.items()},
        {n: (x.shape, specs[n]) for n, x in ORIG.items()}, mesh, comm=comm))
    assert out.read_bytes() == file.read_bytes()


def test_without_safetensors_the_load_says_what_to_install(file, monkeypatch):
    monkeypatch.setattr(weights, "safe_open", None)
    errors = load_errors(file, MESHES[1])
    assert all("load_safetensors needs the safetensors package; install it with `pip install "
               "spmd_runtime[weights]`" in e for e in errors)


@pytest.mark.parametrize("mesh", [MESHES[0], MESHES[4], MESHES[6]], ids=str)
def test_darrays_save_without_shardings_and_load_as_darrays_in_a_tree(mesh, file, tmp_path):
    specs = specs_for(mesh)
    like = {"attn": {"w": 0}, "bias": 0}
    names = {"attn.w": "transformer.h.0.attn.c_attn.weight", "bias": "transformer.ln_f.bias"}
    out = tmp_path / "out.safetensors"

    def body(comm):
        tree = load_safetensors(file, mesh, {"attn.w": specs[names["attn.w"]], "bias": specs[names["bias"]]},
                                names=names, like=like, darrays=True, comm=comm, strict=False,
                                expect={n: (ORIG[k].shape, ORIG[k].dtype) for n, k in names.items()})
        save_safetensors(out, tree, names=names, comm=comm)
        return tree

    tree = run_simulated(mesh.size, body)[mesh.size - 1]
    w = tree["attn"]["w"]
    assert isinstance(w, DArray) and w.shape == (10, 7) and w.sharding == parse_spec(specs[names["attn.w"]], mesh, 2)
    stored, _ = read_back(out)
    assert_bit_equal(stored, {k: ORIG[k] for k in names.values()})


@pytest.mark.parametrize("mesh", [MESHES[3], MESHES[5]], ids=str)
def test_transpose_reads_the_transposed_slices_and_writes_the_file_layout_back(mesh, file, tmp_path, requests):
    key, last = "transformer.h.0.attn.c_attn.weight", mesh.axis_names[-1]
    spec = (last, "x") if last != "x" else ("x", None)  # ours is [7, 10]: the file's [10, 7] transposed
    out = tmp_path / "out.safetensors"

    def body(comm):
        loaded = load_safetensors(file, mesh, {"w": spec}, names={"w": key}, transforms={"w": Transpose()},
                                  expect={"w": ((7, 10), "float32")}, strict=False, comm=comm)
        save_safetensors(out, loaded, {"w": ((7, 10), spec)}, mesh, names={"w": key}, transforms={"w": Transpose()},
                         comm=comm)
        return loaded["w"]

    for rank, block in enumerate(run_simulated(mesh.size, body)):
        where = true_slices((7, 10), spec, mesh, rank)
        np.testing.assert_array_equal(block, ORIG[key].T[where])
        assert block.flags.c_contiguous
        asked = [s for r, k, s in requests if r == rank and k == key]
        assert asked == ([((where[1].start, where[1].stop), (where[0].start, where[0].stop))] if block.size else [])
    assert_bit_equal(read_back(out)[0], {key: ORIG[key]})


def test_transpose_of_a_3d_tensor_by_axes(tmp_path):
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    save_file({"x": x}, str(tmp_path / "a.safetensors"))
    mesh, spec, t = Mesh((2, 2), ("x", "y")), ("x", None, "y"), Transpose((2, 0, 1))  # ours: x.transpose(2, 0, 1)
    blocks = run_simulated(4, lambda comm: load_safetensors(tmp_path / "a.safetensors", mesh, {"x": spec},
                                                             transforms={"x": t}, comm=comm)["x"])
    ours = np.transpose(x, (2, 0, 1))
    for rank, block in enumerate(blocks):
        np.testing.assert_array_equal(block, ours[true_slices(ours.shape, spec, mesh, rank)])


# ------------------------------------------------------------------ tied weights

TIE = {"lm_head.weight": "transformer.wte.weight"}


def test_a_tied_alias_loads_from_its_source_and_is_not_written(tmp_path):
    wte = np.random.default_rng(3).standard_normal((11, 4)).astype(np.float32)
    save_file({"transformer.wte.weight": wte}, str(tmp_path / "in.safetensors"))  # as HF / nanoGPT store it
    mesh, out = Mesh((3,), ("x",)), tmp_path / "out.safetensors"
    specs = {"transformer.wte.weight": ("x", None), "lm_head.weight": ("x", None)}

    def body(comm):
        loaded = load_safetensors(tmp_path / "in.safetensors", mesh, specs, tied=TIE, comm=comm,
                                  expect={n: ((11, 4), "float32") for n in specs})
        save_safetensors(out, loaded, {n: ((11, 4), s) for n, s in specs.items()}, mesh, tied=TIE, comm=comm)
        return loaded

    for rank, loaded in enumerate(run_simulated(3, body)):
        np.testing.assert_array_equal(loaded["lm_head.weight"], wte[true_slices((11, 4), ("x", None), mesh, rank)])
    stored, meta = read_back(out)
    assert_bit_equal(stored, {"transformer.wte.weight": wte})
    assert json.loads(meta[TIED_KEY]) == TIE
    again = run_simulated(1, lambda comm: load_safetensors(out, Mesh((1,), ("x",)), comm=comm,  # ties as recorded
                                                           expect={n: ((11, 4), "float32") for n in specs}))[0]
    assert_bit_equal(again, {"transformer.wte.weight": wte, "lm_head.weight": wte})


def test_a_tied_alias_differing_from_its_source_fails_the_save(tmp_path):
    mesh, a = Mesh((2,), ("x",)), np.ones((4, 2), np.float32)
    entries = {n: ((4, 2), ("x", None)) for n in ("transformer.wte.weight", "lm_head.weight")}
    errors = errors_on_every_rank(2, lambda comm: save_safetensors(
        tmp_path / "t.safetensors", {"transformer.wte.weight": a[:2] * (comm.Get_rank() + 1),
                                     "lm_head.weight": a[:2]}, entries, mesh, tied=TIE, comm=comm))
    assert all("tied tensors must be equal (only 'transformer.wte.weight' is stored)" in e for e in errors)
    assert "rank(s) [1]" in errors[0] and not (tmp_path / "t.safetensors").exists()


# ------------------------------------------------------------------ errors, on every rank

def load_errors(file, mesh, **kw):
    return errors_on_every_rank(mesh.size, lambda comm: load_safetensors(file, mesh, comm=comm, **kw))


def expect_all(**changes):
    want = {n: (x.shape, x.dtype) for n, x in ORIG.items()}
    want.update(changes)
    return {n: v for n, v in want.items() if v is not None}


@pytest.mark.parametrize("expect, message", [
    (expect_all(ids=None), r"'ids': in the file, but the model has no such tensor"),
    (expect_all(extra=((3,), "float32")), r"'extra': needed by the model, not in the file"),
    (expect_all(ids=((3, 7), "int32")), r"'ids': stored int32\[7, 3\], the model needs int32\[3, 7\]"),
    (expect_all(scale=((), "float32")), r"'scale': stored float64\[\], the model needs float32\[\]"),
])
def test_a_mismatch_fails_on_every_rank_naming_the_tensor_and_the_rule(file, expect, message):
    errors = load_errors(file, MESHES[4], expect=expect)
    assert len(set(errors)) == 1 and errors[0].startswith("WeightsError: load_safetensors must succeed on every rank")
    assert "a .safetensors file must match the model it is loaded into (pass strict=False" in errors[0]
    assert re.search(message, errors[0]), errors[0]


def test_names_and_transforms_are_named_in_the_errors(file):
    errors = load_errors(file, MESHES[1], names={"w": "transformer.h.0.attn.c_attn.weight"},
                         transforms={"w": Transpose()}, expect={"w": ((10, 7), "float32")})
    assert re.search(r"'w' \(file 'transformer.h.0.attn.c_attn.weight'\): stored float32\[10, 7\], the model needs "
                     r"float32\[7, 10\] as Transpose\(axes=None\) gives it", errors[0]), errors[0]
    errors = load_errors(file, MESHES[1], tied=TIE, expect={"lm_head.weight": ((3,), "float32")})
    assert "'lm_head.weight': needed by the model, not in the file (nor its tied source 'transformer.wte.weight')" \
        in errors[0]


def test_strict_false_loads_what_matches(file):
    got = run_simulated(2, lambda comm: load_safetensors(file, MESHES[1], comm=comm, strict=False,
                                                         expect=expect_all(ids=((1,), "int32"), extra=((2,), "f4"))))
    assert sorted(got[0]) == sorted(set(ORIG) - {"ids"})


def test_bad_calls_fail_on_every_rank(file, tmp_path):
    errors = load_errors(tmp_path / "none.safetensors", MESHES[1])
    assert all("load_safetensors needs an existing .safetensors file; got no file" in e for e in errors)
    errors = load_errors(file, MESHES[1], shardings={"nope": ("x",)})
    assert all("shardings must name tensors it loads" in e and "'nope'" in e for e in errors)
    errors = load_errors(file, MESHES[1], like={"nope": 0})
    assert all("like= names tensors the file holds; got ['nope']" in e for e in errors)
    save_file({"a": np.zeros(2)}, str(tmp_path / "odd.safetensors"), metadata={TIED_KEY: "[1]"})
    errors = load_errors(tmp_path / "odd.safetensors", MESHES[1])
    assert all(f"the '{TIED_KEY}' metadata of a .safetensors file maps alias names to source names" in e
               and "got '[1]'" in e for e in errors)
    mesh = MESHES[1]
    errors = errors_on_every_rank(2, lambda comm: save_safetensors(
        tmp_path / "c.safetensors", {"a": np.zeros(2), "b": np.zeros(2)}, {"a": ((4,), ("x",)), "b": ((4,), ("x",))},
        mesh, names={"a": "same", "b": "same"}, comm=comm))
    assert all("names must map each tensor to a file name of its own; got ['same']" in e for e in errors)
    errors = errors_on_every_rank(2, lambda comm: save_safetensors(
        tmp_path / "c.safetensors", {"a": np.zeros(2, np.complex128)}, {"a": ((4,), ("x",))}, mesh, comm=comm))
    assert all("safetensors stores" in e and "got dtype complex128 for 'a'" in e for e in errors)


def test_replicas_that_differ_fail_the_save_and_keep_the_previous_file(file, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(file.read_bytes())
    mesh = MESHES[4]  # 'scale' is replicated: rank 3's copy differs
    errors = errors_on_every_rank(4, lambda comm: save_safetensors(
        out, {"scale": np.array(1.0 + (comm.Get_rank() == 3))}, {"scale": ((), ())}, mesh, comm=comm))
    assert all(e.startswith("WeightsError: save_safetensors needs every copy of a replicated tensor") for e in errors)
    assert out.read_bytes() == file.read_bytes() and sorted(os.listdir(tmp_path)) == sorted([file.name, out.name])


# ------------------------------------------------------------------ sharded checkpoints

def test_to_a_checkpoint_and_back_across_meshes(file, tmp_path):
    a, b = MESHES[4], MESHES[2]  # (2, 2) -> (3,)
    ckpt, out = tmp_path / "ckpt", tmp_path / "back.safetensors"
    run_simulated(4, lambda comm: safetensors_to_checkpoint(file, ckpt, a, specs_for(a), step=5, comm=comm))
    specs_b = specs_for(b)
    for rank, blocks in enumerate(run_simulated(3, lambda comm: load_checkpoint(ckpt, b, specs_b, comm=comm))):
        assert_bit_equal(blocks, {n: x[true_slices(x.shape, specs_b[n], b, rank)] for n, x in ORIG.items()})
    run_simulated(3, lambda comm: checkpoint_to_safetensors(ckpt, out, b, specs_b, comm=comm))
    assert_bit_equal(read_back(out)[0], ORIG)
    part = tmp_path / "part.safetensors"  # a subset, on the saving mesh: its saved shardings
    run_simulated(4, lambda comm: checkpoint_to_safetensors(ckpt, part, a, tensors=["ids"], names={"ids": "x.ids"},
                                                            comm=comm))
    assert_bit_equal(read_back(part)[0], {"x.ids": ORIG["ids"]})
    errors = errors_on_every_rank(4, lambda comm: checkpoint_to_safetensors(ckpt, part, a, tensors=["no"], comm=comm))
    assert all("converts tensors the checkpoint holds; got ['no']" in e for e in errors)


def test_a_train_step_state_goes_to_a_file_and_back(tmp_path):
    import spmd_runtime as sr  # the training step is the only user of the model here

    cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=12, seq=4, batch=2, dtype="float64")
    mesh = Mesh((2,), ("x",))
    ts = sr.build_train_step(cfg, mesh, "fsdp")
    state = ts.init(seed=1)
    params = [n for n in ts.state_names if n.startswith("params.")]
    names = {n: "model." + n[len("params."):] for n in params}
    ckpt, file, back = tmp_path / "ckpt", tmp_path / "p.safetensors", tmp_path / "back"
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (cfg.batch, cfg.seq))

    def body(comm):
        local = ts.shard_state(state, comm.Get_rank())
        ts.save(ckpt, local, comm=comm)
        checkpoint_to_safetensors(ckpt, file, mesh, tensors=params, names=names, comm=comm)
        loaded = load_safetensors(file, mesh, ts.program, names=names, strict=False, comm=comm)
        resumed = {"params": {n[len("params."):]: b for n, b in loaded.items()}, "opt_state": local["opt_state"]}
        safetensors_to_checkpoint(file, back, mesh, ts.program, names=names, strict=False, comm=comm)
        again = ts.load(back, comm=comm, strict=False)  # parameters only: the optimizer state comes back None
        again["opt_state"] = local["opt_state"]
        return [ts.step(s, tokens, tokens, comm=comm)[1] for s in (local, resumed, again)]

    losses = run_simulated(2, body)[0]
    assert losses[1] == losses[0] and losses[2] == losses[0]  # the same step from weights that went through files
    stored, _ = read_back(file)
    assert sorted(stored) == sorted(names.values())
    for n in params:
        np.testing.assert_array_equal(stored[names[n]], state["params"][n[len("params."):]])
