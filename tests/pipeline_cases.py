"""The pipeline_loss cases shared by tests/unit/test_pipeline_1f1b.py and tests/mpi/test_pipeline_mpi.py: S tanh
stages and a linear head with a squared loss, differentiated in the stages, the head and the micro-batches, and
the same loss and gradients written out by hand in NumPy."""
import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp

B, D, H = 2, 5, 3


def stages(w, x):  # every stage at once: x [S, B, D], w [S, D, D]
    return snp.tanh(snp.einsum("sbd,sde->sbe", x, w))


def head_loss(v, y, t):  # the head on one micro-batch's output [B, D], against targets [B, H]
    return snp.sum((y @ v - t) ** 2)


def loss_program(mesh, schedule, s, m, rows=B):
    """``rows`` per micro-batch, split over mesh axis "data" where the mesh has one (uneven when it does not
    divide them)."""
    state_spec = ("data", None) if "data" in mesh.axis_names else None

    def f(w, v, xs, ts):
        loss = lambda w, v, xs: sr.pipeline_loss(stages, w, xs, head_loss, v, ts, mesh=mesh, schedule=schedule,
                                                 state_spec=state_spec)
        value, grads = sr.value_and_grad(loss, (0, 1, 2))(w, v, xs)
        return (value,) + grads
    rng = np.random.default_rng(0)
    args = [0.5 * rng.standard_normal((s, D, D)), rng.standard_normal((D, H)), rng.standard_normal((m, rows, D)),
            rng.standard_normal((m, rows, H))]
    graph = sr.trace(f, *args)
    return graph, sr.partition(graph, mesh), args


def numpy_loss_and_grads(w, v, xs, ts):
    """By hand: the stages in sequence, then the head, and the backward pass written out."""
    loss, gw, gv, gx = 0.0, np.zeros_like(w), np.zeros_like(v), np.zeros_like(xs)
    for m, (x, t) in enumerate(zip(xs, ts)):
        acts = [x]
        for s in range(len(w)):
            acts.append(np.tanh(acts[-1] @ w[s]))
        r = acts[-1] @ v - t
        loss += np.sum(r * r)
        gv += acts[-1].T @ (2 * r)
        g = (2 * r) @ v.T
        for s in reversed(range(len(w))):
            g = g * (1 - acts[s + 1] ** 2)
            gw[s] += acts[s].T @ g
            g = g @ w[s].T
        gx[m] = g
    return [loss, gw, gv, gx]


def input_loss_program(mesh, schedule, s, m, rows=B, din=4):
    """``loss_program`` with the micro-batches made inside the pipeline (``input_fn``: a linear map of [.., din] raw
    inputs, differentiated in its weight) and the head on every stage's output at once (``head_over_stages``)."""
    state_spec = ("data", None) if "data" in mesh.axis_names else None

    def per_stage_head(v, ys, ts):  # ys [S, B, D], ts [S, B, H] -> [S]
        return snp.sum((snp.einsum("zbd,dh->zbh", ys, v) - ts) ** 2, axis=(1, 2))

    def f(w, v, e, raw, ts):
        loss = lambda w, v, e: sr.pipeline_loss(stages, w, raw, per_stage_head, v, ts, mesh=mesh, schedule=schedule,
                                                state_spec=state_spec, input_fn=lambda e, x: x @ e, input_params=e,
                                                head_over_stages=True)
        value, grads = sr.value_and_grad(loss, (0, 1, 2))(w, v, e)
        return (value,) + grads
    rng = np.random.default_rng(1)
    args = [0.5 * rng.standard_normal((s, D, D)), rng.standard_normal((D, H)), rng.standard_normal((din, D)),
            rng.standard_normal((m, rows, din)), rng.standard_normal((m, rows, H))]
    graph = sr.trace(f, *args)
    return graph, sr.partition(graph, mesh), args


def numpy_input_loss_and_grads(w, v, e, raw, ts):
    """``numpy_loss_and_grads`` of the micro-batches ``raw @ e``, and the gradient of ``e`` from theirs."""
    loss, gw, gv, gx = numpy_loss_and_grads(w, v, raw @ e, ts)
    return [loss, gw, gv, np.einsum("mbi,mbd->id", raw, gx)]


def layered_loss_program(mesh, s, m, layers, rows=B, layer_fn=True):
    """``loss_program`` (1F1B) with ``layers`` tanh layers per stage, stage parameters [layers, S, D, D]: the stage
    the scan of one layer over them; ``layer_fn``: passed to ``pipeline_loss`` (saved layer inputs, the backward
    layer by layer) or not (saved stage inputs, the stage recomputed)."""
    state_spec = ("data", None) if "data" in mesh.axis_names else None
    one = lambda w, x: snp.tanh(snp.einsum("sbd,sde->sbe", x, w))
    stage = lambda w, x: sr.scan(lambda h, w_l: (one(w_l, h), None), x, w)[0]

    def f(w, v, xs, ts):
        loss = lambda w, v, xs: sr.pipeline_loss(stage, w, xs, head_loss, v, ts, mesh=mesh, stage_dim=1,
                                                 state_spec=state_spec, layer_fn=one if layer_fn else None)
        value, grads = sr.value_and_grad(loss, (0, 1, 2))(w, v, xs)
        return (value,) + grads
    rng = np.random.default_rng(2)
    args = [0.5 * rng.standard_normal((layers, s, D, D)), rng.standard_normal((D, H)),
            rng.standard_normal((m, rows, D)), rng.standard_normal((m, rows, H))]
    graph = sr.trace(f, *args)
    return graph, sr.partition(graph, mesh), args


def numpy_layered_loss_and_grads(w, v, xs, ts):
    """Stage j's layers l at global position j * layers + l."""
    layers, s = w.shape[:2]
    flat = np.transpose(w, (1, 0, 2, 3)).reshape(s * layers, D, D)
    loss, gw, gv, gx = numpy_loss_and_grads(flat, v, xs, ts)
    return [loss, np.transpose(gw.reshape(s, layers, D, D), (1, 0, 2, 3)), gv, gx]
