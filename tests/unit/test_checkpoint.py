"""Sharded checkpoints in the in-process simulated world: save on a (2,4) mesh,
restore on other meshes and shardings, one file per distinct block, atomic
replacement when a rank fails or the job dies mid-commit, and the error messages.

The tests compute every rank's expected block themselves (ceil-size shards,
trailing ones shorter or empty) rather than with the module's helpers.
"""
import json
import os
import re
import shutil
import threading

import numpy as np
import pytest

from spmd_runtime import Mesh, Sharding, parse_spec
from spmd_runtime.checkpoint import CheckpointError, checkpoint_info, load_checkpoint, save_checkpoint
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec import block_slices
from spmd_runtime.program import IOSpec, SPMDProgram

SAVE_MESH = Mesh((2, 4), ("x", "y"))


def _originals():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((10, 6)).astype(np.float32),     # 10/2, 6/4 -> 2,2,2,0: one empty column block
        "v": rng.standard_normal(10),                             # 10/4 -> 3,3,3,1
        "u": rng.integers(-9, 9, (7, 3)),                         # 7 over (x,y)=8 -> seven of 1, one empty
        "r": rng.integers(0, 100, (3, 4)).astype(np.int16),       # replicated
        "s": np.array(2.5),                                        # scalar
        "mask": rng.integers(0, 2, (4, 5)).astype(bool),
        "layer.0/bias": rng.standard_normal((8, 8)).astype(np.complex64),
    }


ORIG = _originals()
SAVE_SPECS = {"w": ("x", "y"), "v": ("y",), "u": (("x", "y"), None), "r": (None, None), "s": (),
              "mask": (None, "x"), "layer.0/bias": ("y", "x")}
# distinct non-empty blocks per tensor under SAVE_SPECS on SAVE_MESH
EXPECTED_FILES = {"w": 6, "v": 4, "u": 7, "r": 1, "s": 1, "mask": 2, "layer.0/bias": 8}


def true_slices(shape, spec, mesh, rank):
    return block_slices(shape, parse_spec(spec, mesh, len(shape)), mesh, rank)


def local_blocks(rank, mesh=SAVE_MESH, specs=SAVE_SPECS, originals=ORIG):
    return {n: originals[n][true_slices(originals[n].shape, specs[n], mesh, rank)] for n in originals}


def save(path, mesh=SAVE_MESH, specs=SAVE_SPECS, originals=ORIG, step=None, blocks=local_blocks):
    entries = {n: (originals[n].shape, specs[n]) for n in originals}

    def body(comm):
        save_checkpoint(path, blocks(comm.Get_rank(), mesh, specs, originals), entries, mesh, comm=comm, step=step)

    run_simulated(mesh.size, body)


def load(path, mesh, specs=None):
    return run_simulated(mesh.size, lambda comm: load_checkpoint(path, mesh, specs, comm=comm))


def assemble(results, mesh, specs, originals=ORIG):
    """The global arrays from every rank's block; each replica must agree and the blocks must cover everything."""
    out = {}
    for name, orig in originals.items():
        spec = (specs or {}).get(name, (None,) * orig.ndim)
        glob, seen = np.zeros_like(orig), np.zeros(orig.shape, bool)
        for rank, res in enumerate(results):
            where = true_slices(orig.shape, spec, mesh, rank)
            block = res[name]
            assert block.shape == glob[where].shape and block.dtype == orig.dtype, (name, rank)
            if seen[where].any():
                assert block.tobytes() == glob[where].tobytes(), f"replicas of {name} differ on rank {rank}"
            glob[where], seen[where] = block, True
        assert seen.all(), name
        out[name] = glob
    return out


def assert_bit_identical(arrays, originals=ORIG):
    assert set(arrays) == set(originals)
    for name, orig in originals.items():
        got = arrays[name]
        assert got.dtype == orig.dtype and got.shape == orig.shape, name
        assert got.tobytes() == orig.tobytes(), name


def npy_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".npy"))


def siblings(path):
    return sorted(p for p in os.listdir(os.path.dirname(path)) if p != os.path.basename(path))


