"""Pipelines whose backward pass is scheduled with their forward pass: ``pipeline_loss`` with the 1F1B schedule
and its interleaved (virtual-stage) form.

GPipe (``sr.pipeline``) runs every micro-batch forward, then autodiff reverses the loop: each stage keeps the
residuals of all M micro-batches until the backward loop reaches them. 1F1B (PipeDream-flush) starts the
backward of a micro-batch as soon as its forward has left the last stage, so a stage holds at most S of them.
That needs the loss inside the loop, so ``pipeline_loss`` takes the head (``loss_fn``) too and returns the
summed loss of the micro-batches.

The same single-program style as ``sr.pipeline``: ONE ``sr.scan`` over the 2 (M + S - 1) slots of
``one_f_one_b_schedule``, every stage at once, vectorised over the stage dim split over ``stage_axis`` (one rank
= one stage). In each slot a stage runs one forward or one backward, chosen by the static schedule table (an xs
of the loop): the body runs ``stage_fn`` once on each stage's chosen input (the received activation for a
forward, the saved stage input for a backward, which recomputes it) and its VJP with each stage's received
cotangent; masks keep what each stage's own op produced. Forward activations shift one stage on, cotangents one
stage back (one collective_permute each per slot); a stage's saved inputs, waiting activations and waiting
cotangents live in [slots, S, ...] carries, in the buffer slots the schedule assigns (saved inputs: at most S).
The last stage's output goes through ``loss_fn`` in the slot it is made (its cotangent waits for that stage's
backward of it). ``schedule="interleaved"``: V = v S stages, device j holding stages j, j + S, ... (chunks, laid
out as ``sr.pipeline(circular=True)`` lays them); each slot a device runs one op of one chunk (its parameters
picked by a one-hot over the chunks) and the shifts wrap from the last device to the first (the next chunk) and
back: bubble (S - 1) / (v M + S - 1) instead of (S - 1) / (M + S - 1). The vectorised form pays for the backward
on stages running a forward (each slot costs one forward plus one VJP on every stage); a rank-local branch
would not.

The loop runs on stop-gradient copies of its inputs and returns the gradients itself; the result is
``loss + sum((p - stop_gradient(p)) * grad_p)`` over the stage parameters, the head parameters and the
micro-batches: the loss's value, whose derivative autodiff finds to be exactly the loop's gradients (so
``sr.value_and_grad`` of a model that calls ``pipeline_loss`` differentiates the embedding before it too).
"""
from __future__ import annotations

import numpy as np

from .. import numpy as snp
from ..bodies import capture, pytree_flatten, pytree_unflatten
from ..ops.control import scan
from ..ops.core import stop_gradient
from ..pipeline import (check_stages, flat_param_specs, last_stage, one_f_one_b_schedule, pipeline, shift_stages,
                        split_param)
from ..trace import current_graph, mesh_split
from .engine import backward_from, value_and_grad

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# the per-slot tables that name a buffer slot, and the buffer each names one of
ONE_HOT = {"recv": "inbox", "inbox": "inbox", "recv_ct": "cotangent", "ct_b": "cotangent", "head": "cotangent",
           "save_f": "save", "save_b": "save"}


