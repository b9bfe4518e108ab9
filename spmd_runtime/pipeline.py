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
from . import pytree
from .bodies import pytree_flatten, pytree_unflatten
from .ops.control import scan
from .trace import mesh_split


def pipeline(stage_fn, stage_params, microbatches, *, mesh, stage_axis="stage", policy=None, stage_dim=0,
             param_specs=None, state_spec=None):
    """Run ``microbatches`` [M, ...] through S pipelined stages; returns the outputs [M, ...].

    ``stage_fn(stage_params, x)`` computes every stage at once: the leaves of ``stage_params`` have a
    stage dim S (dim ``stage_dim``, 0 by default), ``x`` is [S, ...] (stage i's input at x[i]) and the result
    has x's shape. ``policy``: the remat policy of the loop body (e.g. "nothing_saveable").
    ``param_specs`` (a pytree like ``stage_params`` with spec tuples as leaves) and ``state_spec`` give the mesh_split specs of the other
    dims of each parameter and of one micro-batch (default: replicated), so stages combine with data and
    model parallelism."""
    leaves, treedef = pytree_flatten(stage_params)
    check_stages(mesh, stage_axis, [p.shape[stage_dim] if p.ndim > stage_dim else None for p in leaves],
                 [tuple(p.shape) for p in leaves])
    s = leaves[0].shape[stage_dim]
    specs = [None] * len(leaves) if param_specs is None else \
        pytree.flatten_like(param_specs, pytree.flatten(stage_params)[1], "pipeline param_specs", is_spec)

    def split_param(p, spec):
        rest = list(spec) if spec is not None else [None] * (p.ndim - 1)
        return mesh_split(p, mesh, tuple(rest[:stage_dim]) + (stage_axis,) + tuple(rest[stage_dim:]))
    params = pytree_unflatten(treedef, [split_param(p, sp) for p, sp in zip(leaves, specs)])
    microbatches = snp.asarray(microbatches)
    shape = (s,) + microbatches.shape[1:]
    state_spec = (stage_axis,) + (tuple(state_spec) if state_spec is not None else (None,) * (len(shape) - 1))
    split = lambda x: mesh_split(x, mesh, state_spec)
    xs = snp.concatenate([microbatches, snp.zeros((s - 1,) + shape[1:], microbatches.dtype)], 0)
    first = snp.broadcast_in_dim(snp.arange(s) == 0, shape, (0,))

    def step(state, x):
        shifted = snp.lax_pad(state, np.zeros((), state.dtype), [(1, -1, 0)] + [(0, 0, 0)] * (len(shape) - 1))
        state = split(snp.where(first, snp.broadcast_in_dim(x, shape, tuple(range(1, len(shape)))), shifted))
        state = split(stage_fn(params, state))
        return state, state
    _, ys = scan(step, split(snp.zeros(shape, microbatches.dtype)), xs, policy=policy)
    return ys[s - 1:, s - 1]


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


__all__ = ["pipeline", "check_stages"]
