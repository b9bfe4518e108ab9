"""GSPMD pipelining (simulated world): outputs and gradients equal the sequential stages, the per-iteration
shift is ONE collective_permute of one stage's state, and bad stage setups fail clearly; the LM's
``pipeline`` training preset follows the unpipelined model's loss curve and holds one stage per rank."""
import dataclasses
import inspect

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from simulated import run_everywhere, train_simulated
from spmd_runtime.optim import AdamW
from spmd_runtime.pipeline import circular_schedule
from spmd_runtime.sharding import parse_spec
from spmd_runtime.train.plan import plan_train_step

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


def program(mesh, policy=None, stage_count=S, microbatches=M, circular=False):
    def loss(w, xs):
        y = sr.pipeline(stages, w, xs, mesh=mesh, policy=policy, circular=circular)
        return snp.sum(y * y), y

    def f(w, xs):
        (value, y), grad = sr.value_and_grad(loss, 0, has_aux=True)(w, xs)
        return value, y, grad
    f.__signature__ = inspect.signature(loss)
    args = [0.5 * np.random.default_rng(0).standard_normal((stage_count, D, D)),
            np.random.default_rng(1).standard_normal((microbatches, B, D))]
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


def circular_program(mesh, v, m):
    """v stages, m micro-batches, circular schedule."""
    return program(mesh, stage_count=v, microbatches=m, circular=True)


@pytest.mark.parametrize("shape,axes,v,m", [((2,), ("stage",), 4, 4), ((2, 2), ("stage", "data"), 6, 2),
                                            ((4,), ("stage",), 8, 4)], ids=str)
def test_circular_pipeline_matches_sequential_stages_and_reference_gradients(shape, axes, v, m):
    """Each device holds V / S non-adjacent stages; micro-batches go round the devices V / S times."""
    graph, prog, args = circular_program(sr.Mesh(shape, axes), v, m)
    want = sr.evaluate(graph, *args)
    np.testing.assert_allclose(want[1], sequential(*args), rtol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


def test_circular_pipeline_runs_m_r_plus_s_minus_1_iterations_of_one_stage_each():
    """S=2 devices, V=4 stages (R=2 rounds), M=4: 9 iterations of ONE stage per device (bubble 1/9), where
    GPipe over the same 4 stages runs 7 iterations of TWO stages per device (bubble 3/7). The circular shift is
    the forward shift plus the wrap-around from the last device to the first: two collective_permutes of one
    stage's state per iteration."""
    mesh = sr.Mesh((2,), ("stage",))
    _, prog, _ = circular_program(mesh, 4, 4)
    forward = next(i for i in prog.instrs if i.op == "scan")
    assert forward.attrs["length"] == 4 * 2 + 2 - 1
    assert [(c["kind"], c["bytes_in"]) for c in forward.attrs["body"].comm_summary()] == \
        [("collective_permute", B * D * 8)] * 2
    _, gpipe, _ = program(mesh)  # S=4 stages blocked 2 per device
    assert next(i for i in gpipe.instrs if i.op == "scan").attrs["length"] == M + S - 1
    sched = circular_schedule(4, 2, 2)
    # device 0 runs stage 0 at t=0,1 (micro-batches 0,1), stage 2 at t=2,3 (their second round), ...
    assert [int(np.argmax(sched["stage_of"][t, :, 0])) for t in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert sched["fresh"].tolist() == [True, True, False, False, True, True, False, False, False]
    assert sched["exits"] == [3, 7]


def test_circular_pipeline_needs_whole_groups_of_micro_batches():
    with pytest.raises(ValueError, match="groups of the 'stage' axis size; got 3 micro-batches for 2 devices"):
        circular_program(sr.Mesh((2,), ("stage",)), 4, 3)


@pytest.mark.parametrize("mesh,stages_,message", [
    (sr.Mesh((2,), ("data",)), S, "mesh axis 'stage', which must be an axis of the mesh"),
    (sr.Mesh((3,), ("stage",)), S, "stage count to be a multiple of the 'stage' axis size; got 4 stages on 3"),
])
def test_bad_stage_setups_raise(mesh, stages_, message):
    with pytest.raises(ValueError, match=message):
        sr.trace(lambda w, x: sr.pipeline(stages, w, x, mesh=mesh), sr.TensorSpec((stages_, D, D)),
                 sr.TensorSpec((M, B, D)))


# ---------------------------------------------------------------- the LM's pipeline preset
LM = sr.LMConfig(layers=4, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")


def lm_step(shape, microbatches, cfg=LM):
    return sr.build_train_step(cfg, sr.train_mesh(shape, "pipeline"), "pipeline", AdamW(lr=1e-2),
                               microbatches=microbatches)


def lm_batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, LM.vocab, (LM.batch, LM.seq)).astype("int32") for _ in range(2)) for _ in range(n)]