def pipeline_loss(stage_fn, stage_params, microbatches, loss_fn, head_params=None, targets=None, *, mesh,
                  stage_axis="stage", schedule="1f1b", stage_dim=0, param_specs=None, state_spec=None, policy=None):
    """``sum_m loss_fn(head_params, y_m, targets[m])`` where ``y`` = the S pipelined stages of ``stage_fn`` (as in
    ``sr.pipeline``: ``stage_fn(stage_params, x)`` runs every stage at once on x [S, ...]) applied to
    ``microbatches`` [M, ...]. ``schedule``: "1f1b" (at most S micro-batches held per stage), "interleaved"
    (V stages on the S devices of ``stage_axis``, device j holding j, j + S, ...; M a multiple of S) or "gpipe"
    (``sr.pipeline``, then the head on each output). Differentiable in ``stage_params``, ``head_params`` and
    ``microbatches``; ``targets`` [M, ...] (or None: ``loss_fn`` gets None) is not differentiated.
    ``param_specs`` / ``state_spec``: the other dims' specs of the stage parameters and of one micro-batch, as in
    ``sr.pipeline``; ``policy``: GPipe's loop remat policy (1F1B saves only each stage's input and recomputes)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_loss schedule must be one of {SCHEDULES}; got {schedule!r}")
    microbatches = snp.asarray(microbatches)
    state_spec = tuple(state_spec) if state_spec is not None else (None,) * (microbatches.ndim - 1)
    if schedule == "gpipe":
        ys = pipeline(stage_fn, stage_params, microbatches, mesh=mesh, stage_axis=stage_axis, stage_dim=stage_dim,
                      param_specs=param_specs, state_spec=state_spec, policy=policy)
        return _summed_loss(loss_fn, head_params, ys, targets)
    leaves, treedef = pytree_flatten(stage_params)
    check_stages(mesh, stage_axis, [p.shape[stage_dim] if p.ndim > stage_dim else None for p in leaves],
                 [tuple(p.shape) for p in leaves])
    head, head_def = pytree_flatten(head_params)
    chunks = leaves[0].shape[stage_dim] // mesh.axis_size(stage_axis) if schedule == "interleaved" else 1
    loss, grads, head_grads, x_grad = _one_f_one_b(
        stage_fn, [stop_gradient(p) for p in leaves], treedef, stop_gradient(microbatches), loss_fn,
        [stop_gradient(h) for h in head], head_def, targets, mesh, stage_axis, stage_dim,
        flat_param_specs(stage_params, param_specs, len(leaves)), state_spec, chunks)
    out = stop_gradient(loss)
    for p, g in zip(leaves + head + [microbatches], grads + head_grads + [x_grad]):
        out = out + snp.sum((p - stop_gradient(p)) * stop_gradient(g))  # value 0, derivative g
    return out


def _summed_loss(loss_fn, head_params, ys, targets):
    def body(total, y_t):
        return total + loss_fn(head_params, y_t[0], y_t[1] if targets is not None else None), None
    xs = (ys, targets if targets is not None else snp.zeros((ys.shape[0],), ys.dtype))
    dtype = np.result_type(ys.dtype, np.float32)
    return scan(body, snp.zeros((), dtype), xs)[0]


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

    def pick(buf, onehot):  # [K, S, ...] -> [S, ...]: each device's slot of the one-hot [K, S]
        return snp.sum(snp.where(rows(onehot, buf), buf, zero), axis=0)

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

    def one_hot(index, size):  # [S] slot indices (-1: none) -> [K, S] masks
        size = max(size, 1)
        return snp.broadcast_in_dim(snp.arange(size), (size, s), (0,)) == snp.broadcast_in_dim(index, (size, s), (1,))

    def step(carry, row):
        act, cot, inbox, saved, cts, grads, loss, head_grads, dx = carry
        row = {k: one_hot(x, sizes[k]) if k in sizes else x for k, x in row.items()}
        ps = [capture(p) for p in params]
        inbox = put(inbox, row["recv"], around(act, 1))  # what ran forward on the device before, last slot
        cts = put(cts, row["recv_ct"], around(cot, -1))  # what ran backward on the device after
        x0 = snp.reshape(snp.dynamic_slice(microbatches, [row["fresh_mb"]] + [0] * (len(shape) - 1),
                                           (1,) + shape[1:]), shape[1:])
        x_fwd = split(snp.where(rows(row["fresh"], first), snp.broadcast_in_dim(x0, shape, tuple(range(1, len(shape)))),
                                pick(inbox, row["inbox"])))
        saved = put(saved, row["save_f"], x_fwd)
        x = split(snp.where(rows(row["is_bwd"], first), pick(saved, row["save_b"]), x_fwd))
        ct = split(pick(cts, row["ct_b"]))
        chosen = [chunk_of(p, row["chunk"]) for p in ps] if v > 1 else ps
        start = len(current_graph().nodes)
        y = split(stage_fn(pytree_unflatten(treedef, chosen), x))
        *dps, dx_t = backward_from({y.id: ct}, chosen + [x], start)
        mask = row["bwd_chunk"] if v > 1 else row["is_bwd"]  # where this slot's backward adds to the gradients
        grads = pin([g + snp.where(rows(mask, g, stage_dim), snp.broadcast_in_dim(
            d, g.shape, tuple(k for k in range(g.ndim) if k != stage_dim)) if v > 1 else d,
            snp.zeros((), d.dtype)) for g, d in zip(grads, dps)])
        target = None if targets is None else snp.reshape(
            snp.dynamic_slice(targets, [row["head_mb"]] + [0] * (targets.ndim - 1), (1,) + targets.shape[1:]),
            targets.shape[1:])
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
