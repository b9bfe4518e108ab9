"""Gradient cases of the windowed family (conv, reduce_window, cumsum), in the format of op_cases.py.

Each case differentiates ``sum(f(args) * c)`` (``c`` a fixed cotangent pattern, so every output position
weighs differently). With ``m=spmd_runtime.numpy`` the gradient is traced with ``spmd_runtime.grad``;
with ``m=numpy`` it comes from the ``loop_*_adjoint`` functions below: explicit loops over output
positions and window taps that scatter each output's cotangent to the elements it read, written
independently of the VJP rules (no flipped kernels, no transposed convolutions). Max/min pooling
routes to the FIRST in-bounds tap (row-major) equal to the window's result, XLA's SelectAndScatter semantics.
Spatial sizes are uneven on purpose (7, 10, 11, 13 over up to 8 shards).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from op_cases import Case
from op_cases_windows import _pads, _per_dim, _source_index, loop_conv, loop_reduce_window, windows


# ---------------------------------------------------------------- independent loop adjoints
def loop_conv_adjoint(x, w, g, window_strides=None, padding="VALID", lhs_dilation=None, rhs_dilation=None,
                      feature_group_count=1):
    """(dx, dw) of ``sum(conv(x, w) * g)``: every output position scatters g back through each tap."""
    nsp, groups = x.ndim - 2, feature_group_count
    strides, ld, rd = (_per_dim(v, nsp) for v in (window_strides, lhs_dilation, rhs_dilation))
    pads = _pads(padding, x.shape[2:], w.shape[2:], strides, ld, rd)
    cg, og = x.shape[1] // groups, w.shape[0] // groups
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for pos in itertools.product(*map(range, g.shape[2:])):
        for tap in itertools.product(*map(range, w.shape[2:])):
            src = _source_index(pos, tap, strides, pads, ld, rd, x.shape[2:])
            if src is None:
                continue
            for k in range(groups):
                xs = (slice(None), slice(k * cg, (k + 1) * cg)) + src  # (N, C / groups) at the source
                ws = (slice(k * og, (k + 1) * og), slice(None)) + tap  # (O / groups, C / groups) at the tap
                gs = g[(slice(None), slice(k * og, (k + 1) * og)) + pos]  # (N, O / groups)
                dx[xs] += gs @ w[ws]
                dw[ws] += gs.T @ x[xs]
    return dx, dw


def loop_reduce_window_adjoint(x, g, kind, window, strides=None, padding="VALID"):
    """dx of ``sum(reduce_window(x) * g)``; max/min: to the first tap equal to the window's result."""
    strides, ones = _per_dim(strides, x.ndim), (1,) * x.ndim
    pads = _pads(padding, x.shape, window, strides, ones, ones)
    y = loop_reduce_window(x, kind, window, strides, padding)
    dx = np.zeros(x.shape, np.float64 if kind == "avg" else x.dtype)
    for pos in itertools.product(*map(range, g.shape)):
        for tap in itertools.product(*map(range, window)):
            src = _source_index(pos, tap, strides, pads, ones, ones, x.shape)
            if kind in ("sum", "avg"):
                if src is not None:
                    dx[src] += g[pos] / (math.prod(window) if kind == "avg" else 1)
            elif src is not None and x[src] == y[pos]:  # padding is never chosen
                dx[src] += g[pos]
                break
    return dx


def loop_cumsum_adjoint(g, axis):
    """dx of ``sum(cumsum(x, axis) * g)``: element i collects g at positions i.. along the axis."""
    moved = np.moveaxis(g, axis, 0)
    out = np.zeros_like(moved)
    for i in range(len(moved)):
        out[i] = moved[i:].sum(axis=0)
    return np.moveaxis(out, 0, axis)


def cotangent_pattern(shape):
    """A fixed cotangent: distinct, smooth, sign-changing weights (identical for NumPy and traced runs)."""
    return np.cos(np.arange(math.prod(shape), dtype=np.float64) * 0.7).reshape(shape) + 0.1


def weighted_grad(m, fn, args, argnums):
    """The gradient of ``sum(fn(*args) * c)`` with respect to ``args[argnums]``, traced (m is snp)."""
    import spmd_runtime as sr

    def loss(*xs):
        out = fn(m, *xs)
        return m.sum(out * m.asarray(cotangent_pattern(out.shape)))
    return sr.grad(loss, argnums)(*args)


# ---------------------------------------------------------------- cases
def _conv_grad(**kwargs):
    def case(m, x, k):
        if m is np:
            g = cotangent_pattern(loop_conv(x, k, **kwargs).shape)
            return loop_conv_adjoint(x, k, g, **kwargs)
        return weighted_grad(m, lambda mm, a, b: mm.conv(a, b, **kwargs), (x, k), (0, 1))
    return case


