"""The 1F1B pipeline schedule (PipeDream-flush) in ``sr.pipeline_loss``: its static table is a valid 1F1B order
(every micro-batch once forward and once backward on every stage, after its inputs arrived, at most S held per
stage, the bubble fraction (S - 1) / (M + S - 1)); its loss and every gradient equal GPipe's and the reference
evaluator's on 4 and 8 simulated ranks; its lockstep loops hold at most min(2 S - 1, M) micro-batches per stage
where GPipe's stacks M + S - 1, and run each stage's forward and backward once per tick."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from simulated import run_everywhere, train_simulated
from spmd_runtime.optim import AdamW
from spmd_runtime.pipeline import bubble_fraction, one_f_one_b_schedule
from spmd_runtime.train.plan import plan_train_step

from test_bench_megatron_table import MEGATRON_LM

from pipeline_cases import (B, D, input_loss_program, layered_loss_program, loss_program, numpy_input_loss_and_grads,
                            numpy_layered_loss_and_grads, numpy_loss_and_grads, stages)
from test_pipeline import LM, lm_batches


def replay(sched, m: int, s: int, v: int) -> dict:
    """Runs the schedule's tables on labels instead of tensors, in the loop body's order (receive, forward input,
    save, backward reads, head), checking that every read finds the value it names; returns per device the
    most values each buffer held at once."""
    kind, mb, chunk, t_all = sched["kind"], sched["mb"], sched["chunk"], sched["length"]
    bufs = [{"inbox": {}, "save": {}, "cotangent": {}} for _ in range(s)]
    most = [{"inbox": 0, "save": 0, "cotangent": 0} for _ in range(s)]
    out_f, out_b = [None] * s, [None] * s  # what each device made last slot
    for t in range(t_all):
        for j in range(s):
            if sched["recv"][t, j] >= 0:
                k, c = out_f[(j - 1) % s]
                bufs[j]["inbox"][sched["recv"][t, j]] = (k, c + (j == 0))
            if sched["recv_ct"][t, j] >= 0:
                k, c = out_b[(j + 1) % s]
                bufs[j]["cotangent"][sched["recv_ct"][t, j]] = (k, c - (j == s - 1))
        new_f, new_b = [None] * s, [None] * s
        for j in range(s):
            op = (int(mb[t, j]), int(chunk[t, j]))
            if kind[t, j] == 1:
                if (j, op[1]) != (0, 0):
                    assert bufs[j]["inbox"].pop(sched["inbox"][t, j]) == op
                bufs[j]["save"][sched["save"][t, j]] = op
                new_f[j] = op
                if sched["head"][t, j] >= 0:
                    assert (j, op[1]) == (s - 1, v - 1)
                    bufs[j]["cotangent"][sched["head"][t, j]] = op
            elif kind[t, j] == 2:
                assert bufs[j]["save"].pop(sched["save"][t, j]) == op
                assert bufs[j]["cotangent"].pop(sched["cotangent"][t, j]) == op
                new_b[j] = op
            for name, held in bufs[j].items():
                most[j][name] = max(most[j][name], len(held))
                assert all(q < sched["sizes"][name] for q in held)
        out_f, out_b = new_f, new_b
    assert all(not held for b in bufs for held in b.values())
    return most


@pytest.mark.parametrize("m,s,v", [(1, 1, 1), (1, 3, 1), (3, 4, 1), (4, 4, 1), (8, 4, 1), (6, 2, 1), (16, 8, 1),
                                   (4, 4, 2), (8, 4, 2), (4, 2, 3), (2, 2, 2), (8, 4, 4)])
def test_schedule_is_a_valid_one_f_one_b_order_holding_at_most_s(m, s, v):
    """Every (micro-batch, chunk) runs forward and backward once on every device, after its input arrived; the
    buffer slots the tables name hold what each read expects; 1F1B holds at most S - j stage inputs on device j
    (GPipe: all M), interleaved at most 2 (S - 1 - j) + (v - 1) S + 1 chunk inputs; the idle fraction is
    (S - 1) / (M + S - 1) for 1F1B and (S - 1) / (v M + S - 1) interleaved."""
    sched = one_f_one_b_schedule(m, s, v)
    kind, mb, chunk = sched["kind"], sched["mb"], sched["chunk"]
    if v == 1:
        assert sched["length"] == kind.shape[0] == 2 * (m + s - 1)
    when = {}
    for t, j in zip(*np.nonzero(kind)):
        key = (int(kind[t, j]), int(mb[t, j]), int(chunk[t, j]), int(j))
        assert key not in when
        when[key] = t
    assert len(when) == 2 * m * v * s
    for (k_, k, c, j), t in when.items():
        if k_ == 1 and (j or c):
            assert t > (when[1, k, c, j - 1] if j else when[1, k, c - 1, s - 1])
        if k_ == 2:
            assert t > (when[2, k, c, j + 1] if j < s - 1 else when[2, k, c + 1, 0] if c < v - 1 else when[1, k, c, j])
    most = replay(sched, m, s, v)
    for j in range(s):
        bound = min(s - j, m) if v == 1 else min(2 * (s - 1 - j) + (v - 1) * s + 1, m * v)
        assert most[j]["save"] <= bound
    busy = np.sum(kind > 0)
    assert 1 - busy / (s * sched["length"]) == pytest.approx((s - 1) / (m * v + s - 1))
    name = "1f1b" if v == 1 else "interleaved"
    assert bubble_fraction(name, s, m, rounds=v) == pytest.approx((s - 1) / (m * v + s - 1))


def test_bubble_fractions():
    assert bubble_fraction("gpipe", 4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("circular", 4, 8, rounds=2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="schedule must be one of 'gpipe', '1f1b', 'circular', 'interleaved'; got 'pipedream'"):
        bubble_fraction("pipedream", 4, 8)


@pytest.mark.parametrize("shape,axes,s,m,rows", [
    ((4,), ("stage",), 4, 6, B), ((4, 2), ("stage", "data"), 4, 3, B), ((8,), ("stage",), 8, 8, B),
    ((2,), ("stage",), 4, 3, B), ((3,), ("stage",), 3, 4, B), ((3, 2), ("stage", "data"), 3, 2, 3),
    ((2, 4), ("stage", "data"), 2, 3, 3), ((1,), ("stage",), 2, 2, B)], ids=str)
def test_one_f_one_b_loss_and_gradients_equal_gpipe_and_the_reference(shape, axes, s, m, rows):
    """1 to 8 ranks; (2,) runs 4 stages on 2 devices (2 vectorised stages each); 3 rows over data=2 or 4 are
    uneven."""
    mesh = sr.Mesh(shape, axes)
    graph, prog, args = loss_program(mesh, "1f1b", s, m, rows)
    want = numpy_loss_and_grads(*args)
    ref = sr.evaluate(graph, *args)
    gpipe_graph, _, _ = loss_program(mesh, "gpipe", s, m, rows)
    for got, g, w in zip(ref, sr.evaluate(gpipe_graph, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


def micro_batch_buffers(prog, mb_shape) -> list:
    """(role, micro-batch states per rank) of every loop buffer of ``prog`` made of [..., B, D] states."""
    out = []
    for ins in prog.instrs:
        if ins.op != "scan":
            continue
        body, nc, length = ins.attrs["body"], ins.attrs["num_carry"], ins.attrs["length"]
        for k, o in enumerate(body.outputs):
            local = tuple(o.sharding.local_shape(o.shape, prog.mesh))
            if len(local) > len(mb_shape) and local[-len(mb_shape):] == mb_shape:
                out.append(("carry" if k < nc else "ys",
                            int(np.prod(local[:-len(mb_shape)])) * (1 if k < nc else length)))
    return out


def test_one_f_one_b_holds_at_most_2s_minus_1_micro_batches_per_stage_where_gpipe_holds_m_plus_s_minus_1():
    """S = 4 stages, M = 12 micro-batches on 4 ranks: the lockstep 1F1B loops (S - 1 warm-up ticks, M steady, S - 1
    cool-down) stack nothing but the input cotangents; their saved stage inputs ([2 S - 1, S, B, D] carries) hold
    2 S - 1 micro-batches per rank (stage j keeps each 2 (S - 1 - j) ticks), the shifting forward and backward
    states one each. GPipe's forward loop stacks M + S - 1 states per rank for its backward."""
    s, m = 4, 12
    mesh = sr.Mesh((s,), ("stage",))
    _, one_f, _ = loss_program(mesh, "1f1b", s, m)
    _, gpipe, _ = loss_program(mesh, "gpipe", s, m)
    held = micro_batch_buffers(one_f, (B, D))
    assert max(n for role, n in held if role == "carry") == 2 * s - 1
    assert sum(n for role, n in held if role == "ys") == m + s - 1  # stage 0's input cotangents, steady + cool
    assert max(n for role, n in micro_batch_buffers(gpipe, (B, D)) if role == "ys") >= m + s - 1
    loops = [i for i in one_f.instrs if i.op == "scan"]
    assert [i.attrs["length"] for i in loops] == [s - 1, m, s - 1]
    # one activation forward per forward tick, one cotangent back per backward tick, each one stage's state
    permutes = [c for c in one_f.comm_summary() if c["kind"] == "collective_permute"]
    assert sum(c["trips"] for c in permutes) == 2 * (m + s - 1)
    assert {c["bytes_in"] for c in permutes} == {B * D * 8}