LOADS = [
    (Mesh((4,), ("d",)), {"w": ("d", None), "v": ("d",), "u": (None, "d"), "layer.0/bias": (None, "d")}),
    (Mesh((4,), ("d",)), {}),
    (Mesh((1,), ("d",)), {"w": ("d", None)}),
    (Mesh((2, 2), ("a", "b")), {"w": (("b", "a"), None), "v": ("b",), "u": ("a", "b"), "mask": ("a", "b")}),
    (Mesh((8,), ("d",)), {"w": (None, "d"), "v": ("d",), "u": ("d", None), "r": ("d", None),
                          "layer.0/bias": ("d", None)}),
    (Mesh((2, 4), ("x", "y")), SAVE_SPECS),
    (Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0)), {"w": ("y", "x"), "v": (("y", "x"),)}),
    (Mesh((3, 2), ("p", "q")), {"w": ("p", "q"), "v": (("q", "p"),), "u": ("q", "p"), "r": ("p", "q")}),
]


@pytest.mark.parametrize("mesh,specs", LOADS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(LOADS)])
def test_restore_on_other_mesh_and_sharding_is_bit_identical(tmp_path, mesh, specs):
    path = str(tmp_path / "ckpt")
    save(path, step=7)
    assert_bit_identical(assemble(load(path, mesh, specs), mesh, specs))


