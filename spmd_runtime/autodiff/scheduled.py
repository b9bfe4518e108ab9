"""Pipelines whose backward pass is scheduled with their forward pass: ``pipeline_loss`` with the 1F1B schedule.

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
stage back (one collective_permute each per slot); a stage's saved inputs and waiting activations live in
[slots, S, ...] carries (slots <= S). The last stage's output goes through ``loss_fn`` in the slot it is made
(its cotangent feeds that stage's backward of it in the next slot). The vectorised form pays for the backward
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

SCHEDULES = ("gpipe", "1f1b")


def pipeline_loss(stage_fn, stage_params, microbatches, loss_fn, head_params=None, targets=None, *, mesh,
                  stage_axis="stage", schedule="1f1b", stage_dim=0, param_specs=None, state_spec=None, policy=None):
    """``sum_m loss_fn(head_params, y_m, targets[m])`` where ``y`` = the S pipelined stages of ``stage_fn`` (as in
    ``sr.pipeline``: ``stage_fn(stage_params, x)`` runs every stage at once on x [S, ...]) applied to
    ``microbatches`` [M, ...]. ``schedule``: "1f1b" (at most S micro-batches held per stage) or "gpipe"
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
    loss, grads, head_grads, x_grad = _one_f_one_b(
        stage_fn, [stop_gradient(p) for p in leaves], treedef, stop_gradient(microbatches), loss_fn,
        [stop_gradient(h) for h in head], head_def, targets, mesh, stage_axis, stage_dim,
        flat_param_specs(stage_params, param_specs, len(leaves)), state_spec)
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
                 stage_dim, specs, state_spec):
    s, m = leaves[0].shape[stage_dim], microbatches.shape[0]
    sched = one_f_one_b_schedule(m, s)
    k_slots, dtype = sched["slots"], microbatches.dtype
    tables = _slot_tables(sched, m, s)
    shape = (s,) + microbatches.shape[1:]
    split = lambda x: mesh_split(x, mesh, (axis,) + state_spec)
    slotted = lambda x: mesh_split(x, mesh, (None, axis) + state_spec)
    pin = lambda ps: [split_param(p, sp, mesh, axis, stage_dim) for p, sp in zip(ps, specs)]
    params = pin(leaves)
    first = snp.broadcast_in_dim(snp.arange(s) == 0, shape, (0,))
    last = snp.broadcast_in_dim(snp.arange(s) == s - 1, shape, (0,))
    zero = snp.zeros((), dtype)

    def pick(buf, onehot):  # [K, S, ...] -> [S, ...]: each stage's slot of the one-hot [K, S]
        return snp.sum(snp.where(snp.broadcast_in_dim(onehot, buf.shape, (0, 1)), buf, zero), axis=0)

    def put(buf, onehot, x):
        return slotted(snp.where(snp.broadcast_in_dim(onehot, buf.shape, (0, 1)),
                                 snp.broadcast_in_dim(x, buf.shape, tuple(range(1, buf.ndim))), buf))

    def step(carry, row):
        act, cot, dy, inbox, saved, grads, loss, head_grads, dx = carry
        ps = [capture(p) for p in params]
        inbox = put(inbox, row["recv"], shift_stages(act, 1))  # what stage j - 1 ran forward last slot
        x0 = snp.reshape(snp.dynamic_slice(microbatches, [row["first_mb"]] + [0] * (len(shape) - 1),
                                           (1,) + shape[1:]), shape[1:])
        x_fwd = split(snp.where(first, snp.broadcast_in_dim(x0, shape, tuple(range(1, len(shape)))),
                                pick(inbox, row["fwd"])))
        saved = put(saved, row["fwd"], x_fwd)
        backward = snp.broadcast_in_dim(row["is_bwd"], shape, (0,))
        x = split(snp.where(backward, pick(saved, row["bwd"]), x_fwd))
        ct = split(snp.where(last, snp.broadcast_in_dim(dy, shape, tuple(range(1, len(shape)))), shift_stages(cot, -1)))
        start = len(current_graph().nodes)
        y = split(stage_fn(pytree_unflatten(treedef, ps), x))
        *dps, dx_t = backward_from({y.id: ct}, ps + [x], start)
        grads = pin([g + snp.where(snp.broadcast_in_dim(row["is_bwd"], d.shape, (stage_dim,)), d,
                                   snp.zeros((), d.dtype)) for g, d in zip(grads, dps)])
        target = None if targets is None else snp.reshape(
            snp.dynamic_slice(targets, [row["last_mb"]] + [0] * (targets.ndim - 1), (1,) + targets.shape[1:]),
            targets.shape[1:])
        hs = [capture(h) for h in head]
        out = snp.reshape(last_stage(snp.reshape(y, (1,) + shape)), shape[1:])  # the last stage's output
        l, (dhs, dy) = value_and_grad(lambda h, out: loss_fn(pytree_unflatten(head_def, h), out, target),
                                      argnums=(0, 1))(hs, out)
        on = row["last_on"]
        loss = loss + snp.where(on, snp.astype(l, loss.dtype), snp.zeros((), loss.dtype))
        head_grads = [a + snp.where(on, d, snp.zeros((), d.dtype)) for a, d in zip(head_grads, dhs)]
        dx = mesh_split(snp.dynamic_update_slice(dx, snp.reshape(dx_t, (s, 1) + shape[1:]),
                                                 [0, row["first_bwd"]] + [0] * (len(shape) - 1)),
                        mesh, (axis, None) + state_spec)
        return (split(y), split(dx_t), dy, inbox, saved, grads, loss, head_grads, dx), None

    init = (split(snp.zeros(shape, dtype)), split(snp.zeros(shape, dtype)), snp.zeros(shape[1:], dtype),
            slotted(snp.zeros((k_slots,) + shape, dtype)), slotted(snp.zeros((k_slots,) + shape, dtype)),
            pin([snp.zeros(p.shape, p.dtype) for p in params]), snp.zeros((), np.result_type(dtype, np.float32)),
            [snp.zeros(h.shape, h.dtype) for h in head],
            mesh_split(snp.zeros((s, m + 1) + shape[1:], dtype), mesh, (axis, None) + state_spec))
    out = scan(step, init, {k: snp.asarray(v) for k, v in tables.items()})[0]
    _, _, _, _, _, grads, loss, head_grads, dx = out
    x_grad = snp.sum(snp.where(snp.broadcast_in_dim(snp.arange(s) == 0, dx.shape, (0,)), dx, zero), axis=0)[:m]
    return loss, grads, head_grads, x_grad


