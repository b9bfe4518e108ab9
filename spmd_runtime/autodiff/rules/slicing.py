"""The VJP rules of the ``ops/slicing.py`` family, registered in ``table.py``: each op is linear, so its VJP
is its transpose, written with the family's traced ops."""
from __future__ import annotations

import numpy as np

from ...ops import core
from ...ops.slicing import (CONCATENATE, DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE, IOTA, PAD, REVERSE, SLICE,
                            dynamic_slice, dynamic_update_slice, lax_pad, lax_slice, reverse, slice_in_dim)
from .table import vjp


@vjp(SLICE)
def _slice_vjp(node, g, ops, y):
    """Scatter the cotangent back with zeros between strided entries (low = start, interior = stride - 1)."""
    x, a = ops[0], node.attrs
    config = []
    for n, start, stride, m in zip(x.shape, a["start"], a["strides"], node.shape):
        span = (m - 1) * stride + 1 if m else 0
        config.append((start, n - start - span, stride - 1))
    return [lambda: lax_pad(g, 0, config)]


@vjp(PAD)
def _pad_vjp(node, g, ops, y):
    """Undo low/high (crop what was added, zeros where it cropped), then keep every (interior+1)-th entry."""
    a = node.attrs

    def transpose():
        dilated = lax_pad(g, 0, [(-lo, -hi, 0) for lo, hi in zip(a["low"], a["high"])])
        return lax_slice(dilated, (0,) * g.ndim, dilated.shape, tuple(i + 1 for i in a["interior"]))
    return [transpose]


@vjp(CONCATENATE)
def _concatenate_vjp(node, g, ops, y):
    axis, offsets = node.attrs["axis"], np.cumsum([0] + [x.shape[node.attrs["axis"]] for x in ops])
    return [lambda a=a, b=b: slice_in_dim(g, int(a), int(b), axis=axis) for a, b in zip(offsets[:-1], offsets[1:])]


@vjp(REVERSE)
def _reverse_vjp(node, g, ops, y):
    return [lambda: reverse(g, node.attrs["axes"])]


@vjp(IOTA)
def _iota_vjp(node, g, ops, y):
    return []


@vjp(DYNAMIC_SLICE)
def _dynamic_slice_vjp(node, g, ops, y):
    x, starts = ops[0], ops[1:]
    return [lambda: dynamic_update_slice(core.zeros(x.shape, x.dtype), g, starts)] + [None] * len(starts)


@vjp(DYNAMIC_UPDATE_SLICE)
def _dynamic_update_slice_vjp(node, g, ops, y):
    """x's cotangent is g with the written window zeroed; the update's is that window of g."""
    update, starts = ops[1], ops[2:]
    return [lambda: dynamic_update_slice(g, core.zeros(update.shape, update.dtype), starts),
            lambda: dynamic_slice(g, starts, update.shape)] + [None] * len(starts)
