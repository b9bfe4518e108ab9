"""Pipelines whose backward pass is scheduled with their forward pass: ``pipeline_loss`` with the 1F1B schedule
and its interleaved (virtual-stage) form.

GPipe (``sr.pipeline``) runs every micro-batch forward, then autodiff reverses the loop: each stage keeps the
residuals of all M micro-batches until the backward loop reaches them. 1F1B (PipeDream-flush) starts the
backward of a micro-batch as soon as its forward has left the last stage, so a stage holds at most S of them.
That needs the loss inside the loop, so ``pipeline_loss`` takes the head (``loss_fn``) too and returns the
summed loss of the micro-batches.

The same single-program style as ``sr.pipeline``: every stage at once, vectorised over the stage dim split over
``stage_axis`` (one rank = one stage). ``schedule="1f1b"`` runs in lockstep ticks (``_lockstep``): in tick t stage
j runs the forward of micro-batch t - j and the backward of micro-batch t - 2 (S - 1) + j, Megatron's steady state
of one forward and one backward per stage, as three loops (S - 1 warm-up ticks of forwards only, M ticks of both
with the head in between, S - 1 cool-down ticks of backwards only), so each stage computes (M + S - 1) forwards and
(M + S - 1) backwards: Megatron's 1F1B work, bubble (S - 1) / (M + S - 1), and nothing computed twice or masked
away beyond the bubble. Forward activations shift one stage on per forward tick, cotangents one stage back per
backward tick (one collective_permute each); stage j keeps each saved input 2 (S - 1 - j) ticks, in a ring of
min(2 S - 1, M) slots (O(S) micro-batches, not M). A backward with nothing to do gets a zero cotangent, so its gradients
are exactly zero and the accumulators are plain sums: their data-parallel partial sums stay pending through the
loops and are reduced once per step (partition/pending_sums.py). The embedding (``input_fn``) and the head
(``head_over_stages``) can run per micro-batch inside the loops, so nothing of the whole batch is held.
``schedule="interleaved"``: ONE ``sr.scan`` over the slots of ``one_f_one_b_schedule``; V = v S stages, device j
holding stages j, j + S, ... (chunks, laid out as ``sr.pipeline(circular=True)`` lays them); each slot a device
runs one op of one chunk (its parameters picked by a one-hot over the chunks), chosen by the static schedule table
(an xs of the loop): the body runs ``stage_fn`` once on each device's chosen input and its VJP with each device's
received cotangent, masks keep what each device's own op produced (so each slot costs one forward plus one VJP
on every device); the shifts wrap from the last device to the first (the next chunk) and back: bubble
(S - 1) / (v M + S - 1) instead of (S - 1) / (M + S - 1).

The loop runs on stop-gradient copies of its inputs and returns the gradients itself; the result is
``with_gradients(loss, [p...], [grad_p...])`` over the stage parameters, the head parameters and the
micro-batches: the loss's value, whose derivative autodiff finds to be exactly the loop's gradients (so
``sr.value_and_grad`` of a model that calls ``pipeline_loss`` differentiates the embedding before it too).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import numpy as snp
from ..bodies import capture, pytree_flatten, pytree_unflatten
from ..ops.control import scan
from ..ops.core import stop_gradient, with_gradients
from ..pipeline import (check_stages, flat_param_specs, last_stage, one_f_one_b_schedule, pipeline, shift_stages,
                        split_param)
from ..sharding import UNCONSTRAINED
from ..trace import current_graph, mesh_split
from .engine import backward_from, value_and_grad

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# the per-slot tables that name a buffer slot, and the buffer each names one of
ONE_HOT = {"recv": "inbox", "inbox": "inbox", "recv_ct": "cotangent", "ct_b": "cotangent", "head": "cotangent",
           "save_f": "save", "save_b": "save"}


def pipeline_loss(stage_fn, stage_params, microbatches, loss_fn, head_params=None, targets=None, *, mesh,
                  stage_axis="stage", schedule="1f1b", stage_dim=0, param_specs=None, state_spec=None, policy=None,
                  input_fn=None, input_params=None, recompute_fn=None, head_over_stages=False, layer_fn=None):
    """``sum_m loss_fn(head_params, y_m, targets[m])`` where ``y`` = the S pipelined stages of ``stage_fn`` (as in
    ``sr.pipeline``: ``stage_fn(stage_params, x)`` runs every stage at once on x [S, ...]) applied to
    ``microbatches`` [M, ...]. ``schedule``: "1f1b" (at most S micro-batches held per stage), "interleaved"
    (V stages on the S devices of ``stage_axis``, device j holding j, j + S, ...; M a multiple of S) or "gpipe"
    (``sr.pipeline``, then the head on each output). Differentiable in ``stage_params``, ``head_params`` and
    ``microbatches``; ``targets`` [M, ...] (or None: ``loss_fn`` gets None) is not differentiated.
    ``param_specs`` / ``state_spec``: the other dims' specs of the stage parameters and of one micro-batch, as in
    ``sr.pipeline``; ``policy``: GPipe's loop remat policy (1F1B saves only each stage's input and recomputes).

    ``input_fn(input_params, x)`` (e.g. the embedding): stage 0's input is ``input_fn`` of each micro-batch of
    ``microbatches`` (then any array, e.g. tokens, not differentiated), run inside the 1F1B loop as the micro-batch
    enters, so no whole-batch activation is held; it is called with a leading dim (the stages, or the micro-batches)
    that it must treat as a batch dim. ``recompute_fn`` (default ``stage_fn``): what the 1F1B backward recomputes
    the stage's forward with before its VJP (e.g. ``stage_fn`` without per-layer remat: the stage's residuals then
    live only during its backward). ``head_over_stages``: ``loss_fn(head_params, ys, targets)`` takes every stage's
    output at once (ys [S, ...], this micro-batch's targets on every stage) and returns the per-stage losses [S],
    of which the last stage's counts: the head runs on each stage's own output, no all-reduce of the last stage's
    output over the stage axis. ``layer_fn(layer_params, x)`` (1F1B): ``stage_fn`` is the scan of it over the
    leading layer dim of the stage parameters ([layers, S, ...], ``stage_dim=1``); the forward then saves each
    layer's input and the backward recomputes layer by layer (Megatron's full recompute: one layer's activations
    live at a time, the saved inputs ``layers`` times larger than the stage's input alone)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_loss schedule must be one of {SCHEDULES}; got {schedule!r}")
    microbatches = snp.asarray(microbatches)
    per_micro_batch = _one_stage(loss_fn) if head_over_stages else loss_fn
    if schedule != "1f1b" and input_fn is not None:  # GPipe, interleaved: the inputs made before the loop
        microbatches, input_fn = input_fn(input_params, microbatches), None
    state_spec = tuple(state_spec) if state_spec is not None else (None,) * (microbatches.ndim - 1)
    if schedule == "gpipe":
        ys = pipeline(stage_fn, stage_params, microbatches, mesh=mesh, stage_axis=stage_axis, stage_dim=stage_dim,
                      param_specs=param_specs, state_spec=state_spec, policy=policy)
        return _summed_loss(per_micro_batch, head_params, ys, targets)
    leaves, treedef = pytree_flatten(stage_params)
    check_stages(mesh, stage_axis, [p.shape[stage_dim] if p.ndim > stage_dim else None for p in leaves],
                 [tuple(p.shape) for p in leaves])
    head, head_def = pytree_flatten(head_params)
    specs = flat_param_specs(stage_params, param_specs, len(leaves))
    frozen = lambda xs: [stop_gradient(x) for x in xs]
    if schedule == "interleaved":
        chunks = leaves[0].shape[stage_dim] // mesh.axis_size(stage_axis)
        loss, grads, head_grads, x_grad = _one_f_one_b(
            stage_fn, frozen(leaves), treedef, stop_gradient(microbatches), per_micro_batch, frozen(head), head_def,
            targets, mesh, stage_axis, stage_dim, specs, state_spec, chunks)
        return _with_gradients(loss, leaves + head + [microbatches], grads + head_grads + [x_grad])
    inputs, input_def = pytree_flatten(input_params)
    if layer_fn is not None and stage_dim != 1:
        raise ValueError(f"pipeline_loss with layer_fn takes stage parameters [layers, stages, ...] (stage_dim=1); "
                         f"got stage_dim={stage_dim}")
    fns = _StageFns(stage_fn, recompute_fn or stage_fn, loss_fn, input_fn, head_over_stages, layer_fn)
    loss, grads = _lockstep(fns, (frozen(leaves), treedef), stop_gradient(microbatches), (frozen(head), head_def),
                            targets, (frozen(inputs), input_def), mesh, stage_axis, stage_dim, specs, state_spec)
    wrt = leaves + head + inputs + ([microbatches] if len(grads) > len(leaves) + len(head) + len(inputs) else [])
    return _with_gradients(loss, wrt, grads)


def _with_gradients(loss, wrt, grads):
    """``loss``'s value, whose derivative in each of ``wrt`` is its gradient in ``grads`` (computed by the loop).
    A value in ``wrt`` twice (a tied embedding: the inputs' table and the head's) gets its gradients added first,
    while they are still pending sums, so they are reduced once."""
    summed: dict = {}
    for p, g in zip(wrt, grads):
        summed[p.id] = (p, summed[p.id][1] + g) if p.id in summed else (p, g)
    return with_gradients(stop_gradient(loss), [p for p, _ in summed.values()], [g for _, g in summed.values()])


def _one_stage(loss_fn):
    """A ``head_over_stages`` loss_fn applied to one output: ``loss_fn`` of it as a single stage."""
    def one(head, y, target):
        return loss_fn(head, snp.expand_dims(y, 0), None if target is None else snp.expand_dims(target, 0))[0]
    return one


def _summed_loss(loss_fn, head_params, ys, targets):
    def body(total, y_t):
        return total + loss_fn(head_params, y_t[0], y_t[1] if targets is not None else None), None
    xs = (ys, targets if targets is not None else snp.zeros((ys.shape[0],), ys.dtype))
    dtype = np.result_type(ys.dtype, np.float32)
    return scan(body, snp.zeros((), dtype), xs)[0]


@dataclass(frozen=True)
class _StageFns:
    """The functions of a lockstep 1F1B loop: the stages, their recompute, the head, the inputs' function."""
    stage: object
    recompute: object
    loss: object
    input: object
    over_stages: bool
    layer: object = None  # layer_fn: the stage is the scan of it over dim 0 of the stage parameters


def _lockstep(fns, params, microbatches, head, targets, inputs, mesh, axis, stage_dim, specs, state_spec):
    """1F1B in lockstep ticks: in tick t stage j runs the forward of micro-batch t - j and the backward of
    micro-batch t - 2 (S - 1) + j (Megatron's steady state: one forward and one backward per stage), the last
    stage the head in between. Three loops: S - 1 warm-up ticks of forwards only, M ticks of both, S - 1 cool-down
    ticks of backwards only, so each stage computes (M + S - 1) (forward + backward), as Megatron's 1F1B does,
    and no forward or backward whose result is thrown away beyond the bubble. Stage j keeps its saved inputs
    2 (S - 1 - j) ticks (a ring of ``ring_slots`` = min(2 S - 1, M) slots). A backward with nothing to do runs on a
    zero cotangent (its gradients exactly zero), so the gradients are plain sums ``acc + g``: partial sums stay
    pending over the loops and are reduced once after them (partition/pending_sums.py). Returns (loss, gradients
    of the stage parameters, the head's, the inputs' (``fns.input``) or the micro-batches' (floating ones without
    it))."""
    (leaves, treedef), (head, head_def), (inputs, input_def) = params, head, inputs
    s, m = leaves[0].shape[stage_dim], microbatches.shape[0]
    slots = ring_slots(m, s)
    split = lambda x: mesh_split(x, mesh, (axis,) + (UNCONSTRAINED,) * (x.ndim - 1))
    pin = lambda ps: [split_param(p, sp, mesh, axis, stage_dim) for p, sp in zip(ps, specs)]
    staged = pin(leaves)

    def stage_input(ins, index):  # [S, ...]: micro-batch ``index`` made stage 0's input, on every stage
        x = _row(microbatches, index)
        x = split(snp.broadcast_in_dim(x, (s,) + x.shape, tuple(range(1, x.ndim + 1))))
        return x if fns.input is None else fns.input(pytree_unflatten(input_def, ins), x)
    like = stage_input(inputs, 0)  # its shape (dead code: the loop makes its own)
    rest = tuple(state_spec) if len(state_spec) == like.ndim - 1 else (UNCONSTRAINED,) * (like.ndim - 1)
    state = lambda x: mesh_split(x, mesh, (axis,) + rest)  # a stage input [S, ...] or its cotangent
    lead = 1 if fns.layer is not None else 0  # dims before the stage dim in a saved unit ([layers, S, ...] or [S, ...])
    layers = leaves[0].shape[0] if lead else None
    unit = ((layers,) if lead else ()) + tuple(like.shape)
    slotted = lambda x: mesh_split(x, mesh, (None,) * (1 + lead) + (axis,) + rest)  # the saved ring [slots, *unit]
    dtype = like.dtype
    rows = lambda flags, x: snp.broadcast_in_dim(flags, x.shape, (0,))
    zeros_like = lambda x: snp.zeros(x.shape, x.dtype)
    first, last = snp.arange(s) == 0, snp.arange(s) == s - 1
    needs_dx = fns.input is None and np.issubdtype(np.dtype(microbatches.dtype), np.floating)

    at_stages = lambda flags, x: snp.broadcast_in_dim(flags, x.shape, (lead,))  # [S] flags over a saved unit

    def forward(c, row):
        ins = [capture(q) for q in inputs]
        x = snp.where(rows(first, like), stage_input(ins, row["mb"]), shift_stages(c["act"], 1))
        x = state(snp.where(rows(row["fwd_ok"], like), x, snp.zeros((), dtype)))
        ps = [capture(p) for p in staged]
        if lead:  # each layer's input saved
            y, saved = scan(lambda h, layer: (state(fns.layer(pytree_unflatten(treedef, layer), h)), h), x, ps)
        else:
            y, saved = fns.stage(pytree_unflatten(treedef, ps), x), x
        at = [row["slot"]] + [0] * len(unit)
        if slots < 2 * s - 1:  # fewer slots than ticks a stage holds an input: an idle stage keeps its slot's value
            kept = snp.reshape(snp.dynamic_slice(c["saved"], at, (1,) + unit), unit)
            saved = snp.where(at_stages(row["fwd_ok"], saved), saved, kept)
        c["saved"] = slotted(snp.dynamic_update_slice(c["saved"], snp.expand_dims(saved, 0), at))
        c["act"] = state(y)
        return c

    def head_step(c, row):  # the last stage's loss of its output and that output's cotangent
        hs = [capture(h) for h in head]
        target = None if targets is None else _row(targets, row["head_mb"])
        y = c["act"]
        start = len(current_graph().nodes)
        if fns.over_stages:
            targets_s = None if target is None else snp.broadcast_in_dim(target, (s,) + target.shape,
                                                                         tuple(range(1, target.ndim + 1)))
            losses = fns.loss(pytree_unflatten(head_def, hs), y, targets_s)
            *dhs, dy = backward_from({losses.id: snp.astype(last, losses.dtype)}, hs + [y], start)
            # times the mask (linear, not a select): a loss partial over the batch axes stays pending
            c["loss"] = c["loss"] + snp.astype(losses, c["loss"].dtype) * snp.astype(last, c["loss"].dtype)
        else:
            out = snp.reshape(last_stage(snp.expand_dims(y, 0)), y.shape[1:])
            l, (dhs, dy) = value_and_grad(lambda h, o: fns.loss(pytree_unflatten(head_def, h), o, target),
                                          argnums=(0, 1))(hs, out)
            dy = snp.broadcast_in_dim(dy, y.shape, tuple(range(1, y.ndim)))
            c["loss"] = c["loss"] + snp.astype(l, c["loss"].dtype)
        c["head_grads"] = [a + d for a, d in zip(c["head_grads"], dhs)]
        return c, state(snp.where(rows(last, y), dy, snp.zeros((), dtype)))

    def backward(c, row, head_ct=None):
        ps = [capture(p) for p in staged]
        moved = shift_stages(c["cot"], -1)
        ct = state(moved if head_ct is None else snp.where(rows(last, like), head_ct, moved))
        saved = _pick(c["saved"], _one_hot(row["read"], slots, s), bool(lead))
        saved = snp.where(at_stages(row["bwd_ok"], saved), saved, snp.zeros((), dtype))
        if lead:
            dx, dps = _layers_backward(fns.layer, treedef, ps, saved, ct, state)
        else:
            x = state(saved)
            start = len(current_graph().nodes)
            y = state(fns.recompute(pytree_unflatten(treedef, ps), x))
            *dps, dx = backward_from({y.id: ct}, ps + [x], start)
        c["grads"] = [g + d for g, d in zip(c["grads"], pin(dps))]
        c["cot"] = state(dx)
        if inputs:
            ins = [capture(q) for q in inputs]
            start = len(current_graph().nodes)
            x_in = stage_input(ins, row["bwd_mb"])
            d_ins = backward_from({x_in.id: state(snp.where(rows(first, dx), dx, snp.zeros((), dtype)))}, ins, start)
            c["input_grads"] = [a + d for a, d in zip(c["input_grads"], d_ins)]
        return c, (dx if needs_dx else None)

    def accumulators():  # zeros the steady loop adds to (pending sums: partition/pending_sums.py)
        return {"grads": [snp.zeros(p.shape, p.dtype) for p in staged], "input_grads": [zeros_like(q) for q in inputs],
                "head_grads": [zeros_like(h) for h in head],
                "loss": snp.zeros((s,) if fns.over_stages else (), np.result_type(dtype, np.float32))}

    def steady(c, row):
        c = forward(dict(c), row)
        c, ct = head_step(c, row)
        return backward(c, row, ct)

    def cool(c, row):
        return backward(dict(c), row)

    tables = _tick_tables(m, s)
    carry = {"act": state(snp.zeros(like.shape, dtype)),
             "saved": slotted(snp.zeros((slots,) + unit, dtype))}
    if s > 1:
        carry = scan(lambda c, row: (forward(dict(c), row), None), carry, tables["warm"])[0]
    carry, dx_steady = scan(steady, {**carry, "cot": state(snp.zeros(like.shape, dtype)), **accumulators()},
                            tables["steady"])
    dxs, done = [dx_steady], carry
    if s > 1:  # the cool-down adds to the steady loop's accumulators, still pending sums (pending_sums)
        done, dx_cool = scan(cool, {"cot": carry["cot"], "saved": carry["saved"], "grads": carry["grads"],
                                    "input_grads": carry["input_grads"]}, tables["cool"])
        dxs.append(dx_cool)
    loss = snp.sum(carry["loss"]) if fns.over_stages else carry["loss"]
    grads = done["grads"] + carry["head_grads"] + done["input_grads"]
    if needs_dx:  # stage 0's input cotangents, micro-batch k at backward tick k + S - 1
        dx = snp.concatenate(dxs, 0) if len(dxs) > 1 else dxs[0]
        firsts = snp.broadcast_in_dim(first, dx.shape, (1,))
        grads.append(snp.sum(snp.where(firsts, dx, snp.zeros((), dtype)), axis=1)[s - 1:s - 1 + m])
    return loss, grads


def _row(xs, index):
    """``xs[index]`` for a traced 0-d ``index``."""
    return snp.reshape(snp.dynamic_slice(xs, [index] + [0] * (xs.ndim - 1), (1,) + xs.shape[1:]), xs.shape[1:])


def _one_hot(index, size: int, s: int):
    """[S] slot indices (-1: none) -> [K, S] masks."""
    size = max(size, 1)
    return snp.broadcast_in_dim(snp.arange(size), (size, s), (0,)) == snp.broadcast_in_dim(index, (size, s), (1,))


def _pick(buf, onehot, layered: bool = False):
    """[K, S, ...] (``layered``: [K, layers, S, ...]) -> [S, ...] ([layers, S, ...]): each stage's slot of the
    one-hot [K, S], as a contraction with it (the stage dim a batch dim: local), which reads the buffer once and
    makes no masked copy of it."""
    lead = "l" if layered else ""
    rest = "abcdefghijmnopqrtuvwxyz"[:buf.ndim - 2 - len(lead)]
    return snp.einsum(f"k{lead}s{rest},ks->{lead}s{rest}", buf, snp.astype(onehot, buf.dtype))


def _layers_backward(layer_fn, treedef, params, inputs, ct, state):
    """The backward of a stage that scans ``layer_fn`` over its layers, from each layer's saved input (``inputs``
    [layers, S, ...]): a reverse scan recomputing one layer at a time and taking its VJP. Returns (the stage input's
    cotangent, the parameters' gradients [layers, S, ...])."""
    def back(cot, xs):
        layer, x = xs
        start = len(current_graph().nodes)
        y = state(layer_fn(pytree_unflatten(treedef, layer), x))
        *d_layer, dx = backward_from({y.id: cot}, list(layer) + [x], start)
        return state(dx), d_layer
    return scan(back, ct, (list(params), inputs), reverse=True)


def ring_slots(m: int, s: int) -> int:
    """The saved-input ring of the lockstep 1F1B loops: stage j holds an input 2 (S - 1 - j) ticks, so 2 S - 1 slots
    (written at tick t mod 2 S - 1 on every stage), or M when there are fewer micro-batches (micro-batch k at
    (k + j) mod M on stage j, stages without a forward keeping their slot)."""
    return min(2 * s - 1, m)


def _tick_tables(m: int, s: int) -> dict:
    """The lockstep loops' per-tick inputs (``_lockstep``), O(S) each: for a forward tick t, the micro-batch stage 0
    takes (``mb``, clamped), which stages run a real forward (``fwd_ok`` [S]) and the saved-input slot (``slot``,
    t mod K, K = ``ring_slots``: the same on every stage); for a backward tick, each stage's saved slot (``read`` [S]:
    stage j's micro-batch t - 2 (S - 1) + j was saved 2 (S - 1 - j) ticks before), which stages run a real backward
    (``bwd_ok``), stage 0's micro-batch (``bwd_mb``, clamped) and the head's (``head_mb``)."""
    slots, j = ring_slots(m, s), np.arange(s)

    def ticks(lo, hi, fwd, bwd):
        t = np.arange(lo, hi)[:, None]
        out = {}
        if fwd:
            out.update(mb=np.minimum(t[:, 0], m - 1), fwd_ok=(t - j >= 0) & (t - j < m), slot=t[:, 0] % slots)
        if bwd:
            k = t - 2 * (s - 1) + j
            out.update(read=np.where((k >= 0) & (k < m), (t - 2 * (s - 1) + 2 * j) % slots, -1),
                       bwd_ok=(k >= 0) & (k < m), bwd_mb=np.clip(k[:, 0], 0, m - 1), head_mb=t[:, 0] - (s - 1))
        return {name: snp.asarray(v.astype(np.int32) if v.dtype != bool else v) for name, v in out.items()}
    return {"warm": ticks(0, s - 1, True, False), "steady": ticks(s - 1, m + s - 1, True, True),
            "cool": ticks(m + s - 1, m + 2 * s - 2, False, True)}


def _one_f_one_b(stage_fn, leaves, treedef, microbatches, loss_fn, head, head_def, targets, mesh, axis,
                 stage_dim, specs, state_spec, chunks):
    """The 1F1B loop; ``chunks`` > 1: interleaved, device j holding stages j, j + S, ... (as ``circular``)."""
    v, m = chunks, microbatches.shape[0]
    s = leaves[0].shape[stage_dim] // v  # schedule columns: devices (interleaved) or the vectorised stages
    sched = one_f_one_b_schedule(m, s, v)
    tables = _slot_tables(sched, m, s, v)
    dtype, shape = microbatches.dtype, (s,) + microbatches.shape[1:]
    split = lambda x: mesh_split(x, mesh, (axis,) + state_spec)
    slotted = lambda x: mesh_split(x, mesh, (None, axis) + state_spec)
    extra = (None,) if v > 1 else ()
    pin = lambda ps: [split_param(p, sp, mesh, axis, stage_dim, extra) for p, sp in zip(ps, specs)]
    # interleaved: stage c * S + j at [c, j] of a [v, S] pair of dims, the S dim split (device j's chunks)
    params = pin([snp.reshape(p, p.shape[:stage_dim] + (v, s) + p.shape[stage_dim + 1:]) if v > 1 else p
                  for p in leaves])
    rows = lambda flags, like, at=0: snp.broadcast_in_dim(flags, like.shape, tuple(range(at, at + flags.ndim)))
    like = split(snp.zeros(shape, dtype))
    first, last = rows(snp.arange(s) == 0, like), rows(snp.arange(s) == s - 1, like)
    zero = snp.zeros((), dtype)

    def put(buf, onehot, x):
        return slotted(snp.where(rows(onehot, buf), snp.broadcast_in_dim(x, buf.shape, tuple(range(1, buf.ndim))),
                                 buf))

    def around(x, rows_on: int):  # one device on (1) or back (-1); interleaved, the ends wrap to the next chunk
        moved = shift_stages(x, rows_on)
        return snp.where(first if rows_on > 0 else last, shift_stages(x, rows_on - s * rows_on), moved) \
            if v > 1 else moved

    def chunk_of(p, onehot):  # [.., v, S, ..] -> [.., S, ..]: each device's chunk of this slot
        return snp.sum(snp.where(rows(onehot, p, stage_dim), p, snp.zeros((), p.dtype)), axis=stage_dim)

    sizes = {**{k: sched["sizes"][name] for k, name in ONE_HOT.items()}, "chunk": v, "bwd_chunk": v}

    def step(carry, row):
        act, cot, inbox, saved, cts, grads, loss, head_grads, dx = carry
        row = {k: _one_hot(x, sizes[k], s) if k in sizes else x for k, x in row.items()}
        ps = [capture(p) for p in params]
        inbox = put(inbox, row["recv"], around(act, 1))  # what ran forward on the device before, last slot
        cts = put(cts, row["recv_ct"], around(cot, -1))  # what ran backward on the device after
        x0 = _row(microbatches, row["fresh_mb"])
        x_fwd = split(snp.where(rows(row["fresh"], first), snp.broadcast_in_dim(x0, shape, tuple(range(1, len(shape)))),
                                _pick(inbox, row["inbox"])))
        saved = put(saved, row["save_f"], x_fwd)
        x = split(snp.where(rows(row["is_bwd"], first), _pick(saved, row["save_b"]), x_fwd))
        ct = split(_pick(cts, row["ct_b"]))
        chosen = [chunk_of(p, row["chunk"]) for p in ps] if v > 1 else ps
        start = len(current_graph().nodes)
        y = split(stage_fn(pytree_unflatten(treedef, chosen), x))
        *dps, dx_t = backward_from({y.id: ct}, chosen + [x], start)
        mask = row["bwd_chunk"] if v > 1 else row["is_bwd"]  # where this slot's backward adds to the gradients
        grads = pin([g + snp.where(rows(mask, g, stage_dim), snp.broadcast_in_dim(
            d, g.shape, tuple(k for k in range(g.ndim) if k != stage_dim)) if v > 1 else d,
            snp.zeros((), d.dtype)) for g, d in zip(grads, dps)])
        target = None if targets is None else _row(targets, row["head_mb"])
        hs = [capture(h) for h in head]
        out = snp.reshape(last_stage(snp.reshape(y, (1,) + shape)), shape[1:])  # the last device's output
        l, (dhs, dy) = value_and_grad(lambda h, out: loss_fn(pytree_unflatten(head_def, h), out, target),
                                      argnums=(0, 1))(hs, out)
        cts = put(cts, row["head"], snp.broadcast_in_dim(dy, shape, tuple(range(1, len(shape)))))
        on = row["head_on"]
        loss = loss + snp.where(on, snp.astype(l, loss.dtype), snp.zeros((), loss.dtype))
        head_grads = [a + snp.where(on, d, snp.zeros((), d.dtype)) for a, d in zip(head_grads, dhs)]
        dx = mesh_split(snp.dynamic_update_slice(dx, snp.reshape(dx_t, (s, 1) + shape[1:]),
                                                 [0, row["dx_mb"]] + [0] * (len(shape) - 1)),
                        mesh, (axis, None) + state_spec)
        return (split(y), split(dx_t), inbox, saved, cts, grads, loss, head_grads, dx), None

    buffer = lambda name: slotted(snp.zeros((max(sched["sizes"][name], 1),) + shape, dtype))
    init = (split(snp.zeros(shape, dtype)), split(snp.zeros(shape, dtype)), buffer("inbox"), buffer("save"),
            buffer("cotangent"), pin([snp.zeros(p.shape, p.dtype) for p in params]),
            snp.zeros((), np.result_type(dtype, np.float32)), [snp.zeros(h.shape, h.dtype) for h in head],
            mesh_split(snp.zeros((s, m + 1) + shape[1:], dtype), mesh, (axis, None) + state_spec))
    out = scan(step, init, {k: snp.asarray(t) for k, t in tables.items()})[0]
    grads, loss, head_grads, dx = out[5], out[6], out[7], out[8]
    if v > 1:
        grads = [snp.reshape(g, leaf.shape) for g, leaf in zip(grads, leaves)]
    x_grad = snp.sum(snp.where(rows(snp.arange(s) == 0, dx), dx, zero), axis=0)[:m]
    return loss, grads, head_grads, x_grad


def _slot_tables(sched: dict, m: int, s: int, v: int) -> dict:
    """The loop's per-slot inputs from the schedule, O(S) each (``ONE_HOT``: [S] slot indices the body makes
    one-hot [K, S] masks of): the buffer slot each device writes an
    arriving activation to (``recv``) and an arriving cotangent to (``recv_ct``), runs a forward from
    (``inbox``), saves a forward's input to (``save_f``), runs a backward from (``save_b``, ``ct_b``), and the
    head writes its cotangent to (``head``); ``fresh`` [S] (device 0 takes micro-batch ``fresh_mb``), ``is_bwd``
    [S]; ``chunk`` / ``bwd_chunk`` [v, S] (each device's chunk this slot / where a backward adds to the
    gradients); the head's micro-batch (``head_mb``) and whether it runs (``head_on``); the micro-batch whose
    input cotangent device 0 makes (``dx_mb``; M: none)."""
    kind, mb, chunk = sched["kind"], sched["mb"], sched["chunk"]

    def onehot(table, when, size):  # [T, S] slot indices (-1: none), made one-hot [K, S] in the loop body
        return np.where(when & (table >= 0), table, -1).astype(np.int32)
    sizes, fwd, bwd, always = sched["sizes"], kind == 1, kind == 2, np.ones_like(kind, bool)
    fresh = fwd[:, 0] & (chunk[:, 0] == 0)
    head_on = fwd[:, -1] & (chunk[:, -1] == v - 1)
    input_ct = bwd[:, 0] & (chunk[:, 0] == 0)
    return {"recv": onehot(sched["recv"], always, sizes["inbox"]),
            "recv_ct": onehot(sched["recv_ct"], always, sizes["cotangent"]),
            "inbox": onehot(sched["inbox"], fwd, sizes["inbox"]), "save_f": onehot(sched["save"], fwd, sizes["save"]),
            "save_b": onehot(sched["save"], bwd, sizes["save"]), "ct_b": onehot(sched["cotangent"], bwd,
                                                                                sizes["cotangent"]),
            "head": onehot(sched["head"], always, sizes["cotangent"]),
            "fresh": np.eye(s, dtype=bool)[0][None, :] & fresh[:, None], "is_bwd": bwd,
            "chunk": onehot(chunk, kind > 0, v), "bwd_chunk": onehot(chunk, bwd, v),
            "fresh_mb": np.where(fresh, mb[:, 0], 0).astype(np.int32),
            "head_mb": np.where(head_on, mb[:, -1], 0).astype(np.int32), "head_on": head_on,
            "dx_mb": np.where(input_ct, mb[:, 0], m).astype(np.int32)}


__all__ = ["pipeline_loss", "SCHEDULES"]
