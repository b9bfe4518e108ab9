"""Op cases of the windowed family (conv, reduce_window, cumsum), in the format of op_cases.py.

Each case function is written once against a module ``m``: traced with ``m=spmd_runtime.numpy``;
with ``m=numpy`` the window ops come from ``LOOPS``, plain loops over output positions and window
taps (no strided views, no padding helpers), an independent check of the reference evaluator.
Spatial sizes are uneven on purpose (7, 10, 11, 13 over up to 8 shards) and a few are 24 or 16
(even, with stride-2 outputs that line up with the input blocks). Several cases shift or exp their
input first: inputs arrive zero-padded, so only a non-zero padding shows whether it is masked.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from op_cases import Case


# ---------------------------------------------------------------- independent loop implementations
def _per_dim(v, n):
    return (1,) * n if v is None else (v,) * n if isinstance(v, int) else tuple(v)


def _same_padding(sizes, window, strides, lhs_dil, rhs_dil):
    pads = []
    for n, w, s, ld, rd in zip(sizes, window, strides, lhs_dil, rhs_dil):
        dilated, span = (n - 1) * ld + 1, (w - 1) * rd + 1
        out = math.ceil(dilated / s)
        total = max((out - 1) * s + span - dilated, 0)
        pads.append((total // 2, total - total // 2))
    return pads


def _pads(padding, sizes, window, strides, lhs_dil, rhs_dil):
    if padding == "VALID":
        return [(0, 0)] * len(sizes)
    if padding == "SAME":
        return _same_padding(sizes, window, strides, lhs_dil, rhs_dil)
    return [tuple(p) for p in padding]


def _source_index(pos, tap, strides, pads, lhs_dil, rhs_dil, sizes):
    """Input element read by window tap ``tap`` at output ``pos``, or None when it is padding / a hole."""
    index = []
    for o, t, s, (lo, _), ld, rd, n in zip(pos, tap, strides, pads, lhs_dil, rhs_dil, sizes):
        p = o * s - lo + t * rd  # position in the dilated, padded input
        if p % ld or not 0 <= p // ld < n:
            return None
        index.append(p // ld)
    return tuple(index)


def loop_conv(x, w, window_strides=None, padding="VALID", lhs_dilation=None, rhs_dilation=None,
              feature_group_count=1):
    nsp, groups = x.ndim - 2, feature_group_count
    strides, ld, rd = (_per_dim(v, nsp) for v in (window_strides, lhs_dilation, rhs_dilation))
    pads = _pads(padding, x.shape[2:], w.shape[2:], strides, ld, rd)
    out_sp = [((n - 1) * l + 1 + lo + hi - (k - 1) * r - 1) // s + 1
              for n, k, s, (lo, hi), l, r in zip(x.shape[2:], w.shape[2:], strides, pads, ld, rd)]
    cg, og = x.shape[1] // groups, w.shape[0] // groups
    out = np.zeros((x.shape[0], w.shape[0], *out_sp), np.result_type(x, w))
    for pos in itertools.product(*map(range, out_sp)):
        for tap in itertools.product(*map(range, w.shape[2:])):
            src = _source_index(pos, tap, strides, pads, ld, rd, x.shape[2:])
            if src is None:
                continue
            for g in range(groups):
                xs = x[(slice(None), slice(g * cg, (g + 1) * cg)) + src]  # (N, C / groups)
                ws = w[(slice(g * og, (g + 1) * og), slice(None)) + tap]  # (O / groups, C / groups)
                out[(slice(None), slice(g * og, (g + 1) * og)) + pos] += xs @ ws.T
    return out


def loop_reduce_window(x, kind, window, strides=None, padding="VALID"):
    strides, ones = _per_dim(strides, x.ndim), (1,) * x.ndim
    pads = _pads(padding, x.shape, window, strides, ones, ones)
    out_sp = [(n + lo + hi - k) // s + 1 for n, k, s, (lo, hi) in zip(x.shape, window, strides, pads)]
    big = np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).max
    init, step = {"max": (-big, max), "min": (big, min), "sum": (0, lambda a, b: a + b),
                  "avg": (0, lambda a, b: a + b)}[kind]
    out = np.empty(out_sp, np.float64 if kind == "avg" else x.dtype)
    for pos in itertools.product(*map(range, out_sp)):
        acc = init
        for tap in itertools.product(*map(range, window)):
            src = _source_index(pos, tap, strides, pads, ones, ones, x.shape)
            acc = step(acc, init if src is None else x[src])
        out[pos] = acc / math.prod(window) if kind == "avg" else acc
    return out


def loop_cumsum(x, axis=None):
    if axis is None:
        x, axis = x.reshape(-1), 0
    x = np.moveaxis(x.astype(np.cumsum(np.zeros(0, x.dtype)).dtype), axis, 0)
    out = x.copy()
    for i in range(1, len(out)):
        out[i] = out[i - 1] + x[i]
    return np.moveaxis(out, 0, axis)


class LOOPS:
    conv = staticmethod(loop_conv)
    reduce_window = staticmethod(loop_reduce_window)
    cumsum = staticmethod(loop_cumsum)


def windows(m):
    """The window ops of ``m``: spmd_runtime.numpy's, or the loop implementations for plain NumPy."""
    return m if hasattr(m, "reduce_window") else LOOPS


# ---------------------------------------------------------------- cases
def _conv_relu_conv(m, x, k1, k2):
    h = m.maximum(windows(m).conv(x, k1, 1, "SAME"), 0.0)
    return windows(m).conv(h, k2, 1, "SAME")


