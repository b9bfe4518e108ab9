"""Collectives on 16-bit floating buffers (float16, bfloat16).

MPI has no standard 16-bit floating datatype (MPICH's MPIX_C_FLOAT16 is an
extension, bfloat16 has none) and no reduction over one everywhere. So:

- Transfers (all-gather, all-to-all, permutes) move the raw 2-byte elements:
  the arrays are viewed as uint16, which every MPI has. No conversion, no copy.
- Reductions transfer 16 bits and reduce in float32: an all-to-all of the k
  blocks (each rank receives every rank's copy of its block, 16-bit), a local
  float32 sum (or max/min) rounded to 16 bits once, then, for an all-reduce, an
  all-gather of the reduced blocks (16-bit). That is exactly the wire bytes of a
  ring all-reduce / reduce-scatter, (k-1)/k * S per phase, half of the float32
  bytes; the sum is rounded once instead of k-1 times (a 16-bit user-defined MPI
  op would round at every hop), and every rank gets bit-identical results.
  Chosen over a user-defined ``MPI.Op``, whose Python callback would run per
  message segment inside MPI.

``bind`` mirrors ``collectives.bind`` (every decision made once per shape) and
builds on its uint16 binders, so buffers, staging and reuse work as there. A move
may be nonblocking (its start's ``Pending`` seen through ``Viewed``); the
reductions (the kinds whose ``sixteen_bit`` is ``FLOAT32`` in ``collective_kinds.py``) are blocking.
"""
from __future__ import annotations

import math

import numpy as np

from spmd_runtime.collective_kinds import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER
from spmd_runtime.comm.communicator import mpi_op
from spmd_runtime.dtypes import ACCUMULATE

WIRE = np.dtype(np.uint16)


def bind(raw_bind, mc, kind, xp, shape, dtype, *, reuse, nonblocking=False, **attrs):
    """``f(x)`` running collective ``kind`` (a ``collective_kinds`` kind) on 16-bit ``dtype`` arrays; ``raw_bind``
    is ``collectives.bind``. ``nonblocking`` (moves only): ``start(x) -> Viewed``."""
    raw = lambda kind, shape, **a: raw_bind(mc, kind, xp, shape, WIRE, reuse=reuse, **a)
    reduction = _REDUCTIONS.get(kind)
    if reduction is not None:  # several collectives and a float32 reduction: blocking only
        return reduction(raw, mc, xp, shape, dtype, **attrs)
    move = raw(kind.name, shape, nonblocking=nonblocking, **attrs)
    if nonblocking:
        return lambda x: Viewed(move(x.view(WIRE)), dtype)
    return lambda x: move(x.view(WIRE)).view(dtype)


class Viewed:
    """An issued nonblocking move of 16-bit floats: its uint16 ``Pending``, the result seen as ``dtype``."""

    __slots__ = ("pending", "dtype")

    def __init__(self, pending, dtype):
        self.pending, self.dtype = pending, dtype

    def __repr__(self):
        return f"Viewed({self.pending!r} as {self.dtype})"

    def test(self) -> bool:
        return self.pending.test()

    def wait(self):
        return self.pending.wait().view(self.dtype)


def _bind_all_reduce(raw, mc, xp, shape, dtype, axes, op="sum"):
    mpi_op(op)  # a bad op is rejected even where k == 1 needs no MPI call
    k, n = mc.axis_size(axes), math.prod(shape)
    if k == 1:
        return lambda x: x.copy()
    block = -(-n // k)
    reduce = _bind_reduce_blocks(raw, xp, (k, block), dtype, axes, op)
    gather = raw(ALL_GATHER.name, (block,), axes=axes, dim=0)
    pad = xp.zeros(block * k - n, dtype)

    def run(x):
        flat = x.reshape(-1)
        blocks = (xp.concatenate([flat, pad]) if pad.size else flat).reshape(k, block)
        return gather(reduce(blocks).view(WIRE)).view(dtype)[:n].reshape(shape)
    return run


def _bind_reduce_scatter(raw, mc, xp, shape, dtype, axes, dim, op="sum"):
    mpi_op(op)
    k, ndim = mc.axis_size(axes), len(shape)
    if not -ndim <= dim < ndim or shape[dim % ndim] % k:
        raise ValueError(f"{REDUCE_SCATTER.name} needs a dim in [-{ndim}, {ndim}) whose size the group size {k} "
                         f"divides; got dim {dim} of shape {shape}")
    dim %= ndim
    if k == 1:
        return lambda x: x.copy()
    front = (shape[dim] // k,) + shape[:dim] + shape[dim + 1:]
    reduce = _bind_reduce_blocks(raw, xp, (k, math.prod(front)), dtype, axes, op)
    return lambda x: xp.moveaxis(reduce(xp.moveaxis(x, dim, 0).reshape(k, -1)).reshape(front), 0, dim)


def _bind_reduce_blocks(raw, xp, blocks_shape, dtype, axes, op):
    """``blocks (k, m) -> (m,)``: block ``index_along(axes)`` of the group's elementwise ``op``, 16-bit in and out."""
    exchange = raw(ALL_TO_ALL.name, blocks_shape, axes=axes, split_dim=0, concat_dim=0)
    if op == "sum":
        return lambda blocks: xp.sum(exchange(blocks.view(WIRE)).view(dtype), axis=0, dtype=ACCUMULATE).astype(dtype)
    if op == "prod":  # multiplied in float32 and rounded once, as the sum
        return lambda blocks: xp.prod(exchange(blocks.view(WIRE)).view(dtype), axis=0, dtype=ACCUMULATE).astype(dtype)
    reduce = getattr(xp, op)  # max/min are exact in any precision
    return lambda blocks: reduce(exchange(blocks.view(WIRE)).view(dtype), axis=0)


_REDUCTIONS = {ALL_REDUCE: _bind_all_reduce, REDUCE_SCATTER: _bind_reduce_scatter}  # the FLOAT32 kinds

__all__ = ["bind", "Viewed"]
