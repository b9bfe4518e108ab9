"""Reverse-mode rules (VJPs) of the windowed ops of ``ops/windows.py``: conv, reduce_window and cumsum, registered
in ``table.py``.

Every rule is written with traced ops that already exist and partition (conv, reduce_window, cumsum,
reverse, transpose, reshape, select), so a gradient graph partitions like any other.

- conv (JAX's ``_conv_general_dilated_transpose_lhs`` / ``_rhs``): the input cotangent is a conv of
  the cotangent with the spatially flipped kernel whose input and output features trade places in
  every group, with ``lhs_dilation`` = the forward strides, stride = the forward ``lhs_dilation``,
  and padding that puts each input element under exactly the outputs that read it. The kernel
  cotangent is a conv of the input (features as batch) with the cotangent (batch as features):
  the batch is contracted, window taps come out as output positions (stride = forward
  ``rhs_dilation``, rhs dilation = forward strides). Feature groups are folded into the contracted
  dim, which does what XLA's ``batch_group_count`` would.
- reduce_window, seen as a conv with one input feature (``PoolAsConv``: the windowed dims become
  spatial dims, the others fold into the batch), so its gradient partitions with the conv's halo
  exchange. 'sum' (and 'avg': a window sum times a constant whose ``mul`` has its own rule): the
  transpose of a window sum is the input cotangent of a conv with a ones kernel.
- reduce_window 'max' / 'min': each window's cotangent goes to the FIRST in-bounds tap, in row-major
  window order, that holds the window's result, as XLA's SelectAndScatter with a ``>=`` (``<=``)
  select does (JAX's gradient of max pooling): ties inside a window never split the cotangent, and
  padding is never chosen (a window of padding only, or whose result is NaN, routes nothing). An
  element chosen by several overlapping windows collects all their cotangents. Two ops of their own
  (``window_select``: each window's chosen tap, from x and the result; ``window_scatter``: the cotangents
  added at those taps), each a tap-by-tap kernel and a halo exchange where a windowed dim is split; the
  scatter's own VJP (second order) reads the taps through a one-hot conv.
- cumsum: the reverse cumulative sum, ``flip(cumsum(flip(g)))``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...ops import core
from ...ops.slicing import flip
from ...ops.windows import (CONV, CUMSUM, REDUCE_WINDOW, WINDOW_SCATTER, WINDOW_SELECT, conv, cumsum, window_scatter,
                            window_select)
from .table import vjp


# ================================================================ conv
@vjp(CONV)
def _conv_vjp(node, g, ops, y):
    lhs, rhs = ops
    return [lambda: conv_lhs_cotangent(g, rhs, node.attrs, lhs.shape),
            lambda: conv_rhs_cotangent(lhs, g, node.attrs, rhs.shape)]


def conv_lhs_cotangent(g, rhs, attrs, lhs_shape):
    """d conv / d lhs applied to ``g``: conv of g with the flipped, feature-swapped kernel."""
    nsp, a = g.ndim - 2, attrs
    kernel = flip(_swap_kernel_features(rhs, a["groups"]), tuple(range(2, 2 + nsp)))
    pads = []
    for n, w, m, s, (lo, _), ld, rd in zip(lhs_shape[2:], rhs.shape[2:], g.shape[2:], a["strides"], a["padding"],
                                           a["lhs_dilation"], a["rhs_dilation"]):
        lhs_span, rhs_span, out_span = (n - 1) * ld + 1, (w - 1) * rd + 1, (m - 1) * s + 1
        before = rhs_span - 1 - lo
        pads.append((before, lhs_span + rhs_span - 1 - out_span - before))  # exactly n outputs
    return conv(g, kernel, window_strides=a["lhs_dilation"], padding=pads, lhs_dilation=a["strides"],
                rhs_dilation=a["rhs_dilation"], feature_group_count=a["groups"])


def conv_rhs_cotangent(lhs, g, attrs, rhs_shape):
    """d conv / d rhs applied to ``g``: lhs (features as batch) convolved with g (batch as features)."""
    a, groups, spatial = attrs, attrs["groups"], tuple(range(2, g.ndim))
    pads = []
    for n, w, m, s, (lo, _), ld, rd in zip(lhs.shape[2:], rhs_shape[2:], g.shape[2:], a["strides"], a["padding"],
                                           a["lhs_dilation"], a["rhs_dilation"]):
        lhs_span, rhs_span, out_span = (n - 1) * ld + 1, (w - 1) * rd + 1, (m - 1) * s + 1
        pads.append((lo, out_span - lhs_span + rhs_span - 1 - lo))  # exactly w outputs: one per window tap
    taps = conv(_features_as_batch(lhs, groups), core.transpose(g, (1, 0) + spatial),
                window_strides=a["rhs_dilation"], padding=pads, lhs_dilation=a["lhs_dilation"],
                rhs_dilation=a["strides"], feature_group_count=groups)
    return core.transpose(taps, (1, 0) + spatial)  # (C / G, O, *window) -> (O, C / G, *window)


def _swap_kernel_features(rhs, groups):
    """(O, C / G, *window) -> (C, O / G, *window): inside each group, input and output features swap."""
    window = rhs.shape[2:]
    spatial = tuple(range(2, 2 + len(window)))
    if groups == 1:
        return core.transpose(rhs, (1, 0) + spatial)
    cg, og = rhs.shape[1], rhs.shape[0] // groups
    grouped = core.reshape(rhs, (groups, og, cg) + window)
    swapped = core.transpose(grouped, (0, 2, 1) + tuple(d + 1 for d in spatial))
    return core.reshape(swapped, (groups * cg, og) + window)


def _features_as_batch(lhs, groups):
    """(N, C, *spatial) -> (C / G, G * N, *spatial): a group-g feature sits in contracted block g, which
    the kernel-gradient conv (feature_group_count = G) pairs with group g's output features."""
    (n, c), spatial = lhs.shape[:2], lhs.shape[2:]
    dims = tuple(range(2, 2 + len(spatial)))
    if groups == 1:
        return core.transpose(lhs, (1, 0) + dims)
    grouped = core.reshape(lhs, (n, groups, c // groups) + spatial)
    moved = core.transpose(grouped, (2, 1, 0) + tuple(d + 1 for d in dims))
    return core.reshape(moved, (c // groups, groups * n) + spatial)


# ================================================================ reduce_window
@vjp(REDUCE_WINDOW)
def _reduce_window_vjp(node, g, ops, y):
    x, attrs = ops[0], node.attrs
    pool = PoolAsConv.of(attrs, x.shape)
    if pool is None:  # every window is one element: the identity
        return [g]
    if attrs["kind"] == "sum":
        return [lambda: window_sum_transpose(g, pool, x.shape)]
    w, st, p = attrs["window"], attrs["strides"], attrs["padding"]
    return [lambda: window_scatter(g, window_select(x, y, w, st, p), w, st, p, x.shape)]


@dataclass(frozen=True)
class PoolAsConv:
    """A reduce_window seen as a conv with one input feature, so its gradient rides on the conv's halo
    exchange (a strided static slice of a split dim would gather it): the windowed dims become the
    spatial dims of an (N, 1, *spatial) lhs; the other dims (window 1, stride 1, no padding) fold into N."""
    perm: tuple[int, ...]  # x's dims, folded ones first, then the windowed ones
    lhs_shape: tuple[int, ...]  # (N, 1, *spatial)
    window: tuple[int, ...]
    attrs: dict  # the conv's attributes: strides, padding, dilations 1, one group

    @classmethod
    def of(cls, attrs, shape) -> PoolAsConv | None:
        w, s, p = attrs["window"], attrs["strides"], attrs["padding"]
        windowed = [d for d in range(len(shape)) if (w[d], s[d], tuple(p[d])) != (1, 1, (0, 0))]
        if not windowed:
            return None
        folded = [d for d in range(len(shape)) if d not in windowed]
        ones = (1,) * len(windowed)
        conv_attrs = {"strides": tuple(s[d] for d in windowed), "padding": tuple(tuple(p[d]) for d in windowed),
                      "lhs_dilation": ones, "rhs_dilation": ones, "groups": 1}
        lhs_shape = (math.prod(shape[d] for d in folded), 1) + tuple(shape[d] for d in windowed)
        return cls(tuple(folded + windowed), lhs_shape, tuple(w[d] for d in windowed), conv_attrs)

    def to_conv(self, t):
        """x-shaped (or result-shaped) t in conv layout (N, 1, *spatial)."""
        moved = core.transpose(t, self.perm)
        return core.reshape(moved, self.lhs_shape[:2] + moved.shape[moved.ndim - len(self.window):])

    def from_conv(self, t, shape):
        moved = core.reshape(t, tuple(shape[d] for d in self.perm))
        return core.transpose(moved, tuple(int(d) for d in np.argsort(self.perm)))

    def windows(self, t, kernel):
        return conv(t, kernel, self.attrs["strides"], self.attrs["padding"])


def window_sum_transpose(g, pool: PoolAsConv, shape):
    """Each input element gets the sum of the cotangents of the windows that read it: the input
    cotangent of a conv with a ones kernel."""
    ones = core.asarray(np.ones((1, 1) + pool.window, g.dtype))
    return pool.from_conv(conv_lhs_cotangent(pool.to_conv(g), ones, pool.attrs, pool.lhs_shape), shape)


def window_select_transpose(g, taps, attrs, shape):
    """The cotangent of window_scatter's g: window o gets the cotangent at the element its tap ``taps[o]`` reads
    (0 where it chose none). A conv with a one-hot kernel lays each window's taps along the feature dim
    (exactly: one product by 1, the others by 0); the chosen one is picked by its index."""
    window, strides, low = attrs["window"], attrs["strides"], attrs["low"]
    padding = tuple((lo, (m - 1) * s + w - n - lo) for lo, m, s, w, n in zip(low, taps.shape, strides, window, shape))
    pool = PoolAsConv.of({"window": window, "strides": strides, "padding": padding}, shape)
    if pool is None:
        return core.where(taps == 0, g, 0.0)
    count = math.prod(pool.window)
    one_hot = core.asarray(np.eye(count, dtype=g.dtype).reshape((count, 1) + pool.window))
    read = pool.windows(pool.to_conv(g), one_hot)  # (N, taps, *out)
    tap_index = np.arange(count, dtype=np.int32).reshape((1, count) + (1,) * len(pool.window))
    chosen = pool.to_conv(taps) == core.asarray(tap_index)
    return pool.from_conv(core.sum(core.where(chosen, read, 0.0), axis=1, keepdims=True), taps.shape)


@vjp(WINDOW_SCATTER)
def _window_scatter_vjp(node, g, ops, y):
    return [lambda: window_select_transpose(g, ops[1], node.attrs, node.shape), None]


@vjp(WINDOW_SELECT)
def _window_select_vjp(node, g, ops, y):
    return [None, None]  # tap indices: no gradient


# ================================================================ cumsum
@vjp(CUMSUM)
def _cumsum_vjp(node, g, ops, y):
    axis = node.attrs["axis"]
    return [lambda: flip(cumsum(flip(g, axis), axis), axis)]