def _slot_tables(sched: dict, m: int, s: int) -> dict:
    """The loop's per-slot inputs from the schedule: one-hot [K, S] masks of the buffer slot (micro-batch mod K)
    each stage receives an activation into (``recv``), runs forward from (``fwd``, also where it saves its input)
    and backward from (``bwd``); ``is_bwd`` [S]; the micro-batch stage 0 takes (``first_mb``) and stage 0's
    backward writes its input cotangent to (``first_bwd``, M: none); the micro-batch the last stage ran forward
    (``last_mb``) and whether it did (``last_on``)."""
    fwd, bwd, k = sched["fwd"], sched["bwd"], sched["slots"]
    t_all = fwd.shape[0]

    def onehot(table):
        out = np.zeros((t_all, k, s), bool)
        t, j = np.nonzero(table >= 0)
        out[t, table[t, j] % k, j] = True
        return out
    recv = np.full_like(fwd, -1)
    recv[1:, 1:] = fwd[:-1, :-1]
    return {"recv": onehot(recv), "fwd": onehot(fwd), "bwd": onehot(bwd), "is_bwd": bwd >= 0,
            "first_mb": np.maximum(fwd[:, 0], 0).astype(np.int32),
            "first_bwd": np.where(bwd[:, 0] >= 0, bwd[:, 0], m).astype(np.int32),
            "last_mb": np.maximum(fwd[:, -1], 0).astype(np.int32), "last_on": fwd[:, -1] >= 0}


__all__ = ["pipeline_loss", "SCHEDULES"]
