"""Pending sums combined before they are reduced, under real MPI (written for 4 ranks; any world size runs):
Megatron's Q, K and V input cotangents summed pending and all-reduced once, an accumulator completed once after its
loop, and the training step with gradients accumulated over micro-batches (reduced once per step) equal to the
plain step.

Run: ``mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_pending_sums_mpi.py -p no:cacheprovider``.
Assertions come after all collectives so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.exec.backend import to_host
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step_on_root, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()


def qkv_input_cotangent(g1, g2, g3, w1, w2, w3):
    return g1 @ w1.T + g2 @ w2.T + g3 @ w3.T


def accumulated(xs, w):
    return sr.scan(lambda acc, x: (acc + x @ w, None), snp.zeros((xs.shape[1], w.shape[1]), xs.dtype), xs)[0]


@pytest.mark.parametrize("fn,shapes,specs", [
    (qkv_input_cotangent, [(6, 4 * N)] * 3 + [(5, 4 * N)] * 3, [(None, "x")] * 6),
    (accumulated, [(3, 4, 2 * N + 1), (2 * N + 1, 6)], [(None, None, "x"), ("x", None)]),  # uneven contraction
], ids=["qkv", "accumulator"])
def test_one_all_reduce_and_the_reference_values(fn, shapes, specs):
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s) for s in shapes]
    graph = sr.trace(fn, *args)
    program = sr.partition(graph, sr.Mesh((N,), ("x",)), in_specs=specs)
    got = to_host(sr.run(program, *args, comm=WORLD)[0])
    want = sr.evaluate(graph, *args)[0]
    summary = program.comm_summary()
    assert [(c["kind"], c.get("trips", 1)) for c in summary] == ([("all_reduce", 1)] if N > 1 else [])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=4 * N, dtype="float64")


@pytest.mark.parametrize("preset", ["megatron", "megatron_wus"])
def test_accumulated_step_reduces_once_and_equals_the_plain_step(preset):
    shape = (2, N // 2) if N % 2 == 0 and N > 2 else (N,)
    mesh = train_mesh(shape, preset)
    plain = build_train_step_on_root(CFG, mesh, preset, AdamW(lr=1e-2), WORLD)
    accumulated_step = build_train_step_on_root(CFG, mesh, preset, AdamW(lr=1e-2), WORLD, microbatches=2)
    state = plain.init(seed=2)
    rng = np.random.default_rng(1)
    tokens, labels = (rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)) for _ in range(2))
    results = []
    for ts in (plain, accumulated_step):
        local, loss = ts.step(ts.shard_state(state, WORLD.Get_rank()), tokens, labels, comm=WORLD)
        results.append((ts.named(ts.gather(local, WORLD)), loss))
    (want, want_loss), (got, got_loss) = results
    data = [c for c in accumulated_step.program.comm_summary()
            if "data" in c["axes"] and c["kind"] in ("all_reduce", "reduce_scatter")]
    assert all(c.get("trips", 1) == 1 for c in data), "a data-parallel reduction ran inside the micro-batch loop"
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)
