"""GSPMD pipeline parallelism: pipelining reduced to sharding and one loop.

The S stages' parameters are stacked on a leading stage dim split over the mesh axis ``stage_axis``, and
so is a state buffer [S, microbatch...]. Each of the M + S - 1 iterations of ONE ``sr.scan`` shifts
the buffer by one along the stage dim (stage i takes what stage i - 1 produced; stage 0 takes
micro-batch t), which the partitioner turns into one collective_permute to the next rank, then runs
every stage at once, vectorised over the stage dim: with the stage dim split, each rank computes its
own stage. Micro-batch m enters stage 0 at iteration m and leaves the last stage at iteration
m + S - 1 (GPipe's schedule; bubble fraction (S - 1) / (M + S - 1)). The backward pass is the same loop
reversed (reverse-mode through the scan), optionally rematerialising the stage bodies. The last stage's outputs
leave the loop by a masked sum over the stage dim (``last_stage``), whose cotangent stays split over the stages.

Also here, for ``autodiff/scheduled.py``'s ``pipeline_loss``: the 1F1B table (``one_f_one_b_schedule``), and
``bubble_fraction`` of each schedule.
"""
from __future__ import annotations

import heapq

import numpy as np

from . import numpy as snp
from . import pytree
from .bodies import pytree_flatten, pytree_unflatten
from .ops.control import scan
from .trace import mesh_split


def pipeline(stage_fn, stage_params, microbatches, *, mesh, stage_axis="stage", policy=None, stage_dim=0,
             param_specs=None, state_spec=None, circular=False):
    """Run ``microbatches`` [M, ...] through V pipelined stages; returns the outputs [M, ...].

    ``stage_fn(stage_params, x)`` computes every stage at once: the leaves of ``stage_params`` have a
    stage dim (dim ``stage_dim``, 0 by default), ``x`` is [stages, ...] (stage i's input at x[i]) and the
    result has x's shape. ``policy``: the remat policy of the loop body (e.g. "nothing_saveable").
    ``param_specs`` (a pytree like ``stage_params`` with spec tuples as leaves) and ``state_spec`` give the
    mesh_split specs of the other dims of each parameter and of one micro-batch (default: replicated), so
    stages combine with data and model parallelism.

    GPipe (default): the V stages are blocked over the S devices of ``stage_axis`` (V / S adjacent stages
    each), M + V - 1 iterations, bubble (V - 1) / (M + V - 1). ``circular=True`` (Lingvo/GSPMD circular
    pipelining): device s holds the R = V / S non-adjacent stages s, s + S, ...; a micro-batch goes round
    the devices R times, ``stage_fn`` gets the one stage each device runs at this iteration ([S, ...]
    leaves), M must be a multiple of S, M R + S - 1 iterations of one stage each, bubble
    (S - 1) / (M R + S - 1)."""
    leaves, treedef = pytree_flatten(stage_params)
    check_stages(mesh, stage_axis, [p.shape[stage_dim] if p.ndim > stage_dim else None for p in leaves],
                 [tuple(p.shape) for p in leaves])
    specs = flat_param_specs(stage_params, param_specs, len(leaves))
    microbatches = snp.asarray(microbatches)
    state_spec = tuple(state_spec) if state_spec is not None else (None,) * (microbatches.ndim - 1)
    split = lambda x: mesh_split(x, mesh, (stage_axis,) + state_spec)
    run = _circular if circular else _gpipe
    return run(stage_fn, leaves, treedef, specs, microbatches, mesh, stage_axis, stage_dim, split, policy)


