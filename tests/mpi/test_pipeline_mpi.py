"""Pipelines under real MPI: ``sr.pipeline_loss`` with the 1F1B schedule gives GPipe's loss and every gradient
(stages, head, micro-batches), both equal to the hand-written NumPy backward, on a ("stage",) mesh of the world
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