def test_one_f_one_b_runs_each_stage_forward_and_backward_once_per_tick_never_masked_twice():
    """The work of each tick is its slot's: per stage M + S - 1 forwards (one einsum each) and
    M + S - 1 backwards (the saved input picked by a one-hot contraction, the recomputed forward and its two VJP
    einsums), the head's three einsums on the M steady ticks: the 1F1B table's 2 (M + S - 1) slots each running a
    forward AND a VJP on every stage would run 2 (M + S - 1) (1 + 3) stage einsums."""
    s, m = 4, 6
    _, prog, _ = loss_program(sr.Mesh((s,), ("stage",)), "1f1b", s, m)
    count = lambda op: sum(i.attrs["length"] * sum(b.op == op for b in i.attrs["body"].instrs)
                           for i in prog.instrs if i.op == "scan")
    assert count("einsum") == (m + s - 1) * (1 + 1 + 3) + 3 * m


def test_pipeline_loss_rejects_an_unknown_schedule():
    mesh = sr.Mesh((2,), ("stage",))
    with pytest.raises(ValueError, match="schedule must be one of \\('gpipe', '1f1b', 'interleaved'\\); got 'zb'"):
        sr.trace(lambda w, x: sr.pipeline_loss(stages, w, x, lambda h, y, t: snp.sum(y), mesh=mesh,
                                               schedule="zb"),
                 sr.TensorSpec((2, D, D)), sr.TensorSpec((3, B, D)))