def _pool_chain(m, x):
    p = windows(m).reduce_window(x, "max", (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    return windows(m).reduce_window(p, "avg", (1, 1, 2, 2), (1, 1, 1, 1), "SAME")


H = (None, None, "A", None)  # NCHW with H split over the first mesh axis
CASES = [
    Case("conv1d_same", lambda m, x, k: windows(m).conv(x, k, 1, "SAME"), ((4, 3, 24), (5, 3, 3)),
         (((None, None, "A"), None), (("A", None, "B"), None), ((None, None, ("A", "B")), None))),
    Case("conv1d_valid_uneven", lambda m, x, k: windows(m).conv(x + 1.0, k, 1, "VALID"), ((2, 3, 13), (4, 3, 5)),
         (((None, None, "A"), None), ((None, None, ("A", "B")), None))),
    Case("conv2d_same_uneven", lambda m, x, k: windows(m).conv(m.exp(x), k, (1, 1), "SAME"),
         ((2, 3, 10, 7), (4, 3, 3, 3)),
         ((H, None), ((None, None, "A", "B"), None), ((None, None, ("A", "B"), None), None))),
    Case("conv2d_stride2", lambda m, x, k: windows(m).conv(x, k, 2, ((1, 1), (1, 1))), ((2, 4, 16, 16), (6, 4, 3, 3)),
         ((H, None), ((None, None, "A", "B"), None))),
    Case("conv2d_stride_uneven", lambda m, x, k: windows(m).conv(x - 1.0, k, (2, 3), ((1, 0), (0, 1))),
         ((2, 2, 11, 10), (3, 2, 3, 2)), ((H, None), ((None, None, "B", "A"), None))),
    Case("conv2d_dilated", lambda m, x, k: windows(m).conv(x, k, 1, ((2, 2), (1, 1)), lhs_dilation=(1, 2),
                                                      rhs_dilation=(2, 1)),
         ((2, 3, 12, 8), (4, 3, 3, 3)), ((H, None), ((None, None, "B", "A"), None))),
    Case("conv1d_transposed", lambda m, x, k: windows(m).conv(x, k, 1, ((1, 1),), lhs_dilation=2),
         ((2, 3, 16), (2, 3, 3)), (((None, None, "A"), None), (("B", None, "A"), None))),
    Case("conv2d_groups", lambda m, x, k: windows(m).conv(x, k, 1, "SAME", feature_group_count=3),
         ((2, 6, 12, 8), (9, 2, 3, 3)), (((None, "A", None, None), None), (H, (None, None, None, None)))),
    Case("conv1d_depthwise", lambda m, x, k: windows(m).conv(x, k, 1, "SAME", feature_group_count=8),
         ((2, 8, 10), (8, 1, 3)), (((None, "A", None), None), ((None, "A", "B"), None))),
    Case("conv3d", lambda m, x, k: windows(m).conv(x, k, 1, ((1, 1), (0, 1), (1, 1))),
         ((2, 2, 6, 5, 7), (3, 2, 3, 2, 3)), (((None, None, "A", "B", None), None),
                                               ((None, None, None, None, "A"), None))),
    Case("conv1d_features", lambda m, x, k: windows(m).conv(x + 1.0, k + 1.0, 1, "VALID"), ((6, 8, 9), (12, 8, 3)),
         ((("A", "B", None), (None, "B", None)), ((None, "A", None), ("B", "A", None)), (None, ("A", None, None)))),
    Case("conv_relu_conv", _conv_relu_conv, ((2, 3, 10, 10), (4, 3, 3, 3), (2, 4, 3, 3)), ((H, None, None),)),
    Case("maxpool2d", lambda m, x: windows(m).reduce_window(x, "max", (1, 1, 3, 3), (1, 1, 2, 2),
                                                      ((0, 0), (0, 0), (1, 1), (1, 1))),
         ((2, 3, 10, 7),), ((H,), ((None, None, "A", "B"),), (("A", None, None, "B"),))),
    Case("avgpool2d", lambda m, x: windows(m).reduce_window(x, "avg", (1, 1, 2, 2), (1, 1, 2, 2), "VALID"),
         ((2, 3, 16, 11),), ((H,), ((None, None, "A", "B"),))),
    Case("pool_chain", _pool_chain, ((2, 2, 13, 9),), ((H,), ((None, None, "B", "A"),))),
    Case("sum_window_1d", lambda m, x: windows(m).reduce_window(x + 1.0, "sum", (4, 1), (1, 1), ((2, 1), (0, 0))),
         ((13, 5),), ((("A", None),), ((("A", "B"), None),))),
    Case("min_window_int", lambda m, x: windows(m).reduce_window(x, "min", (3, 2), (2, 1), "SAME"), ((10, 7),),
         ((("A", "B"),), ((None, "A"),)), dtype="int64"),
    Case("cumsum_rows", lambda m, x: windows(m).cumsum(x + 1.0, axis=0), ((10, 7),),
         ((("A", None),), ((("A", "B"), None),), (("B", "A"),))),
    Case("cumsum_last", lambda m, x: windows(m).cumsum(x, axis=-1) * 2.0, ((5, 13),), (((None, "A"),), (("A", "B"),))),
    Case("cumsum_int_flat", lambda m, x: windows(m).cumsum(x), ((4, 6),), ((("A", None),), ((None, "B"),)),
         dtype="int64"),
]
