"""Pipelines under real MPI: ``sr.pipeline_loss`` with the 1F1B and interleaved schedules gives GPipe's loss and
every gradient (stages, head, micro-batches), all equal to the hand-written NumPy backward, on a ("stage",) mesh of the world
size and, at 8 ranks, a (stage=4, data=2) mesh; GPipe's backward holds its output cotangent split over the
stages (one stage's share per rank)."""
import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.exec.backend import to_host

from pipeline_cases import B, D, loss_program, numpy_loss_and_grads

N = MPI.COMM_WORLD.Get_size()
MESHES = [((N,), ("stage",), N, 2 * N)] + ([((4, 2), ("stage", "data"), 4, 6)] if N == 8 else [])


@pytest.mark.mpi
@pytest.mark.skipif(N < 2, reason="a pipeline needs 2 or more ranks")
@pytest.mark.parametrize("shape,axes,s,m", MESHES, ids=str)
def test_one_f_one_b_equals_gpipe_and_numpy(shape, axes, s, m):
    mesh = sr.Mesh(shape, axes)
    results = {}
    for schedule in ("1f1b", "gpipe"):
        _, program, args = loss_program(mesh, schedule, s, m)
        results[schedule] = [to_host(g) for g in sr.run(program, *args)]
    want = numpy_loss_and_grads(*args)
    assert len(want) == 4
    for one_f, gpipe, w in zip(results["1f1b"], results["gpipe"], want):
        np.testing.assert_allclose(one_f, w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gpipe, w, rtol=1e-10, atol=1e-12)
    # interleaved: 2 S stages, device j holding j and j + S (GPipe runs the same 2 S stages blocked two a device)
    for schedule in ("interleaved", "gpipe"):
        _, program, args2 = loss_program(mesh, schedule, 2 * shape[0], 2 * shape[0])
        results[schedule] = [to_host(g) for g in sr.run(program, *args2)]
    for inter, gpipe, w in zip(results["interleaved"], results["gpipe"], numpy_loss_and_grads(*args2)):
        np.testing.assert_allclose(inter, w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gpipe, w, rtol=1e-10, atol=1e-12)
    gathered = MPI.COMM_WORLD.allgather(float(results["1f1b"][0]))
    assert np.allclose(gathered, gathered[0], rtol=0, atol=0)  # every rank returns the same loss


@pytest.mark.mpi
@pytest.mark.skipif(N < 2, reason="a pipeline needs 2 or more ranks")
def test_gpipe_output_cotangent_is_one_stage_per_rank():
    mesh = sr.Mesh((N,), ("stage",))
    _, program, _ = loss_program(mesh, "gpipe", N, 3)
    t = 3 + N - 1
    pads = [i for i in program.instrs if tuple(i.global_shape) == (t, N, B, D) and i.op == "pad"]
    assert pads and all(tuple(i.shape) == (t, 1, B, D) for i in pads)


PIPE_CFG = sr.LMConfig(layers=4, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")


@pytest.mark.mpi
@pytest.mark.skipif(N != 8, reason="the pipeline meshes (stage=2, data=2, model=2) and (stage=4, data=2) need 8 ranks")
@pytest.mark.parametrize("shape,microbatches", [((2, 2, 2), 2), ((4, 2), 4)], ids=["2x2x2", "4x2"])
def test_pipeline_1f1b_preset_trains_like_the_gpipe_preset(shape, microbatches):
    """Three steps of the 1F1B preset give the GPipe preset's losses and every parameter and optimizer slot."""
    world, opt = MPI.COMM_WORLD, sr.AdamW(lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(3)
    batch = tuple(rng.integers(0, PIPE_CFG.vocab, (PIPE_CFG.batch, PIPE_CFG.seq)).astype("int32") for _ in range(2))
    results = []
    for preset in ("pipeline", "pipeline_1f1b"):
        ts = sr.build_train_step_on_root(PIPE_CFG, sr.train_mesh(shape, preset), preset, opt, world, microbatches)
        local, losses = ts.shard_state(ts.init(seed=1), world.Get_rank()), []
        for _ in range(3):
            local, loss = ts.step(local, *batch, comm=world)
            losses.append(loss)
        results.append((ts.named(ts.gather(local, world)), losses))
    (gpipe, gpipe_losses), (one_f, one_f_losses) = results
    np.testing.assert_allclose(one_f_losses, gpipe_losses, rtol=1e-12)
    assert gpipe_losses[2] < gpipe_losses[0]
    assert len(gpipe) > 20
    for name, want in gpipe.items():
        np.testing.assert_allclose(one_f[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