def _pool_grad(kind, window, strides, padding):
    def case(m, x):
        if m is np:
            g = cotangent_pattern(loop_reduce_window(x, kind, window, strides, padding).shape)
            return loop_reduce_window_adjoint(x, g, kind, window, strides, padding)
        return weighted_grad(m, lambda mm, a: mm.reduce_window(a, kind, window, strides, padding), (x,), 0)
    return case


def _cumsum_grad(axis):
    def case(m, x):
        if m is np:
            return loop_cumsum_adjoint(cotangent_pattern(x.shape), axis)
        return weighted_grad(m, lambda mm, a: mm.cumsum(a, axis), (x,), 0)
    return case


POOL = dict(window=(1, 1, 3, 3), strides=(1, 1, 2, 2), padding="SAME")


def conv_net(m, x, k):
    """conv (SAME) -> tanh -> 3x3 / 2 max pool (SAME) -> weighted sum: the loss of a small CNN."""
    h = m.tanh(windows(m).conv(x, k, 1, "SAME"))
    p = windows(m).reduce_window(h, "max", POOL["window"], POOL["strides"], POOL["padding"])
    return m.sum(p * cotangent_pattern(p.shape))


def conv_net_grad(m, x, k):
    """(dx, dk) of ``conv_net``: traced with sr.grad, or by hand from the loop adjoints."""
    if m is not np:
        import spmd_runtime as sr
        return sr.grad(lambda a, b: conv_net(m, a, b), (0, 1))(x, k)
    h = np.tanh(loop_conv(x, k, 1, "SAME"))
    p = loop_reduce_window(h, "max", POOL["window"], POOL["strides"], POOL["padding"])
    dh = loop_reduce_window_adjoint(h, cotangent_pattern(p.shape), "max", **POOL)
    return loop_conv_adjoint(x, k, dh * (1.0 - h * h), 1, "SAME")


H = (None, None, "A", None)  # NCHW with H split over the first mesh axis
NH = ("A", None, "B", None)  # batch over the first axis, H over the second
CASES = [
    Case("grad_conv1d_same", _conv_grad(window_strides=1, padding="SAME"), ((2, 3, 13), (4, 3, 3)),
         (((None, None, "A"), None), (("A", None, "B"), None))),
    Case("grad_conv1d_stride2_dilated", _conv_grad(window_strides=2, padding=((2, 1),), rhs_dilation=2),
         ((2, 2, 11), (3, 2, 3)), (((None, None, "A"), None),)),
    Case("grad_conv2d_groups", _conv_grad(window_strides=(2, 1), padding="SAME", feature_group_count=2),
         ((2, 4, 10, 7), (6, 2, 3, 3)), ((H, None), ((None, "A", None, "B"), None))),
    Case("grad_maxpool2d", _pool_grad("max", (1, 1, 3, 3), (1, 1, 2, 2), "SAME"), ((2, 2, 11, 7),),
         ((H,), ((None, None, "A", "B"),))),
    Case("grad_maxpool2d_stride1", _pool_grad("max", (1, 1, 3, 2), (1, 1, 1, 1), "VALID"), ((2, 2, 10, 7),),
         ((H,), (NH,))),
    # the scatter's halo spans two shards (window 7 over 13 rows on 8: blocks of 2): multi-hop exchanges
    Case("grad_maxpool_wide", _pool_grad("max", (1, 1, 7, 1), (1, 1, 1, 1), ((0, 0), (0, 0), (3, 3), (0, 0))),
         ((2, 1, 13, 3),), ((H,), (NH,))),
    # stride past the window: rows in no window get nothing; asymmetric padding
    Case("grad_minpool_gaps", _pool_grad("min", (1, 1, 2, 2), (1, 1, 3, 2), ((0, 0), (0, 0), (1, 1), (0, 1))),
         ((2, 2, 11, 5),),
         ((H,), ((None, "A", "B", None),))),
    Case("grad_avgpool2d", _pool_grad("avg", (1, 1, 2, 2), (1, 1, 2, 2), "VALID"), ((2, 2, 13, 7),),
         ((H,), (NH,))),
    Case("grad_sum_window_1d", _pool_grad("sum", (4, 1), (1, 1), ((2, 1), (0, 0))), ((13, 5),),
         ((("A", None),), ((("A", "B"), None),))),
    Case("grad_cumsum_rows", _cumsum_grad(0), ((10, 7),), ((("A", None),), (("A", "B"),))),
    Case("grad_cumsum_last", _cumsum_grad(-1), ((5, 13),), (((None, "A"),), (("B", "A"),))),
    Case("grad_conv_net", conv_net_grad, ((2, 3, 10, 7), (4, 3, 3, 3)), ((H, None), (NH, None))),
]