def micro_batches(x, m: int):
    """[b, ...] -> [M, b / M, ...]: rows m, m + M, ... of ``x`` form micro-batch m, so a split of the batch dim
    stays local (each shard's rows spread over every micro-batch)."""
    return snp.transpose(snp.reshape(x, (x.shape[0] // m, m) + x.shape[1:]), (1, 0) + tuple(range(2, x.ndim + 1)))


def stages_of_layers(w, s: int):
    """[L, ...] -> [L / S, S, ...]: stage j's L / S consecutive layers at [:, j] (layer l on stage l // (L / S)),
    so the layer dim split over the stage axis is each rank holding its stage."""
    return snp.transpose(snp.reshape(w, (s, w.shape[0] // s) + w.shape[1:]), (1, 0) + tuple(range(2, w.ndim + 1)))


def flat_param_specs(stage_params, param_specs, n: int) -> list:
    """``param_specs`` (a pytree like ``stage_params``, spec tuples as leaves; None: replicated) flat, one per leaf."""
    if param_specs is None:
        return [None] * n
    return pytree.flatten_like(param_specs, pytree.flatten(stage_params)[1], "pipeline param_specs", is_spec)


def split_param(p, spec, mesh, axis, at: int, extra=()):
    """``p`` pinned: the stage axis on dim ``at``, ``extra`` entries before it, ``spec`` on the other dims."""
    rest = list(spec) if spec is not None else [None] * (p.ndim - 1 - len(extra))
    return mesh_split(p, mesh, tuple(rest[:at]) + tuple(extra) + (axis,) + tuple(rest[at:]))


def shift_stages(state, rows: int):
    """``state`` moved ``rows`` along the stage dim (zeros come in): one collective_permute when it is split."""
    return snp.lax_pad(state, np.zeros((), state.dtype), [(rows, -rows, 0)] + [(0, 0, 0)] * (state.ndim - 1))


def _gpipe(stage_fn, leaves, treedef, specs, microbatches, mesh, axis, stage_dim, split, policy):
    s = leaves[0].shape[stage_dim]
    params = pytree_unflatten(treedef, [split_param(p, sp, mesh, axis, stage_dim) for p, sp in zip(leaves, specs)])
    shape = (s,) + microbatches.shape[1:]
    xs = snp.concatenate([microbatches, snp.zeros((s - 1,) + shape[1:], microbatches.dtype)], 0)
    first = snp.broadcast_in_dim(snp.arange(s) == 0, shape, (0,))

    def step(state, x):
        state = split(snp.where(first, snp.broadcast_in_dim(x, shape, tuple(range(1, len(shape)))), shift_stages(state, 1)))
        state = split(stage_fn(params, state))
        return state, state
    _, ys = scan(step, split(snp.zeros(shape, microbatches.dtype)), xs, policy=policy)
    return last_stage(ys[s - 1:])


def _circular(stage_fn, leaves, treedef, specs, microbatches, mesh, axis, stage_dim, split, policy):
    v, s, m = leaves[0].shape[stage_dim], mesh.axis_size(axis), microbatches.shape[0]
    r = v // s
    if m % s:
        raise ValueError(f"a circular pipeline feeds micro-batches in groups of the {axis!r} axis size; got {m} "
                         f"micro-batches for {s} devices (use a multiple of {s})")
    # stage r * S + j on device j: [V] -> [R, S], the S dim split
    stacked = [split_param(snp.reshape(p, p.shape[:stage_dim] + (r, s) + p.shape[stage_dim + 1:]), sp, mesh, axis,
                            stage_dim, extra=(None,)) for p, sp in zip(leaves, specs)]
    sched = circular_schedule(m, s, r)
    shape = (s,) + microbatches.shape[1:]
    zeros = snp.zeros(((r - 1) * s,) + shape[1:], microbatches.dtype)
    pieces = [part for g in range(m // s) for part in (microbatches[g * s:(g + 1) * s], zeros)]
    xs = snp.concatenate(pieces + [snp.zeros((s - 1,) + shape[1:], microbatches.dtype)], 0)
    first = snp.broadcast_in_dim(snp.arange(s) == 0, shape, (0,))

    def pick(p, sel):  # each device's stage of this iteration: sel [R, S] one-hot
        mask = snp.broadcast_in_dim(snp.astype(sel, p.dtype), p.shape, (stage_dim, stage_dim + 1))
        return snp.sum(p * mask, axis=stage_dim)

    def step(state, inputs):
        x, sel, fresh = inputs
        # device 0 takes a new micro-batch, or what device S - 1 produced (the wrap-around); the others shift
        fresh = snp.broadcast_in_dim(fresh, shape, ())
        wrapped = snp.where(fresh, snp.broadcast_in_dim(x, shape, tuple(range(1, len(shape)))), shift_stages(state, 1 - s))
        state = split(snp.where(first, wrapped, shift_stages(state, 1)))
        params = pytree_unflatten(treedef, [pick(p, sel) for p in stacked])
        state = split(stage_fn(params, state))
        return state, state
    inputs = (xs, snp.asarray(sched["stage_of"]), snp.asarray(sched["fresh"]))
    _, ys = scan(step, split(snp.zeros(shape, microbatches.dtype)), inputs, policy=policy)
    return last_stage(snp.concatenate([ys[t:t + s] for t in sched["exits"]], 0))


def last_stage(ys):
    """``ys[:, -1]`` of stacked states [T, S, ...] split over S, as a masked sum over the stage dim: the forward is
    the same all-reduce as indexing, but its VJP is a broadcast times the mask, which stays split over the stage
    axis (an index's VJP pads the cotangent into a replicated [T, S, ...] buffer: S times each rank's share)."""
    s = ys.shape[1]
    last = snp.broadcast_in_dim(snp.arange(s) == s - 1, ys.shape, (1,))
    return snp.sum(snp.where(last, ys, snp.zeros((), ys.dtype)), axis=1)


def circular_schedule(m: int, s: int, r: int) -> dict:
    """The circular schedule of M micro-batches (groups of S) on S devices going round R times: per
    iteration t of M R + S - 1, ``stage_of[t, k, j]`` (one-hot: device j runs its k-th stage, k * S + j),
    ``fresh[t]`` (device 0 takes a new micro-batch), and ``exits``: the first iteration at which each group
    leaves device S - 1 after its last round (its S micro-batches leave on consecutive iterations)."""
    t_all = m * r + s - 1
    stage_of = np.zeros((t_all, r, s), bool)
    fresh = np.zeros(t_all, bool)
    for t in range(t_all):
        for j in range(s):
            u = t - j  # when what device j holds entered device 0 for this round
            g, w = divmod(u, s * r) if u >= 0 else (0, 0)
            stage_of[t, w // s, j] = True
        g, w = divmod(t, s * r)
        fresh[t] = w < s and g * s + w < m
    exits = [g * s * r + (r - 1) * s + s - 1 for g in range(m // s)]
    return {"stage_of": stage_of, "fresh": fresh, "exits": exits}


def one_f_one_b_schedule(m: int, s: int, v: int = 1) -> dict:
    """PipeDream-flush (1F1B) for M micro-batches on S devices, in slots of one forward or one backward per device;
    with ``v`` > 1 the interleaved schedule (Megatron-LM 2021): device j holds the v stages j, j + S, ... (chunks
    0..v-1) and runs one chunk's op per slot. Each device runs its warm-up forwards (S - 1 - j without chunks;
    2 (S - 1 - j) + (v - 1) S with them), then alternates one forward and one backward, then drains its
    backwards; forwards take micro-batches in groups of S chunk by chunk, backwards the chunks in reverse. Each
    op takes the earliest slot after its input arrived (a forward after the previous stage's forward of that
    micro-batch, a backward after the next stage's backward, the last stage's backward after its own forward).

    Returns per slot t and device j: ``kind`` (0 idle, 1 forward, 2 backward), ``mb``, ``chunk``; the buffer slot
    each value occupies (``save``: the stage input a forward saves and its backward reads; ``inbox``: a received
    activation until its forward; ``cotangent``: a received cotangent, or the head's, until its backward), with
    ``recv`` / ``recv_ct`` the slot an arriving value is written to (-1: none) and ``head`` the cotangent slot the
    last stage's head writes; ``sizes`` the slots each buffer needs (at most S micro-batches per device for
    1F1B); ``length`` (2 (M + S - 1) slots for 1F1B). Built once at trace time (O(M v S) work)."""
    if v > 1 and m % s:
        raise ValueError(f"the interleaved schedule takes micro-batches in groups of the device count; got {m} "
                         f"micro-batches for {s} devices (use a multiple of {s})")
    order = [_device_order(m, s, v, j) for j in range(s)]
    done, nxt, rows = {}, [0] * s, []
    last = (v - 1, s - 1)
    while any(nxt[j] < len(order[j]) for j in range(s)):
        t, row = len(rows), [None] * s
        for j in range(s):
            if nxt[j] < len(order[j]):
                kind, k, c = order[j][nxt[j]]
                need = _needs(kind, k, c, j, s, v)
                if need is None or done.get(need, t) < t:
                    row[j] = (kind, k, c)
        for j, op in enumerate(row):
            if op is not None:
                done[op[0], op[1], op[2], j] = t
                nxt[j] += 1
        rows.append(row)
    t_all = len(rows)
    out = {name: np.full((t_all, s), -1) for name in ("mb", "chunk", "save", "inbox", "cotangent", "recv", "recv_ct",
                                                      "head")}
    out["kind"] = np.zeros((t_all, s), int)
    buffers = {name: _Slots(s) for name in ("save", "inbox", "cotangent")}
    for t, row in enumerate(rows):
        for j in range(s):  # what arrives this slot: last slot's outputs, shifted one device on / back
            src = rows[t - 1][(j - 1) % s] if t else None
            if src is not None and src[0] == 1 and (src[2], (j - 1) % s) != last and (j or src[2] + 1 < v):
                out["recv"][t, j] = buffers["inbox"].take((src[1], src[2] + (j == 0)), j, t)
            src = rows[t - 1][(j + 1) % s] if t else None
            if src is not None and src[0] == 2 and (j < s - 1 or src[2] > 0) and (src[2], (j + 1) % s) != (0, 0):
                out["recv_ct"][t, j] = buffers["cotangent"].take((src[1], src[2] - (j == s - 1)), j, t)
        for j, op in enumerate(row):
            if op is None:
                continue
            kind, k, c = op
            out["kind"][t, j], out["mb"][t, j], out["chunk"][t, j] = kind, k, c
            if kind == 1:
                if (j, c) != (0, 0):
                    out["inbox"][t, j] = buffers["inbox"].give((k, c), j, t)
                out["save"][t, j] = buffers["save"].take((k, c), j, t)
                if (c, j) == last:
                    out["head"][t, j] = buffers["cotangent"].take((k, c), j, t)
            else:
                out["save"][t, j] = buffers["save"].give((k, c), j, t)
                out["cotangent"][t, j] = buffers["cotangent"].give((k, c), j, t)
    out["sizes"] = {name: b.size for name, b in buffers.items()}
    out["length"] = t_all
    return out


def _device_order(m: int, s: int, v: int, j: int) -> list:
    """Device j's ops in 1F1B order: (kind 1 forward / 2 backward, micro-batch, chunk)."""
    def op(kind, n):  # the n-th forward or backward: groups of S micro-batches, chunk by chunk
        group, within = divmod(n, s * v)
        chunk = within // s if kind == 1 else v - 1 - within // s
        return (kind, group * s + within % s, chunk) if v > 1 else (kind, n, 0)
    total = m * v
    warm = min(total, s - 1 - j if v == 1 else 2 * (s - 1 - j) + (v - 1) * s)
    ops = [op(1, n) for n in range(warm)]
    for i in range(total - warm):
        ops += [op(1, warm + i), op(2, i)]
    return ops + [op(2, n) for n in range(total - warm, total)]


def _needs(kind: int, k: int, c: int, j: int, s: int, v: int):
    """The op whose output the op (kind, micro-batch k, chunk c) on device j takes (None: the input itself)."""
    if kind == 1:
        return (1, k, c, j - 1) if j else (1, k, c - 1, s - 1) if c else None
    if j < s - 1:
        return (2, k, c, j + 1)
    return (2, k, c + 1, 0) if c < v - 1 else (1, k, c, j)


class _Slots:
    """Buffer slots per device, handed out at a value's first slot and free again the slot after its last (the
    lowest free one first)."""

    def __init__(self, s: int):
        self.held, self.size = [{} for _ in range(s)], 0
        self.free, self.count = [[] for _ in range(s)], [0] * s
        self.released = [[] for _ in range(s)]  # (slot, when): free from the slot after ``when``

    def take(self, key, j: int, t: int) -> int:
        keep = []
        for q, when in self.released[j]:
            if when < t:
                heapq.heappush(self.free[j], q)
            else:
                keep.append((q, when))
        self.released[j] = keep
        if self.free[j]:
            slot = heapq.heappop(self.free[j])
        else:
            slot, self.count[j] = self.count[j], self.count[j] + 1
        self.held[j][key] = slot
        self.size = max(self.size, slot + 1)
        return slot

    def give(self, key, j: int, t: int) -> int:
        slot = self.held[j].pop(key)
        self.released[j].append((slot, t))
        return slot


def bubble_fraction(schedule: str, stages: int, microbatches: int, rounds: int = 1) -> float:
    """The idle fraction of each device's time in a pipeline step (forward and backward alike): GPipe and 1F1B
    (S - 1) / (M + S - 1); circular and interleaved 1F1B (``rounds`` = R stages per device, visited round-robin)
    (S - 1) / (M R + S - 1)."""
    s, m = stages, microbatches
    if schedule in ("gpipe", "1f1b"):
        return (s - 1) / (m + s - 1)
    if schedule in ("circular", "interleaved"):
        return (s - 1) / (m * rounds + s - 1)
    raise ValueError(f"schedule must be one of 'gpipe', '1f1b', 'circular', 'interleaved'; got {schedule!r}")


def is_spec(x) -> bool:
    return isinstance(x, tuple) or x is None


def check_stages(mesh, stage_axis: str, stages: list, shapes=None) -> None:
    """The rules of a pipeline's stage layout: ``stage_axis`` is a mesh axis, every stage parameter has the
    same stage count, a multiple of that axis's size."""
    if stage_axis not in mesh.axis_names:
        raise ValueError(f"pipeline splits the stage dim over mesh axis {stage_axis!r}, which must be an axis of "
                         f"the mesh; got axes {mesh.axis_names}")
    if len(set(stages)) != 1 or None in stages:
        raise ValueError(f"pipeline needs every stage parameter to have the same stage dim; got shapes "
                         f"{shapes if shapes is not None else stages}")
    if stages[0] % mesh.axis_size(stage_axis):
        raise ValueError(f"pipeline needs the stage count to be a multiple of the {stage_axis!r} axis size; got "
                         f"{stages[0]} stages on {mesh.axis_size(stage_axis)} devices")


__all__ = ["pipeline", "check_stages", "micro_batches", "stages_of_layers", "circular_schedule", "one_f_one_b_schedule", "bubble_fraction"]