def test_padded_local_blocks_are_cut(tmp_path):
    def padded(rank, mesh, specs, originals):
        out = {}
        for name, block in local_blocks(rank, mesh, specs, originals).items():
            sharding = parse_spec(specs[name], mesh, block.ndim)
            pad_to = tuple(-(-n // mesh.axis_size(d)) for n, d in zip(originals[name].shape, sharding.dims))
            out[name] = np.zeros(pad_to, block.dtype)
            out[name][tuple(slice(0, n) for n in block.shape)] = block
        return out

    path = str(tmp_path / "ckpt")
    save(path, blocks=padded)
    mesh = Mesh((4,), ("d",))
    assert_bit_identical(assemble(load(path, mesh), mesh, {}))


def test_one_file_per_distinct_block_written_by_one_rank(tmp_path, monkeypatch):
    writes, lock, real_save = [], threading.Lock(), np.save

    def recording_save(file, arr, *args, **kwargs):
        with lock:
            writes.append(os.path.basename(file.name))
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(np, "save", recording_save)
    path = str(tmp_path / "ckpt")
    save(path)
    files = npy_files(path)
    assert len(writes) == len(set(writes)) == len(files) == sum(EXPECTED_FILES.values())
    info = checkpoint_info(path)
    for name, count in EXPECTED_FILES.items():
        assert len(info["tensors"][name]["blocks"]) == count, name
    assert sorted(b["file"] for t in info["tensors"].values() for b in t["blocks"]) == files


def test_each_rank_reads_only_overlapping_blocks(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(path)
    reads, real_load = {}, np.load
    local = threading.local()

    def recording_load(file, *args, **kwargs):
        assert kwargs.get("mmap_mode") == "r"
        reads.setdefault(local.rank, []).append(os.path.basename(file))
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(np, "load", recording_load)
    mesh = Mesh((4,), ("d",))

    def body(comm):
        local.rank = comm.Get_rank()
        return load_checkpoint(path, mesh, {"v": ("d",), "w": ("d", None)}, comm=comm)

    assemble(run_simulated(4, body), mesh, {"v": ("d",), "w": ("d", None)})
    # v (10,) saved as 3,3,3,1 and loaded as 3,3,3,1: each rank reads exactly its own block
    assert [sorted(f for f in reads[r] if f.startswith("v.")) for r in range(4)] == [[f"v.{r}.npy"] for r in range(4)]
    # w (10,6) saved with rows 0-4 | 5-9 and loaded as rows 0-2 | 3-5 | 6-8 | 9: rank 1 straddles both row blocks
    w_reads = {r: {f for f in reads[r] if f.startswith("w.")} for r in range(4)}
    assert w_reads[0] == {"w.0.0.npy", "w.0.1.npy", "w.0.2.npy"}
    assert w_reads[1] == {f"w.{i}.{j}.npy" for i in (0, 1) for j in range(3)}
    assert w_reads[3] == {"w.1.0.npy", "w.1.1.npy", "w.1.2.npy"}


def test_metadata(tmp_path):
    path = str(tmp_path / "runs" / "exp" / "ckpt")  # missing parents are made
    save(path, step=42)
    info = checkpoint_info(path)
    assert (info["format"], info["version"], info["step"]) == ("spmd_runtime.checkpoint", 1, 42)
    assert Mesh.from_json(info["mesh"]) == SAVE_MESH
    v = info["tensors"]["v"]
    assert (v["shape"], np.dtype(v["dtype"]), Sharding.from_json(v["sharding"])) == ([10], np.float64, Sharding((("y",),)))
    assert [(b["offset"], b["shape"]) for b in v["blocks"]] == [([0], [3]), ([3], [3]), ([6], [3]), ([9], [1])]
    with open(os.path.join(path, "checkpoint.json")) as f:
        assert json.load(f) == info


def test_save_replaces_previous_checkpoint_and_leaves_no_siblings(tmp_path):
    path = str(tmp_path / "ckpt")
    save(path, step=1)
    newer = {n: (a + 1 if a.dtype != bool else ~a) for n, a in ORIG.items()}
    save(path, originals=newer, step=2)
    assert checkpoint_info(path)["step"] == 2
    mesh = Mesh((2,), ("d",))
    assert_bit_identical(assemble(load(path, mesh), mesh, {}, newer), newer)
    assert siblings(path) == []


def test_failing_rank_makes_every_rank_raise_and_keeps_previous(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(path, step=1)
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    local, real_save = threading.local(), np.save

    def failing_save(file, arr, *args, **kwargs):
        if local.rank == 5:
            raise OSError("disk full")
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    entries = {n: (a.shape, SAVE_SPECS[n]) for n, a in ORIG.items()}

    def body(comm):
        local.rank = comm.Get_rank()
        blocks = {n: b * 0 for n, b in local_blocks(local.rank).items()}
        try:
            save_checkpoint(path, blocks, entries, SAVE_MESH, comm=comm, step=2)
        except CheckpointError as e:
            return str(e)
        return None

    errors = run_simulated(8, body)
    assert all(e is not None and "rank(s) [5]" in e and "disk full" in e for e in errors), errors
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
    assert siblings(path) == []
    mesh = Mesh((4,), ("d",))
    assert_bit_identical(assemble(load(path, mesh), mesh, {}))


class Killed(BaseException):
    """Stands for the job being killed: nothing catches it, so no cleanup runs in the save."""


def test_crash_between_the_two_renames_recovers_previous(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(path, step=1)
    real_rename, renames = os.rename, []

    def dying_rename(src, dst):
        renames.append((str(src), str(dst)))
        if len(renames) == 2:  # old -> .old-* done, the new one not yet in place
            raise Killed()
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", dying_rename)
    with pytest.raises(Killed):
        save(path, originals={n: a * 0 for n, a in ORIG.items()}, step=2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not os.path.exists(path) and [s.split("-")[0] for s in siblings(path)] == ["ckpt.old"]
    assert checkpoint_info(path)["step"] == 1
    mesh = Mesh((2, 2), ("a", "b"))
    specs = {"w": ("a", "b")}
    assert_bit_identical(assemble(load(path, mesh, specs), mesh, specs))
    save(path, step=3)  # the next save takes over and clears the leftover
    assert checkpoint_info(path)["step"] == 3 and siblings(path) == []


def test_only_old_directory_left_is_loaded(tmp_path):
    path = str(tmp_path / "ckpt")
    save(path, step=5)
    os.rename(path, path + ".old-0123")
    os.mkdir(path + ".tmp-4567")  # an unfinished save beside it is ignored
    mesh = Mesh((8,), ("d",))
    assert_bit_identical(assemble(load(path, mesh), mesh, {}))
    assert checkpoint_info(path)["step"] == 5


def test_program_gives_shapes_and_shardings(tmp_path):
    mesh = Mesh((2, 2), ("x", "y"))
    originals = {"w": ORIG["w"], "v": ORIG["v"]}
    specs = {"w": ("x", "y"), "v": (("y", "x"),)}
    io = [IOSpec(n, i, a.shape, a.dtype.name, parse_spec(specs[n], mesh, a.ndim))
          for i, (n, a) in enumerate(originals.items())]
    program = SPMDProgram(mesh, [], io[:1], io[1:])  # one input, one output: both are looked up
    path = str(tmp_path / "ckpt")

    def body(comm):
        save_checkpoint(path, local_blocks(comm.Get_rank(), mesh, specs, originals), program, comm=comm)
        return load_checkpoint(path, mesh, program, comm=comm)

    assert_bit_identical(assemble(run_simulated(4, body), mesh, specs, originals), originals)


# ---------------------------------------------------------------- errors

def load_error(path, mesh, specs=None):
    with pytest.raises(CheckpointError) as info:
        load(path, mesh, specs)
    return str(info.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("saved") / "ckpt")
    save(path)
    return path


def test_missing_directory(tmp_path):
    msg = load_error(str(tmp_path / "nope"), Mesh((2,), ("d",)))
    assert "needs an existing checkpoint directory; got no" in msg and "rank(s) [0, 1]" in msg
    os.mkdir(tmp_path / "empty")
    assert "must hold checkpoint.json; got none" in load_error(str(tmp_path / "empty"), Mesh((1,), ("d",)))


@pytest.mark.parametrize("specs,match", [
    ({"nope": ("d",)}, r"must name tensors of the checkpoint .*; got unknown name\(s\) \['nope'\]"),
    ({"v": ("d", None)}, r"one entry per dim of tensor 'v' .*; got 2 entries"),
    ({"v": ("zz",)}, r"mesh axis must be one of \('d',\); got 'zz'"),
    ({"v": Sharding(((),), partial=("d",))}, r"must hold final values .*; got tensor 'v'"),
])
def test_bad_load_specs(saved, specs, match):
    assert re.search(match, load_error(saved, Mesh((2,), ("d",)), specs))


def test_version_mismatch(tmp_path, saved):
    path = str(tmp_path / "copy")
    shutil.copytree(saved, path)
    meta = checkpoint_info(path)
    meta["version"] = 99
    with open(os.path.join(path, "checkpoint.json"), "w") as f:
        json.dump(meta, f)
    assert "version 1; got 'spmd_runtime.checkpoint' version 99" in load_error(path, Mesh((1,), ("d",)))
    with pytest.raises(ValueError, match="version 99"):
        checkpoint_info(path)


def save_error(path, mesh, tensors_for_rank, entries):
    def body(comm):
        try:
            save_checkpoint(path, tensors_for_rank(comm.Get_rank()), entries, mesh, comm=comm)
        except CheckpointError as e:
            return str(e)

    errors = run_simulated(mesh.size, body)
    assert all(e is not None for e in errors)  # every rank raised
    assert not os.path.exists(path) and siblings(path) == []
    return errors[0]


def test_save_errors(tmp_path):
    mesh = Mesh((2,), ("d",))
    path = str(tmp_path / "ckpt")
    x = np.arange(5.0)
    good = lambda r: {"x": x[true_slices((5,), ("d",), mesh, r)]}  # noqa: E731
    msg = save_error(path, mesh, good, {})
    assert "got errors on rank(s) [0, 1]: KeyError" in msg and "got none for 'x'" in msg
    assert "true shard shape (2,) or the padded (3,); got shape (1,)" in save_error(
        path, mesh, lambda r: {"x": x[:3] if r == 0 else x[4:]}, {"x": ((5,), ("d",))})
    msg = save_error(path, mesh, lambda r: {"x": x[:3].astype(np.float32 if r else np.float64)}, {"x": ((5,), ("d",))})
    assert "same tensor names, global shapes, dtypes" in msg and "rank(s) [1]" in msg
    assert "no Python objects" in save_error(path, mesh, lambda r: {"x": np.array([None] * 3)}, {"x": ((5,), ("d",))})


def test_save_refuses_to_replace_a_non_checkpoint_directory(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    (path / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="replaces only an earlier checkpoint"):
        save(str(path))
    assert (path / "precious.txt").read_text() == "keep me"


def test_blocks_match_the_runtime_layout(tmp_path):
    """Blocks from ``exec.shard`` (padded, as run_local takes them) save, and load as ``exec.shard`` would cut them."""
    from spmd_runtime.exec import shard

    x = ORIG["u"]
    path = str(tmp_path / "ckpt")
    saved = parse_spec((("x", "y"), None), SAVE_MESH, 2)
    run_simulated(8, lambda comm: save_checkpoint(path, {"u": shard(x, saved, SAVE_MESH, comm.Get_rank(), pad=True)},
                                                  {"u": (x.shape, saved)}, SAVE_MESH, comm=comm))
    mesh = Mesh((3, 2), ("p", "q"))
    wanted = parse_spec(("q", "p"), mesh, 2)
    got = run_simulated(6, lambda comm: load_checkpoint(path, mesh, {"u": wanted}, comm=comm)["u"])
    for rank, block in enumerate(got):
        assert block.tobytes() == shard(x, wanted, mesh, rank).tobytes(), rank


# ---------------------------------------------------------------- integrity (issue 9)

def _flip_one_data_byte(file):
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x01  # the last byte is data, never the header
    file.write_bytes(bytes(raw))


def test_flipped_data_byte_fails_on_every_rank_naming_the_block(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    _flip_one_data_byte(path / "v.2.npy")
    msg = load_error(str(path), Mesh((2,), ("x",)))
    assert "block file v.2.npy of 'v' must match its crc32" in msg
    # the check can be switched off: the flipped byte then loads (the caller asked for speed over safety)
    got = run_simulated(2, lambda comm: load_checkpoint(str(path), Mesh((2,), ("x",)), comm=comm, verify=False))
    assert not np.array_equal(got[0]["v"], ORIG["v"])


def test_block_checksums_are_recorded_in_the_metadata(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    import zlib
    for name, entry in checkpoint_info(str(path))["tensors"].items():
        for blk in entry["blocks"]:
            data = np.load(path / blk["file"])
            assert blk["crc32"] == zlib.crc32(np.ascontiguousarray(data).tobytes()), (name, blk["file"])


def test_symlinked_block_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    target = tmp_path / "elsewhere.npy"
    shutil.copy(path / "r.0.0.npy", target)
    os.remove(path / "r.0.0.npy")
    os.symlink(target, path / "r.0.0.npy")
    assert "must be a regular file, not a symlink; got r.0.0.npy of 'r'" in load_error(str(path), SAVE_MESH)


def test_corrupt_npy_header_says_so(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    raw = (path / "s.npy").read_bytes()
    assert b"'descr': '<f8'" in raw
    for corrupt in (raw.replace(b"'<f8'", b"'|O' "), raw[:12] + b"#####" + raw[17:]):  # object dtype; garbage
        (path / "s.npy").write_bytes(corrupt)
        msg = load_error(str(path), SAVE_MESH)
        assert "block file s.npy of 's' must be a readable .npy file" in msg and "corrupt header" in msg


def test_expected_shapes_fail_naming_each_mismatched_tensor_unless_not_strict(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    mesh = Mesh((2,), ("x",))
    expect = {n: (a.shape, a.dtype) for n, a in ORIG.items() if n not in ("u", "mask")}
    expect["w"] = ((10, 7), np.float32)           # another width
    expect["extra"] = ((3,), np.float64)          # the model has a tensor the checkpoint lacks
    with pytest.raises(CheckpointError) as info:
        run_simulated(2, lambda comm: load_checkpoint(str(path), mesh, comm=comm, expect=expect))
    msg = str(info.value)
    assert "got 4 mismatched tensor(s)" in msg
    assert "'w': stored float32[10, 6], the model needs float32[10, 7]" in msg
    assert "'u': stored, but the model has no such tensor" in msg and "'mask': stored" in msg
    assert "'extra': needed by the model, not in the checkpoint" in msg
    got = run_simulated(2, lambda comm: load_checkpoint(str(path), mesh, comm=comm, expect=expect, strict=False))
    assert sorted(got[0]) == sorted(n for n in ORIG if n not in ("u", "mask", "w"))
    assert np.array_equal(got[1]["v"], ORIG["v"])


# ---------------------------------------------------------------- nothing trusted (issue 30)

def edit_metadata(path, edit):
    meta = checkpoint_info(str(path))
    edit(meta["tensors"])
    with open(os.path.join(path, "checkpoint.json"), "w") as f:
        json.dump(meta, f)


def test_block_without_crc_is_refused_unless_verification_is_off(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    save(str(path))
    edit_metadata(path, lambda t: t["v"]["blocks"][2].pop("crc32"))
    msg = load_error(str(path), Mesh((2,), ("x",)))
    assert "every block needs its crc32 in checkpoint.json to be verified" in msg
    assert "got none for block file v.2.npy of 'v'" in msg
    mesh = Mesh((2,), ("x",))
    got = run_simulated(2, lambda comm: load_checkpoint(str(path), mesh, comm=comm, verify=False))
    assert_bit_identical(assemble(got, mesh, {}))  # asked for explicitly: loads unverified
    monkeypatch.setenv("SPMD_CHECKPOINT_VERIFY", "0")
    assert_bit_identical(assemble(load(str(path), mesh), mesh, {}))


@pytest.mark.parametrize("edit,match", [
    # block 3 ([9:10]) replaced by a second copy of block 2 ([6:9]): the element count still adds up to 10
    (lambda t: t["v"]["blocks"].__setitem__(3, dict(t["v"]["blocks"][2], shape=[1])),
     r"the blocks of 'v' must tile its shape \[10\] exactly once; got blocks v\.2\.npy and v\.2\.npy both covering "
     r"\[6:7\]"),
    (lambda t: t["w"]["blocks"].append(dict(t["w"]["blocks"][0])),
     r"the blocks of 'w' must tile its shape \[10, 6\] exactly once; got blocks w\.0\.0\.npy and w\.0\.0\.npy both "
     r"covering \[0:5, 0:2\]"),
    (lambda t: t["v"]["blocks"].pop(3),
     r"the blocks of 'v' must tile its shape \[10\] exactly once; got \[9:10\] covered by no block \(1 of 10 "
     r"elements missing\)"),
    (lambda t: t["w"]["blocks"].pop(4),
     r"the blocks of 'w' must tile its shape \[10, 6\] exactly once; got \[5:10, 2:4\] covered by no block \(10 of 60"),
    (lambda t: t["s"]["blocks"].pop(0), r"the blocks of 's' must tile its shape \[\] exactly once; got the scalar"),
    (lambda t: t["v"]["blocks"][3].update(offset=[10]),
     r"each block of 'v' must be non-empty and lie inside its shape \[10\]; got block v\.3\.npy at \[10:11\]"),
    (lambda t: t["v"]["blocks"][0].update(file="../v.0.npy"), r"must be a plain file name; got '\.\./v\.0\.npy'"),
])
def test_metadata_must_tile_each_tensor_exactly_once(tmp_path, edit, match):
    path = tmp_path / "ckpt"
    save(str(path))
    edit_metadata(path, edit)
    for verify in (True, False):  # a structural check, not part of the crc verification
        with pytest.raises(CheckpointError, match=match):
            run_simulated(2, lambda comm: load_checkpoint(str(path), Mesh((2,), ("x",)), comm=comm, verify=verify))


def test_symlinked_metadata_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    os.rename(path / "checkpoint.json", tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", path / "checkpoint.json")
    msg = load_error(str(path), Mesh((2,), ("x",)))
    assert "a checkpoint's checkpoint.json must be a regular file, not a symlink; got checkpoint.json ->" in msg
    with pytest.raises(ValueError, match="not a symlink"):
        checkpoint_info(str(path))


def test_hard_linked_block_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path))
    os.link(path / "r.0.0.npy", tmp_path / "other-name.npy")  # the same file, writable from elsewhere
    msg = load_error(str(path), Mesh((2,), ("x",)))
    assert "a block file must have a single link, not be a hard link (copy the file in instead); got r.0.0.npy " \
           "of 'r' with 2 links" in msg
    os.remove(tmp_path / "other-name.npy")
    mesh = Mesh((2,), ("x",))
    assert_bit_identical(assemble(load(str(path), mesh), mesh, {}))


def test_save_keeps_user_files_inside_and_user_directories_beside_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save(str(path), step=1)
    (path / "notes.txt").write_text("mine")
    (path / "plots").mkdir()
    (path / "plots" / "loss.png").write_text("png")
    lookalikes = [tmp_path / "ckpt.old-backup", tmp_path / f"ckpt.tmp-{'ab' * 16}", tmp_path / f"ckpt.old-{'cd' * 16}"]
    for d in lookalikes:  # named like a save's temporaries, but not marked by one
        shutil.copytree(path, d)
    (lookalikes[2] / ".spmd_checkpoint_save.json").write_text(json.dumps(
        {"format": "spmd_runtime.checkpoint", "save": "ef" * 16, "files": ["notes.txt"]}))  # another save's id
    before = {d: sorted(os.listdir(d)) for d in lookalikes}
    leftover = tmp_path / f"ckpt.tmp-{'12' * 16}"  # a killed save's, marked as such: it goes
    leftover.mkdir()
    (leftover / "v.0.npy").write_bytes(b"partial")
    (leftover / ".spmd_checkpoint_save.json").write_text(json.dumps(
        {"format": "spmd_runtime.checkpoint", "save": "12" * 16, "files": ["v.0.npy", "checkpoint.json"]}))
    newer = {n: (a + 1 if a.dtype != bool else ~a) for n, a in ORIG.items()}
    save(str(path), originals=newer, step=2)
    assert checkpoint_info(str(path))["step"] == 2
    assert (path / "notes.txt").read_text() == "mine" and (path / "plots" / "loss.png").read_text() == "png"
    assert {d: sorted(os.listdir(d)) for d in lookalikes} == before
    assert siblings(str(path)) == sorted(d.name for d in lookalikes)  # the save's own and the marked one are gone
    mesh = Mesh((2,), ("d",))
    assert_bit_identical(assemble(load(str(path), mesh), mesh, {}, newer), newer)


def test_save_does_not_write_over_a_user_file_the_old_metadata_does_not_list(tmp_path):
    path = tmp_path / "ckpt"
    originals = {"w": ORIG["w"]}
    save(str(path), originals=originals, specs={"w": SAVE_SPECS["w"]})
    (path / "v.0.npy").write_text("not a block of this checkpoint")
    with pytest.raises(CheckpointError, match=r"must not write over them; got \['v\.0\.npy'\] there"):
        save(str(path))
    assert (path / "v.0.npy").read_text() == "not a block of this checkpoint" and siblings(str(path)) == []


def test_replicated_value_differing_on_one_rank_is_refused_at_save(tmp_path):
    path = str(tmp_path / "ckpt")
    save(path, step=1)

    def odd_copies(rank, mesh, specs, originals):
        blocks = local_blocks(rank, mesh, specs, originals)
        if rank == 6:  # (x=1, y=2): holds all of r, and v's block 2 (v is split over y, replicated over x)
            blocks["r"] = blocks["r"].copy()
            blocks["r"][0, 0] += 1
            blocks["v"] = -blocks["v"]
        return blocks

    errors = run_simulated(8, lambda comm: _save_error(path, comm, odd_copies))
    assert len(set(errors)) == 1, errors  # one error, alike on every rank
    msg = errors[0]
    assert msg.startswith("save_checkpoint needs every copy of a replicated tensor to be bit-identical on the ranks "
                          "holding it (one copy is written, the others would be dropped); got ")
    assert "'r' block [0, 0] (replicated over ('x', 'y')) differs on rank(s) [6] from rank 0's copy" in msg
    assert "'v' block [2] (replicated over ('x',)) differs on rank(s) [6] from rank 2's copy" in msg
    assert "ranks holding it: [2, 6]" in msg and "'w'" not in msg
    assert checkpoint_info(path)["step"] == 1 and siblings(path) == []


def _save_error(path, comm, blocks):
    entries = {n: (a.shape, SAVE_SPECS[n]) for n, a in ORIG.items()}
    try:
        save_checkpoint(path, blocks(comm.Get_rank(), SAVE_MESH, SAVE_SPECS, ORIG), entries, SAVE_MESH, comm=comm,
                        step=2)
    except CheckpointError as e:
        assert e.ranks == [6]
        return str(e)
    return None


def test_save_through_a_symlinked_directory_replaces_its_target(tmp_path):
    (tmp_path / "scratch").mkdir()
    os.symlink(tmp_path / "scratch" / "ckpt", tmp_path / "ckpt")  # dangling until the first save
    path = str(tmp_path / "ckpt")
    save(path, step=1)
    save(path, step=2)
    assert os.path.islink(path) and checkpoint_info(path)["step"] == 2
    assert sorted(os.listdir(tmp_path / "scratch")) == ["ckpt"]
    mesh = Mesh((2,), ("d",))
    assert_bit_identical(assemble(load(path, mesh), mesh, {}))
