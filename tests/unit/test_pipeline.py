"""GSPMD pipelining (simulated world): outputs and gradients equal the sequential stages, the per-iteration
shift is ONE collective_permute of one stage's state, and bad stage setups fail clearly."""
import inspect

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from simulated import run_everywhere

S, M, B, D = 4, 3, 2, 5


def stages(w, x):  # every stage at once: x [S, B, D], w [S, D, D]
    return snp.tanh(snp.einsum("sbd,sde->sbe", x, w))


def sequential(w, xs):
    out = []
    for x in xs:
        for s in range(len(w)):
            x = np.tanh(x @ w[s])
        out.append(x)
    return np.array(out)


def program(mesh, policy=None):
    def loss(w, xs):
        y = sr.pipeline(stages, w, xs, mesh=mesh, policy=policy)
        return snp.sum(y * y), y

    def f(w, xs):
        (value, y), grad = sr.value_and_grad(loss, 0, has_aux=True)(w, xs)
        return value, y, grad
    f.__signature__ = inspect.signature(loss)
    args = [0.5 * np.random.default_rng(0).standard_normal((S, D, D)),
            np.random.default_rng(1).standard_normal((M, B, D))]
    graph = sr.trace(f, *args)
    return graph, sr.partition(graph, mesh), args


@pytest.mark.parametrize("shape,axes,policy", [((2,), ("stage",), None), ((4,), ("stage",), "nothing_saveable"),
                                               ((2, 2), ("stage", "data"), None),
                                               ((4, 2), ("stage", "data"), None)], ids=str)
def test_pipeline_matches_sequential_stages_and_reference_gradients(shape, axes, policy):
    graph, prog, args = program(sr.Mesh(shape, axes), policy)
    want = sr.evaluate(graph, *args)
    np.testing.assert_allclose(want[1], sequential(*args), rtol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


def test_shift_is_one_collective_permute_of_one_stage_per_iteration():
    mesh = sr.Mesh((4,), ("stage",))
    _, prog, _ = program(mesh)
    forward = next(i for i in prog.instrs if i.op == "scan")
    comm = forward.attrs["body"].comm_summary()
    assert [c["kind"] for c in comm] == ["collective_permute"]
    assert comm[0]["bytes_in"] == B * D * 8  # one stage's state: each rank holds its own stage
    assert forward.attrs["length"] == M + S - 1
    # forward and backward loops each move one shift per iteration, nothing else (the unread cotangent of
    # the micro-batches is left out of the backward loop)
    assert [(c["kind"], c["trips"]) for c in prog.comm_summary() if c.get("trips")] == \
        [("collective_permute", M + S - 1)] * 2
    assert prog.inputs[0].sharding.dims[0] == ("stage",)  # each rank holds its stage's parameters


@pytest.mark.parametrize("mesh,stages_,message", [
    (sr.Mesh((2,), ("data",)), S, "mesh axis 'stage', which must be an axis of the mesh"),
    (sr.Mesh((3,), ("stage",)), S, "stage count to be a multiple of the 'stage' axis size; got 4 stages on 3"),
])
def test_bad_stage_setups_raise(mesh, stages_, message):
    with pytest.raises(ValueError, match=message):
        sr.trace(lambda w, x: sr.pipeline(stages, w, x, mesh=mesh), sr.TensorSpec((stages_, D, D)),
                 sr.TensorSpec((M, B, D)))
