"""Windowed einsum cases shared by tests/unit/test_windowed.py (simulated world) and
tests/mpi/test_windowed_mpi.py (real MPI): x @ w with the gather or the reduce-scatter next to it on axes A."""
from __future__ import annotations

import numpy as np

import spmd_runtime as sr


def matmul(x, w):
    return x @ w


# pattern -> (shapes, in_specs, out_spec) for axes spec A and a size n (even: 24; uneven on 3/4/... shards: 7).
# Big enough that each step's einsum hides its permute under the default cost model.
PATTERNS = {
    # x's rows gathered (a kept letter): the result's rows come one block per step
    "gather_kept": lambda A, n: ([(n, 16), (16, 480)], [(A, None), (None, A)], (None, A)),
    # w's rows gathered (a contracted letter, FSDP's weight): the products of the blocks add up
    "gather_contracted": lambda A, n: ([(480, n), (n, 6)], [(A, None), (A, None)], (A, None)),
    # the partial products' rows reduce-scattered: a running sum passed round the ring
    "reduce_scatter": lambda A, n: ([(n, 24), (24, 8)], [(None, A), (A, None)], (A, None)),
}


def window_axes(mesh) -> list[tuple[str, ...]]:
    """The axes to window over on ``mesh``: each axis, and both together, of more than one shard."""
    names = (("x",), ("y",), ("x", "y")) if len(mesh.shape) == 2 else (("x",),)
    return [a for a in names if mesh.axis_size(a) > 1]


def windowed_program(pattern, mesh, axes, size, windowed=0, **kw):
    """(graph, args, program) of ``pattern`` on ``axes`` of ``mesh``, partitioned with ``windowed_einsum``."""
    shapes, ins, out = PATTERNS[pattern](axes if len(axes) > 1 else axes[0], size)
    rng = np.random.default_rng(size)
    args = [rng.standard_normal(s) for s in shapes]
    graph = sr.trace(matmul, *args)
    return graph, args, sr.partition(graph, mesh, in_specs=ins, out_specs=[out], windowed_einsum=windowed, **kw)