def test_pipeline_preset_loss_curve_equals_the_unpipelined_model():
    """(stage=2, data=2, model=2), 2 micro-batches: three steps on 8 simulated ranks follow the loss curve and
    state of the plain scanned model's unpartitioned step (sr.evaluate)."""
    ts = lm_step((2, 2, 2), 2)
    plain = sr.build_train_step(LM, sr.train_mesh((1,), "dp"), "dp", AdamW(lr=1e-2))
    state, data = ts.init(0), lm_batches(1) * 3  # one batch three times: the loss must fall
    want_state, want_losses = state, []
    for x, y in data:
        want_state, loss = plain.reference_step(want_state, x, y)
        want_losses.append(loss)
    got_state, losses = train_simulated(ts, state, data)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    assert want_losses[2] < want_losses[0]  # it trains
    got_state, want_state = ts.named(got_state), ts.named(want_state)
    assert len(want_state) > 20
    for name, want in want_state.items():
        np.testing.assert_allclose(got_state[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


def test_pipeline_preset_shifts_by_collective_permutes_and_holds_one_stage_of_layers_per_rank():
    S, M_ = 4, 4
    ts = lm_step((S, 2), M_)
    permutes = [c for c in ts.program.comm_summary() if c["kind"] == "collective_permute"]
    mb_state = LM.batch // M_ // 2 * LM.seq * LM.d * 8  # one micro-batch's residual on one data shard
    # one shift per iteration, forward loop and backward loop: M + S - 1 trips each
    assert [(c["trips"], c["bytes_in"]) for c in permutes] == [(M_ + S - 1, mb_state)] * 2
    summary = {c["kind"]: c for c in ts.comm_summary()}
    assert summary["collective_permute"]["bytes_in"] == 2 * mb_state and summary["collective_permute"]["wire_bytes"] > 0
    layer_bytes = sum(np.prod(io.shape) * 8 for io in ts.program.inputs if io.name.startswith("params.layers_"))
    local = sum(np.prod(io.sharding.local_shape(io.shape, ts.mesh)) * 8 for io in ts.program.inputs
                if io.name.startswith("params.layers_"))
    assert layer_bytes > 0 and local * S == layer_bytes  # 1/S of the layer parameters (the model axis absent here)
    assert all(io.sharding.dims[0] == ("stage",) for io in ts.program.inputs if "layers_" in io.name)


@pytest.mark.parametrize("preset", ["pipeline", "pipeline_1f1b"])
@pytest.mark.parametrize("shape,tied", [((2, 2, 2), True), ((4, 2), False), ((4, 1, 2), True)], ids=str)
def test_parameters_outside_the_layers_are_split_over_the_stages_and_gathered_once_per_step(preset, shape, tied):
    """The embedding, positional table, final LayerNorm and head have no layer dim for the stages to split, so
    every stage held them whole (Megatron keeps them on the first / last stage; eq. 2 counts them once): each rank
    now holds 1/S of them (and of their optimizer state) beside its model-axis split, and the step gathers each
    over the stage axis once (no all-gather inside a loop), its bytes the 16-bit copy's share."""
    cfg = dataclasses.replace(LM, tied=tied, dtype="bfloat16", remat="full")
    mesh = sr.train_mesh(shape, preset)
    plan = plan_train_step(cfg, mesh, preset, AdamW(), microbatches=2)
    s, t = shape[0], shape[2] if len(shape) > 2 else 1
    outside = {"embed", "pos", "lnf_g", "lnf_b"} | ({"unembed"} if not tied else set())
    held = {io.name: io for io in plan.step.program.inputs if io.name.split(".")[-1] in outside}
    assert len(held) == 3 * len(outside)  # the parameter, Adam's m and v
    for name, io in held.items():
        split = s * (t if name.split(".")[-1] in ("embed", "unembed") else 1)
        assert np.prod(io.sharding.local_shape(io.shape, mesh)) * split == np.prod(io.shape), name
        assert "stage" in io.sharding.axes, name
    # one all-gather over the stages of each one's 16-bit copy, to the layout the model uses it in, before the loops
    use = {n: tuple(parse_spec(plan.step.layout.use[n], mesh, len(io.shape)).local_shape(io.shape, mesh))
           for n, io in ((k.split(".")[-1], io) for k, io in held.items() if k.startswith("params."))}
    top, inner = stage_gathers(plan.step.program)
    assert sorted(g for g in top if g in use.values()) == sorted(use.values())
    assert not [g for g in inner if g in use.values()]


def stage_gathers(program, inside=False) -> tuple[list, list]:
    """The (local) shapes of the 16-bit all-gathers over the stage axis: (at top level, inside loops)."""
    top, inner = [], []
    for ins in program.instrs:
        for body in (b for v in ins.attrs.values() for b in (v if isinstance(v, tuple) else (v,))
                     if hasattr(b, "instrs")):
            inner += sum(stage_gathers(body, True), [])
        if ins.op in ("all_gather", "all_gather_start") and tuple(ins.attrs["axes"]) == ("stage",) \
                and ins.dtype == "bfloat16":
            (inner if inside else top).append(tuple(ins.shape))
    return top, inner


@pytest.mark.parametrize("cfg,shape,message", [
    (LM, None, "runs pipeline stages over mesh axis \\('stage',\\), which must be one axis of the mesh; got "
               "axes \\('data', 'model'\\)"),
    (dataclasses.replace(LM, layers=3), (2, 2), "needs the stage count to divide the layers; got 2 stages "
                                               "\\(mesh axis 'stage'\\) for layers=3"),
    (dataclasses.replace(LM, scan_layers=False), (2,), "pipelines the scanned dense layers; got an unrolled model"),
    (dataclasses.replace(LM, scan_layers=True, moe_every=2, experts=2), (2,),
     "pipelines the scanned dense layers; got MoE blocks \\(a pipeline of MoE groups is not built\\)"),
], ids=["no stage axis", "stages do not divide layers", "unrolled", "moe"])
def test_bad_pipeline_presets_raise(cfg, shape, message):
    mesh = sr.train_mesh((2, 2), "megatron") if shape is None else sr.train_mesh(shape, "pipeline")
    with pytest.raises(ValueError, match=message):  # (MoE: one micro-batch, as its gradient accumulation is not built)
        sr.build_train_step(cfg, mesh, "pipeline", microbatches=1 if cfg.moe_every else 2)
