"""Sharded checkpoints under real MPI, for any world size.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_checkpoint_mpi.py -p no:cacheprovider``.
Rank 0 makes the checkpoint directory and broadcasts its path (every rank must
see the same files). Each rank saves its own blocks, loads under other meshes
and shardings, and the blocks are all-gathered to rebuild the global arrays;
assertions come after all collectives so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime import Mesh, parse_spec
from spmd_runtime.checkpoint import CheckpointError, checkpoint_info, load_checkpoint, save_checkpoint
from spmd_runtime.exec import block_slices

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()


def save_mesh() -> Mesh:
    """The most square 2-d mesh for N ranks, or (N,) when N is 1 or prime."""
    a = max(d for d in range(1, N + 1) if N % d == 0 and d * d <= N)
    return Mesh((N,), ("x",)) if a == 1 else Mesh((a, N // a), ("x", "y"))


SAVE_MESH = save_mesh()
ALL = tuple(SAVE_MESH.axis_names)
ORIG = {
    "w": np.random.default_rng(1).standard_normal((10, 7)).astype(np.float32),
    "v": np.arange(13, dtype=np.int64) * 3 - 7,     # 13 over every rank: uneven (or empty) trailing blocks
    "r": np.random.default_rng(2).integers(0, 9, (3, 2)).astype(np.int16),
    "s": np.array(-1.25),
}
SAVE_SPECS = {"w": (ALL[0], ALL[-1] if len(ALL) > 1 else None), "v": (ALL,), "r": (None, None), "s": ()}


def true_slices(shape, spec, mesh, rank):
    return block_slices(shape, parse_spec(spec, mesh, len(shape)), mesh, rank)


@pytest.fixture
def shared_dir():
    """A directory every rank sees: rank 0 makes it and broadcasts its path."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="spmd_ckpt_") if WORLD.Get_rank() == 0 else None, root=0)
    yield os.path.join(path, "ckpt")
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def save(path, step=None):
    rank = WORLD.Get_rank()
    blocks = {n: a[true_slices(a.shape, SAVE_SPECS[n], SAVE_MESH, rank)] for n, a in ORIG.items()}
    entries = {n: (a.shape, SAVE_SPECS[n]) for n, a in ORIG.items()}
    save_checkpoint(path, blocks, entries, SAVE_MESH, step=step)


def rebuild(local: dict, mesh: Mesh, specs: dict) -> dict:
    """Global arrays from every rank's block (all-gathered); replicas must agree."""
    everyone = WORLD.allgather(local)
    out = {}
    for name, orig in ORIG.items():
        spec = specs.get(name, (None,) * orig.ndim)
        glob, seen, ok = np.zeros_like(orig), np.zeros(orig.shape, bool), True
        for rank, blocks in enumerate(everyone):
            where = true_slices(orig.shape, spec, mesh, rank)
            ok &= blocks[name].shape == glob[where].shape and blocks[name].dtype == orig.dtype
            if ok and seen[where].any():
                ok &= blocks[name].tobytes() == glob[where].tobytes()
            if ok:
                glob[where], seen[where] = blocks[name], True
        out[name] = (glob if ok and seen.all() else None)
    return out


def assert_identical(rebuilt):
    for name, orig in ORIG.items():
        got = rebuilt[name]
        assert got is not None, f"{name}: blocks of the wrong shape, disagreeing replicas, or a gap"
        assert got.dtype == orig.dtype and got.tobytes() == orig.tobytes(), name


LOADS = [
    pytest.param(Mesh((N,), ("d",)), {"w": ("d", None), "v": ("d",), "r": (None, "d")}, id="1d-sharded"),
    pytest.param(Mesh((N,), ("d",)), {"w": (None, "d")}, id="1d-columns"),
    pytest.param(Mesh((N,), ("d",)), {}, id="replicated"),
    pytest.param(Mesh(SAVE_MESH.shape, SAVE_MESH.axis_names, tuple(reversed(range(N)))),
                 {"w": (ALL[-1], ALL[0]) if len(ALL) > 1 else ("x", None), "v": (ALL[::-1],)}, id="reordered"),
]


@pytest.mark.parametrize("mesh,specs", LOADS)
def test_save_then_load_elsewhere_is_bit_identical(shared_dir, mesh, specs):
    save(shared_dir, step=11)
    local = load_checkpoint(shared_dir, mesh, specs)
    info = checkpoint_info(shared_dir)
    files = sorted(f for f in os.listdir(shared_dir) if f.endswith(".npy"))
    assert_identical(rebuild(local, mesh, specs))
    assert info["step"] == 11 and Mesh.from_json(info["mesh"]) == SAVE_MESH
    assert files == sorted(b["file"] for t in info["tensors"].values() for b in t["blocks"])
    assert len(info["tensors"]["r"]["blocks"]) == len(info["tensors"]["s"]["blocks"]) == 1
    assert len(info["tensors"]["v"]["blocks"]) == -(-13 // -(-13 // N))  # non-empty only: 13 over 8 -> 7 of 2


def test_failure_on_one_rank_raises_everywhere_and_keeps_previous(shared_dir):
    save(shared_dir, step=1)
    rank = WORLD.Get_rank()
    bad = {"s": np.zeros(3) if rank == N - 1 else np.array(0.0)}  # the last rank passes the wrong shape
    with pytest.raises(CheckpointError, match=rf"rank\(s\) \[{N - 1}\]"):
        save_checkpoint(shared_dir, bad, {"s": ((), ())}, SAVE_MESH, step=2)
    local = load_checkpoint(shared_dir, Mesh((N,), ("d",)), {})
    assert checkpoint_info(shared_dir)["step"] == 1
    assert_identical(rebuild(local, Mesh((N,), ("d",)), {}))


@pytest.mark.skipif(N < 2, reason="a replicated copy can differ only between two ranks")
def test_replicated_value_differing_on_one_rank_is_refused_everywhere(shared_dir):
    """The last rank's copy of the replicated ``r`` differs (it would not be written, so it would be dropped):
    every rank raises one error naming ``r`` and that rank, and the previous checkpoint stays."""
    save(shared_dir, step=1)
    rank = WORLD.Get_rank()
    blocks = {n: a[true_slices(a.shape, SAVE_SPECS[n], SAVE_MESH, rank)].copy() for n, a in ORIG.items()}
    if rank == N - 1:
        blocks["r"][-1, -1] += 1
    entries = {n: (a.shape, SAVE_SPECS[n]) for n, a in ORIG.items()}
    try:
        save_checkpoint(shared_dir, blocks, entries, SAVE_MESH, step=2)
        error = None
    except CheckpointError as e:
        error = (str(e), e.ranks)
    everyone = WORLD.allgather(error)
    info = checkpoint_info(shared_dir)
    leftovers = sorted(os.listdir(os.path.dirname(shared_dir)))
    assert all(e == everyone[0] for e in everyone), everyone  # one error, alike on every rank
    msg, ranks = everyone[0]
    assert f"'r' block [0, 0] (replicated over {ALL}) differs on rank(s) [{N - 1}] from rank 0's copy" in msg, msg
    assert ranks == [N - 1] and "'w'" not in msg and "'v'" not in msg
    assert info["step"] == 1 and leftovers == ["ckpt"]
