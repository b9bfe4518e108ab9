"""PyTorch-layout .safetensors files in and out under real MPI, for any world size.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_weights_mpi.py -p no:cacheprovider``.
Rank 0 writes the file with safetensors' own writer and broadcasts its directory. Each process records the
slices it asks the file for (its reader wrapped): exactly its own non-empty blocks. Files we write are read
back with safetensors' own reader. Assertions come after all collectives so one failing rank cannot hang
the rest.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from spmd_runtime import Mesh  # noqa: E402
from spmd_runtime import weights  # noqa: E402
from spmd_runtime.checkpoint import load_checkpoint  # noqa: E402
from spmd_runtime.weights import (Transpose, WeightsError, checkpoint_to_safetensors, load_safetensors,  # noqa: E402
                                  safetensors_to_checkpoint, save_safetensors)

from weights_cases import bounds, recording_reader, true_slices  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
A = max(d for d in range(1, N + 1) if N % d == 0 and d * d <= N)
MESH = Mesh((N,), ("x",)) if A == 1 else Mesh((A, N // A), ("x", "y"))  # the most square mesh
LAST, ALL = MESH.axis_names[-1], tuple(MESH.axis_names)
ORIG = {
    "transformer.wte.weight": np.random.default_rng(1).standard_normal((11, 6)).astype(np.float32),
    "transformer.ln_f.bias": np.random.default_rng(2).standard_normal(13).astype(np.float16),
    "step": np.array(7, np.int64),
}
SPECS = {"transformer.wte.weight": ("x", LAST if LAST != "x" else None), "transformer.ln_f.bias": (ALL,),
         "step": ()}


@pytest.fixture
def shared_dir():
    """A directory every rank sees holding ``model.safetensors`` (written by rank 0 with safetensors itself)."""
    path = tempfile.mkdtemp(prefix="spmd_weights_") if WORLD.Get_rank() == 0 else None
    if path is not None:
        save_file(ORIG, os.path.join(path, "model.safetensors"))
    path = WORLD.bcast(path, root=0)
    yield path
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def requests(monkeypatch):
    """(file key, bounds) of every slice this process asks of the file; reading a whole tensor fails."""
    seen = []
    monkeypatch.setattr(weights, "safe_open", recording_reader(lambda key, where: seen.append((key, where))))
    return seen


def read_back(path) -> dict | None:
    """Rank 0 reads the file with safetensors' reader; every rank gets it."""
    got = None
    if WORLD.Get_rank() == 0:
        with safe_open(path, framework="numpy") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
    return WORLD.bcast(got, root=0)


def assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def test_each_rank_reads_only_its_slices_and_the_save_gives_the_file_back(shared_dir, requests):
    rank = WORLD.Get_rank()
    loaded = load_safetensors(os.path.join(shared_dir, "model.safetensors"), MESH, SPECS)
    out = os.path.join(shared_dir, "out.safetensors")
    save_safetensors(out, loaded, {n: (ORIG[n].shape, SPECS[n]) for n in loaded}, MESH)
    stored = read_back(out)
    everyone = WORLD.allgather(sorted(requests))
    for r, asked in enumerate(everyone):
        own = sorted((n, bounds(true_slices(x.shape, SPECS[n], MESH, r))) for n, x in ORIG.items()
                     if x[true_slices(x.shape, SPECS[n], MESH, r)].size)
        assert asked == own, f"rank {r} must ask the file for exactly its own blocks"
    for n, x in ORIG.items():
        want = x[true_slices(x.shape, SPECS[n], MESH, rank)]
        assert loaded[n].dtype == want.dtype and loaded[n].tobytes() == want.tobytes(), n
    assert_same_tensors(stored, ORIG)


def test_round_trip_through_a_sharded_checkpoint_onto_another_mesh(shared_dir):
    rank, path = WORLD.Get_rank(), os.path.join(shared_dir, "model.safetensors")
    ckpt, back = os.path.join(shared_dir, "ckpt"), os.path.join(shared_dir, "back.safetensors")
    safetensors_to_checkpoint(path, ckpt, MESH, SPECS, step=3)
    other = Mesh((N,), ("d",), tuple(reversed(range(N))))  # another mesh, devices reversed
    specs = {"transformer.wte.weight": (None, "d"), "transformer.ln_f.bias": ("d",)}
    blocks = load_checkpoint(ckpt, other, specs)
    checkpoint_to_safetensors(ckpt, back, other, specs)
    stored = read_back(back)
    for n, x in ORIG.items():
        want = x[true_slices(x.shape, specs.get(n, (None,) * x.ndim), other, rank)]
        assert blocks[n].tobytes() == want.tobytes(), n
    assert_same_tensors(stored, ORIG)


def test_transposed_load_and_save(shared_dir, requests):
    rank, key = WORLD.Get_rank(), "transformer.wte.weight"
    spec = (LAST, "x") if LAST != "x" else (None, "x")
    out = os.path.join(shared_dir, "t.safetensors")
    loaded = load_safetensors(os.path.join(shared_dir, "model.safetensors"), MESH, {"w": spec}, names={"w": key},
                              transforms={"w": Transpose()}, expect={"w": ((6, 11), "float32")}, strict=False)
    save_safetensors(out, loaded, {"w": ((6, 11), spec)}, MESH, names={"w": key}, transforms={"w": Transpose()})
    stored = read_back(out)
    where = true_slices((6, 11), spec, MESH, rank)
    assert loaded["w"].tobytes() == np.ascontiguousarray(ORIG[key].T[where]).tobytes()
    assert requests == ([(key, bounds(where[::-1]))] if loaded["w"].size else [])
    assert_same_tensors(stored, {key: ORIG[key]})


def test_a_mismatch_on_one_rank_fails_on_every_rank(shared_dir):
    rank = WORLD.Get_rank()
    expect = {n: (x.shape, x.dtype) for n, x in ORIG.items()}
    if rank == N - 1:
        expect["step"] = ((), "int32")
    try:
        load_safetensors(os.path.join(shared_dir, "model.safetensors"), MESH, SPECS, expect=expect)
        error = None
    except WeightsError as e:
        error = (str(e), e.ranks)
    everyone = WORLD.allgather(error)
    assert all(e is not None and e[1] == [N - 1] for e in everyone), everyone
    assert "'step': stored int64[], the model needs int32[]" in everyone[0][0]
