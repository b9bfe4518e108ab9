"""GSPMD pipeline parallelism: pipelining reduced to sharding and one loop.

The S stages' parameters are stacked on a leading stage dim split over the mesh axis ``stage_axis``, and
so is a state buffer [S, microbatch...]. Each of the M + S - 1 iterations of ONE ``sr.scan`` shifts
the buffer by one along the stage dim (stage i takes what stage i - 1 produced; stage 0 takes
micro-batch t), which the partitioner turns into one collective_permute to the next rank, then runs
every stage at once, vectorised over the stage dim: with the stage dim split, each rank computes its
own stage. Micro-batch m enters stage 0 at iteration m and leaves the last stage at iteration
m + S - 1 (GPipe's schedule; bubble fraction (S - 1) / (M + S - 1)). The backward pass is the same loop
reversed (reverse-mode through the scan), optionally rematerialising the stage bodies.
"""
from __future__ import annotations

import numpy as np

from . import numpy as snp
from .bodies import pytree_flatten, pytree_unflatten
from .ops.control import scan
from .trace import mesh_split


def pipeline(stage_fn, stage_params, microbatches, *, mesh, stage_axis="stage", policy=None):
    """Run ``microbatches`` [M, ...] through S pipelined stages; returns the outputs [M, ...].

    ``stage_fn(stage_params, x)`` computes every stage at once: the leaves of ``stage_params`` have a
    leading stage dim S, ``x`` is [S, ...] (stage i's input at x[i]) and the result has x's shape.
    ``policy``: the remat policy of the loop body (e.g. "nothing_saveable")."""
    leaves, treedef = pytree_flatten(stage_params)
    if stage_axis not in mesh.axis_names:
        raise ValueError(f"pipeline splits the stage dim over mesh axis {stage_axis!r}, which must be an axis of "
                         f"the mesh; got axes {mesh.axis_names}")
    stages = {p.shape[0] if p.ndim else None for p in leaves}
    if len(stages) != 1 or None in stages:
        raise ValueError(f"pipeline needs every stage parameter to have the same leading stage dim; got shapes "
                         f"{[tuple(p.shape) for p in leaves]}")
    (s,) = stages
    if s % mesh.axis_size(stage_axis):
        raise ValueError(f"pipeline needs the stage count to be a multiple of the {stage_axis!r} axis size; got "
                         f"{s} stages on {mesh.axis_size(stage_axis)} devices")
    split = lambda x: mesh_split(x, mesh, (stage_axis,) + (None,) * (x.ndim - 1))
    params = pytree_unflatten(treedef, [split(p) for p in leaves])
    microbatches = snp.asarray(microbatches)
    shape = (s,) + microbatches.shape[1:]
    xs = snp.concatenate([microbatches, snp.zeros((s - 1,) + shape[1:], microbatches.dtype)], 0)
    first = snp.broadcast_in_dim(snp.arange(s) == 0, shape, (0,))

    def step(state, x):
        shifted = snp.lax_pad(state, np.zeros((), state.dtype), [(1, -1, 0)] + [(0, 0, 0)] * (len(shape) - 1))
        state = split(snp.where(first, snp.broadcast_in_dim(x, shape, tuple(range(1, len(shape)))), shifted))
        state = split(stage_fn(params, state))
        return state, state
    _, ys = scan(step, split(snp.zeros(shape, microbatches.dtype)), xs, policy=policy)
    return ys[s - 1:, s - 1]


__all__ = ["pipeline"]