@pytest.mark.parametrize("shape,microbatches", [((2, 2, 2), 2), ((4, 2), 4)], ids=["2x2x2", "4x2"])
def test_pipeline_1f1b_preset_trains_like_the_gpipe_preset(shape, microbatches):
    """The LM on 8 simulated ranks: three steps of ``pipeline_1f1b`` give the ``pipeline`` (GPipe) preset's losses,
    parameters and optimizer state; its loops shift one activation on per forward tick and one cotangent back per
    backward tick, M + S - 1 of each."""
    steps = {p: sr.build_train_step(LM, sr.train_mesh(shape, p), p, AdamW(lr=1e-2), microbatches=microbatches)
             for p in ("pipeline", "pipeline_1f1b")}
    state, data = steps["pipeline"].init(0), lm_batches(1) * 3
    (gpipe, gpipe_losses), (one_f, one_f_losses) = [train_simulated(ts, state, data) for ts in steps.values()]
    np.testing.assert_allclose(one_f_losses, gpipe_losses, rtol=1e-12)
    assert gpipe_losses[2] < gpipe_losses[0]
    gpipe, one_f = steps["pipeline"].named(gpipe), steps["pipeline_1f1b"].named(one_f)
    assert len(gpipe) > 20
    for name, want in gpipe.items():
        np.testing.assert_allclose(one_f[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
    s = shape[0]
    permutes = [c for c in steps["pipeline_1f1b"].program.comm_summary() if c["kind"] == "collective_permute"]
    assert sum(c["trips"] for c in permutes) == 2 * (microbatches + s - 1)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_loops_gradients_reach_the_step_without_a_pass_over_the_parameters(schedule):
    """The loss the loops return carries their gradients as with_gradients (ops/core.py), not as
    loss + sum((p - stop_gradient(p)) * g): no instruction subtracts an operand from itself (that zero was a pass
    over every parameter and gradient) and no scalar is all-reduced over the stages but the loss (the 1F1B preset's
    step on 2 x 2; pipeline_loss's interleaved schedule on 2 stages)."""
    if schedule == "1f1b":
        program = sr.build_train_step(LM, sr.train_mesh((2, 2), "pipeline_1f1b"), "pipeline_1f1b", AdamW(),
                                      microbatches=2).program
    else:
        _, program, _ = loss_program(sr.Mesh((2,), ("stage",)), schedule, 4, 2)

    def codes(prog):
        for ins in prog.instrs:
            yield ins.attrs.get("code", "")
            for body in [v for v in ins.attrs.values() if hasattr(v, "instrs")]:
                yield from codes(body)
    assert not [c for c in codes(program) if "sub(p0,p0)" in c or "sub(p1,p1)" in c]
    scalars = [c for c in program.comm_summary() if c["bytes_in"] <= 8 and "stage" in c["axes"]]
    assert len(scalars) <= 1, scalars


@pytest.mark.parametrize("shape,axes,stages_,m,rows", [
    ((2,), ("stage",), 4, 4, B), ((4,), ("stage",), 8, 4, B), ((2, 2), ("stage", "data"), 4, 2, 3),
    ((2,), ("stage",), 6, 2, B), ((4, 2), ("stage", "data"), 8, 4, B)], ids=str)
def test_interleaved_loss_and_gradients_equal_gpipe_and_the_reference(shape, axes, stages_, m, rows):
    """V stages on S devices, device j holding stages j, j + S, ...: the interleaved 1F1B schedule gives the loss
    and gradients of the same V stages in sequence; its loop runs one chunk per device per slot, the shifts
    wrapping from the last device to the first (two collective_permutes each way)."""
    mesh = sr.Mesh(shape, axes)
    graph, prog, args = loss_program(mesh, "interleaved", stages_, m, rows)
    want = numpy_loss_and_grads(*args)
    for got, w in zip(sr.evaluate(graph, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    loop = next(i for i in prog.instrs if i.op == "scan")
    assert loop.attrs["length"] == one_f_one_b_schedule(m, shape[0], stages_ // shape[0])["length"]
    assert [c["kind"] for c in loop.attrs["body"].comm_summary()].count("collective_permute") == 4


def test_interleaved_needs_whole_groups_of_micro_batches():
    with pytest.raises(ValueError, match="groups of the device count; got 3 micro-batches for 2 devices"):
        loss_program(sr.Mesh((2,), ("stage",)), "interleaved", 4, 3)


def test_pipeline_1f1b_preset_holds_min_2s_minus_1_m_stage_inputs_and_nothing_of_the_whole_batch():
    """The live-buffer bound of the preset's loops (stage=4, data=2), M = 4: the saved stage inputs are the one
    carry of more than one micro-batch state per rank, min(2 S - 1, M) of them (the ring of M slots when fewer
    micro-batches than 2 S - 1), and the largest buffer of the loops; nothing
    is stacked per tick (no input cotangents: the embedding's gradient is taken in the loop) and no value of the
    whole batch's residual or logits exists."""
    s, m, cfg = 4, 4, MEGATRON_LM
    prog = plan_train_step(cfg, sr.Mesh((s, 2, 1), ("stage", "data", "model")), "pipeline_1f1b", AdamW(),
                           microbatches=m).step.program
    state = (cfg.batch // m // 2, cfg.seq, cfg.d)
    held = micro_batch_buffers(prog, state)
    assert max(n for _, n in held) == min(2 * s - 1, m) and {role for role, _ in held} == {"carry"}
    one = int(np.prod(state)) * 4
    assert max(i.nbytes for ins in prog.instrs if ins.op == "scan"
               for i in ins.attrs["body"].instrs) == min(2 * s - 1, m) * one
    assert not [i for i in prog.instrs if tuple(i.global_shape) in ((cfg.batch, cfg.seq, cfg.d),
                                                                    (cfg.batch, cfg.seq, cfg.vocab))]


@pytest.mark.parametrize("schedule,shape,axes,s,m", [
    ("1f1b", (4,), ("stage",), 4, 5), ("1f1b", (2, 2), ("stage", "data"), 2, 3), ("1f1b", (2,), ("stage",), 4, 2),
    ("gpipe", (2, 2), ("stage", "data"), 2, 3), ("interleaved", (2,), ("stage",), 4, 2)], ids=str)
def test_inputs_made_in_the_loop_and_the_head_over_stages_give_the_same_loss_and_gradients(schedule, shape, axes, s,
                                                                                         m):
    """``input_fn`` (the micro-batches made from raw inputs as they enter, its weight differentiated) and
    ``head_over_stages`` (the head on every stage's output, the last stage's loss kept) on each schedule: the loss
    and every gradient equal the NumPy ones, in the reference evaluator and on the simulated ranks."""
    mesh = sr.Mesh(shape, axes)
    graph, prog, args = input_loss_program(mesh, schedule, s, m)
    want = numpy_input_loss_and_grads(*args)
    for got, w in zip(sr.evaluate(graph, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,axes,s,m,layers,by_layer", [
    ((4,), ("stage",), 4, 5, 3, True), ((2, 2), ("stage", "data"), 2, 3, 2, True), ((2,), ("stage",), 4, 2, 2, True),
    ((4,), ("stage",), 4, 5, 3, False)], ids=str)
def test_layer_by_layer_recompute_gives_the_same_loss_and_gradients(shape, axes, s, m, layers, by_layer):
    """Stages of several layers: with ``layer_fn`` the 1F1B forward saves each layer's input and the backward
    recomputes layer by layer (a reverse scan over the layers in the backward ticks), without it the stage is
    recomputed from its saved input: the same loss and gradients as the layers in sequence (NumPy); the saved ring
    holds min(2 S - 1, M) micro-batches' layer inputs, or stage inputs."""
    mesh = sr.Mesh(shape, axes)
    graph, prog, args = layered_loss_program(mesh, s, m, layers, layer_fn=by_layer)
    want = numpy_layered_loss_and_grads(*args)
    for got, w in zip(sr.evaluate(graph, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    for outs in run_everywhere(prog, *args):
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    local = (B // (mesh.axis_size("data") if "data" in axes else 1), D)
    ring = max(n for role, n in micro_batch_buffers(prog, local) if role == "carry")  # states per rank
    assert ring == min(2 * s - 1, m) * (layers if by_layer else 1) * (s // shape[0])


def test_layer_fn_needs_the_layer_dim_before_the_stage_dim():
    mesh = sr.Mesh((2,), ("stage",))
    with pytest.raises(ValueError, match="layer_fn takes stage parameters \\[layers, stages, ...\\] \\(stage_dim=1\\); "
                                         "got stage_dim=0"):
        sr.trace(lambda w, x: sr.pipeline_loss(stages, w, x, lambda h, y, t: snp.sum(y), mesh=mesh,
                                               layer_fn=lambda w, x: x),
                 sr.TensorSpec((2, D, D)), sr.TensorSpec((3, B, D)))
