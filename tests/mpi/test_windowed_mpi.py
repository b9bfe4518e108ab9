"""Windowed einsum under real MPI: the rings' nonblocking permutes (Isend/Irecv, progressed by MPI_Test between
kernels) on every mesh of this world size, even and uneven, against the reference evaluator; and a training
step whose gathers and reduce-scatters became rings gives the plain step's losses. From 3 ranks up each pattern,
size and ring length runs on one mesh (2x2 at 4 ranks, one of 2x4 / 4x2 at 8) and a sample of the rest (``sample_at_large_world``, tests/mpi/conftest.py)."""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.exec.backend import to_host
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step, train_mesh

from mesh_cases import meshes_for, splits_two_axes
from windowed_cases import PATTERNS, window_axes, windowed_program

WORLD = MPI.COMM_WORLD.Get_size()
PARAMS = [pytest.param(p, m, a, n, id=f"{p}-{m}-{'.'.join(a)}-{n}") for m in meshes_for(WORLD)
          for a in window_axes(m) for n in (24, 7) for p in PATTERNS]


@pytest.mark.mpi
@pytest.mark.skipif(WORLD < 2, reason="a ring needs two ranks")
@pytest.mark.parametrize("pattern,mesh,axes,size", PARAMS)
@pytest.mark.sample_at_large_world(group=lambda pattern, mesh, axes, size: f"{pattern}-{size}-{mesh.axis_size(axes)}",
                                   specific=lambda pattern, mesh, axes, size: splits_two_axes(mesh.shape))
def test_ring_matches_reference(pattern, mesh, axes, size):
    graph, args, program = windowed_program(pattern, mesh, axes, size)
    assert "collective_permute_start" in str(program)
    (out,) = sr.run(program, *args)
    np.testing.assert_allclose(to_host(out), sr.evaluate(graph, *args)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
@pytest.mark.skipif(WORLD < 2, reason="a ring needs two ranks")
def test_windowed_training_step_gives_the_plain_losses(monkeypatch):
    cfg = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=2 * WORLD, batch=4, dtype="float64")
    rng = np.random.default_rng(0)
    feed = [(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)), rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)))
            for _ in range(2)]
    losses = {}
    for windowed in ("", "0"):
        monkeypatch.setenv("SPMD_WINDOWED_EINSUM", windowed)
        ts = build_train_step(cfg, train_mesh((WORLD,), "seq"), "seq", AdamW(lr=1e-2))
        kinds = [c["kind"] for c in ts.program.comm_summary()]
        assert ("collective_permute" in kinds) == (windowed == "0")
        local = ts.shard_state(ts.init(seed=1), MPI.COMM_WORLD.Get_rank())
        losses[windowed] = []
        for x, y in feed:
            local, loss = ts.step(local, x, y, comm=MPI.COMM_WORLD)
            losses[windowed].append(loss)
    np.testing.assert_allclose(losses["0"], losses[""], rtol=1e-12)
