"""Windowed ops: convolution, reduce_window (pooling) and cumsum: their records, traced API and kernels.

Global semantics are XLA's (``ConvGeneralDilated``, ``ReduceWindow``) and NumPy's (``cumsum``):

- ``conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, feature_group_count)``: lhs is
  (N, C, *spatial), rhs is (O, C / groups, *window), the result (N, O, *out_spatial), for 1 to 3 (or
  more) spatial dims. ``padding`` is one (low, high) pair per spatial dim (negative crops), or
  "SAME" / "VALID". ``lhs_dilation`` inserts zeros between input elements (transposed convolution),
  ``rhs_dilation`` between window taps (atrous convolution).
- ``reduce_window(x, kind, window, strides, padding)``: one window/stride/padding entry per dim of x
  (pooling over NCHW is window (1, 1, kh, kw)). Padding holds the reduction's identity: -inf for
  'max', +inf for 'min', 0 for 'sum'. 'avg' is the window sum divided by the full window size,
  padding included (XLA's ``avg_pool`` default, ``count_include_pad=True`` in PyTorch terms).
- ``cumsum(x, axis)``: NumPy's, including ``axis=None`` (flattened) and its dtype promotion.
- ``window_select(x, y, ...)`` / ``window_scatter(g, taps, ...)``: max / min pooling's gradient (XLA's
  SelectAndScatter as two ops, emitted by the reduce_window VJP): each window's first in-bounds tap equal to its
  result, then the window cotangents added at those taps.

Kernels run at BLAS speed where there is a product: a conv is im2col (one strided view, one copy) and GEMMs laid
out per image or over all rows, or, for a transposed conv (lhs dilation, stride 1: the input gradient of a strided
conv), one GEMM whose products are added tap by tap (col2im); ``conv_method`` picks one from the shapes, once per
instruction when a program is bound (``exec/rules/windows.py``). Small windows reduce, select and scatter tap by
tap with whole-array ufuncs.

Their rules live in the layers that own them: propagation and partitioning (GSPMD section 3, spatial
partitioning: halo exchange) in ``partition/rules/windows.py``, the VJPs in ``autodiff/rules/windows.py``.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core
from .core import reduction

__all__ = ["conv", "conv_general_dilated", "reduce_window", "cumsum"]  # window_select / _scatter: the VJP's

CONV = define("conv")
REDUCE_WINDOW = define("reduce_window")
CUMSUM = define("cumsum")
WINDOW_EDGE = define("window_edge", "program")  # a range of one dim: the edge sent to a neighbour
HALO_WINDOW = define("halo_window", "program")  # the window a shard reads from its block and halos
CUMSUM_CARRY = define("cumsum_carry", "program")  # a block's cumsum plus the totals of the blocks before
# max / min pooling's gradient (XLA's SelectAndScatter in two ops, each with its own halo exchange): the tap each
# window routes its cotangent to, then the cotangents scattered to those taps
WINDOW_SELECT = define("window_select")
WINDOW_SCATTER = define("window_scatter", fresh=True)


REDUCE_WINDOW_KINDS = ("max", "min", "sum", "avg")


# ================================================================ traced API
def conv(lhs, rhs, window_strides=None, padding="VALID", lhs_dilation=None, rhs_dilation=None,
         feature_group_count=1) -> Tensor:
    """XLA's ConvGeneralDilated in (N, C, *spatial) x (O, C / groups, *window) -> (N, O, *out) layout.

    ``window_strides``, ``lhs_dilation`` and ``rhs_dilation`` take an int or one int per spatial dim
    (default 1); ``padding`` is "VALID", "SAME" or one (low, high) pair per spatial dim.
    """
    lhs, rhs = core.asarray(lhs), core.asarray(rhs)
    if lhs.ndim < 3 or rhs.ndim != lhs.ndim:
        raise ValueError(f"conv needs lhs (N, C, *spatial) and rhs (O, C / groups, *window) of one rank >= 3; "
                         f"got shapes {lhs.shape} and {rhs.shape}")
    nsp, groups = lhs.ndim - 2, int(feature_group_count)
    (n, c), (o, cg) = lhs.shape[:2], rhs.shape[:2]
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise ValueError(f"conv needs feature_group_count >= 1 dividing lhs features C and rhs outputs O, and rhs "
                         f"dim 1 == C / groups; got C={c}, O={o}, rhs dim 1={cg}, feature_group_count={groups}")
    strides = _per_dim(window_strides, nsp, "window_strides")
    lhs_dil = _per_dim(lhs_dilation, nsp, "lhs_dilation")
    rhs_dil = _per_dim(rhs_dilation, nsp, "rhs_dilation")
    window = rhs.shape[2:]
    pads = _padding(padding, lhs.shape[2:], window, strides, lhs_dil, rhs_dil, CONV.name)
    out = tuple(out_size(*args) for args in zip(lhs.shape[2:], window, strides, pads, lhs_dil, rhs_dil))
    if any(m < 1 for m in out):
        raise ValueError(f"conv windows must fit the padded input at least once; got output spatial size {out} for "
                         f"input {lhs.shape[2:]}, window {window}, padding {pads}, dilations {lhs_dil}/{rhs_dil}")
    dtype = np.result_type(lhs.dtype, rhs.dtype)
    attrs = {"strides": strides, "padding": pads, "lhs_dilation": lhs_dil, "rhs_dilation": rhs_dil, "groups": groups}
    return emit(CONV, [core.astype(lhs, dtype), core.astype(rhs, dtype)], attrs, (n, o) + out, dtype)


conv_general_dilated = conv  # JAX's name for the same op and signature


def reduce_window(x, kind, window, strides=None, padding="VALID") -> Tensor:
    """XLA's ReduceWindow with the identity as padding; ``kind`` is 'max', 'min', 'sum' or 'avg'.

    ``window`` has one entry per dim of x; ``strides`` an int or one per dim (default 1); ``padding``
    "VALID", "SAME" or one (low, high) pair per dim. 'avg' divides each window sum by the full window
    size, padded positions included (XLA's default; ``count_include_pad=True``); it is computed in floats.
    """
    x = core.asarray(x)
    if kind not in REDUCE_WINDOW_KINDS:
        raise ValueError(f"reduce_window kind must be one of {REDUCE_WINDOW_KINDS}; got {kind!r}")
    if isinstance(window, int) or len(window) != x.ndim:
        raise ValueError(f"reduce_window needs one window size per dim of x (shape {x.shape}); got {window!r}")
    window = _per_dim(window, x.ndim, "window")
    strides = _per_dim(strides, x.ndim, "strides")
    pads = _padding(padding, x.shape, window, strides, (1,) * x.ndim, (1,) * x.ndim, REDUCE_WINDOW.name)
    out = tuple(out_size(n, w, s, p) for n, w, s, p in zip(x.shape, window, strides, pads))
    if any(m < 1 for m in out):
        raise ValueError(f"reduce_window windows must fit the padded input at least once; got output shape {out} "
                         f"for input {x.shape}, window {window}, padding {pads}")
    if kind == "avg":
        x = core.astype(x, np.result_type(x.dtype, 1.0))
    attrs = {"kind": "sum" if kind == "avg" else kind, "window": window, "strides": strides, "padding": pads}
    y = emit(REDUCE_WINDOW, [x], attrs, out, x.dtype)
    return core.multiply(y, 1.0 / math.prod(window)) if kind == "avg" else y


def cumsum(x, axis=None, dtype=None) -> Tensor:
    """NumPy's cumsum: ``axis=None`` runs over the flattened array; ints and bools accumulate in int64."""
    x = core.asarray(x)
    if axis is None:
        x, axis = core.reshape(x, -1), 0
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"cumsum axis must be in [-{x.ndim}, {x.ndim}) for shape {x.shape}; got {axis}")
    dtype = np.dtype(dtype) if dtype is not None else np.cumsum(np.zeros(0, x.dtype)).dtype
    x = core.astype(x, dtype)
    return emit(CUMSUM, [x], {"axis": int(axis) % x.ndim}, x.shape, dtype)


def window_select(x, y, window, strides, padding) -> Tensor:
    """int32, shaped like ``y`` (a max or min reduce_window of x): the first tap (row-major in the window) of
    each window that is in bounds and equals the window's result, -1 where none is (a NaN result, a window of
    padding only). Emitted by the reduce_window VJP; padding is NaN, so it never equals a result."""
    if np.dtype(x.dtype).kind != "f":
        raise ValueError(f"window_select routes float gradients; got x of dtype {x.dtype}")
    attrs = {"window": tuple(window), "strides": tuple(strides), "padding": tuple(tuple(p) for p in padding)}
    return emit(WINDOW_SELECT, [x, y], attrs, y.shape, "int32")


def window_scatter(g, taps, window, strides, padding, shape) -> Tensor:
    """The transpose of reading tap ``taps[o]`` of window o: an array of ``shape`` where every element sums the
    ``g[o]`` of the windows whose chosen tap it is (taps -1 route nothing). Emitted by the reduce_window VJP."""
    attrs = {"window": tuple(window), "strides": tuple(strides), "low": tuple(int(p[0]) for p in padding),
             "shape": tuple(shape)}
    return emit(WINDOW_SCATTER, [g, taps], attrs, tuple(shape), g.dtype)


def out_size(n, window, stride=1, padding=(0, 0), lhs_dilation=1, rhs_dilation=1) -> int:
    """Number of window positions along one dim (XLA's ``ConvolutionDimensionNumbers`` arithmetic)."""
    lo, hi = padding
    return ((n - 1) * lhs_dilation + 1 + lo + hi - ((window - 1) * rhs_dilation + 1)) // stride + 1


def _per_dim(value, ndim, what) -> tuple[int, ...]:
    if value is None:
        return (1,) * ndim
    values = (value,) * ndim if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) != ndim or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in values):
        raise ValueError(f"{what} takes a positive int or one per dim ({ndim}); got {value!r}")
    return tuple(int(v) for v in values)


def _padding(padding, sizes, window, strides, lhs_dil, rhs_dil, what) -> tuple[tuple[int, int], ...]:
    """(low, high) per dim; 'SAME' gives ceil(n / stride) outputs, the odd element of padding going high."""
    if isinstance(padding, str):
        if padding.upper() == "VALID":
            return ((0, 0),) * len(sizes)
        if padding.upper() != "SAME":
            raise ValueError(f"{what} padding is 'SAME', 'VALID' or one (low, high) pair per dim; got {padding!r}")
        pads = []
        for n, w, s, ld, rd in zip(sizes, window, strides, lhs_dil, rhs_dil):
            dilated = (n - 1) * ld + 1
            total = max((-(-dilated // s) - 1) * s + (w - 1) * rd + 1 - dilated, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        pads = ()
    if len(pads) != len(sizes):
        raise ValueError(f"{what} padding is 'SAME', 'VALID' or one (low, high) pair per dim ({len(sizes)}); "
                         f"got {padding!r}")
    return pads


# ================================================================ kernels
@opdef.kernel(CONV)
def conv_kernel(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    method = conv_method(lhs.shape, rhs.shape, strides, padding, lhs_dilation, rhs_dilation)
    return method(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups)


# Fewer output positions than this per image: one GEMM over all rows (N * positions) beats one per image.
# Measured on this machine (1 thread, float32): a 3x3 conv 16 -> 16 on 32 x 16 x 16 x 16 takes 2.24 ms as rows,
# 0.90 ms per image; on 32 x 64 x 4 x 4 (16 positions) both ~0.85 ms; the kernel-gradient convs (9 positions,
# a long contraction) are GEMMs with 9 columns per image, far better as rows.
MIN_POSITIONS_PER_IMAGE = 32


def conv_method(lhs_shape, rhs_shape, strides, padding, lhs_dilation, rhs_dilation):
    """The conv kernel for these shapes, chosen once: exec binds it per instruction (exec/rules/windows.py).

    - a transposed conv (an lhs dilation, stride 1: the input gradient of a strided conv) scatters one GEMM's
      products tap by tap (col2im) instead of convolving the zeros the dilation inserts;
    - a stride-1 conv with many output positions: im2col of contiguous runs over the padded width (wide rows);
    - otherwise im2col through a strided view and a GEMM per image (many output positions: the result comes out
      in (N, O, *positions) order, no transpose) or one GEMM over every image's rows (few positions)."""
    if any(d > 1 for d in lhs_dilation) and all(s == 1 for s in strides):
        return conv_col2im
    positions = math.prod(out_size(*dim) for dim in zip(lhs_shape[2:], rhs_shape[2:], strides, padding, lhs_dilation,
                                                        rhs_dilation))
    if positions < MIN_POSITIONS_PER_IMAGE:
        return conv_rows
    return conv_wide_rows if wide_rows_fit(lhs_shape, rhs_shape, strides, padding, lhs_dilation) else conv_per_image


def wide_rows_fit(lhs_shape, rhs_shape, strides, padding, lhs_dilation) -> bool:
    """Whether ``conv_wide_rows`` computes this conv: stride 1, no lhs dilation, one feature group, no crop."""
    return (all(s == 1 for s in strides) and all(d == 1 for d in lhs_dilation) and lhs_shape[1] == rhs_shape[1]
            and all(lo >= 0 and hi >= 0 for lo, hi in padding))


def conv_rows(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    """im2col through a strided view, then one batched matmul (BLAS) over the feature groups: rows are
    (image, position), columns (feature, tap)."""
    nsp, (n, c), o = lhs.ndim - 2, lhs.shape[:2], rhs.shape[0]
    x = _dilate_and_pad(xp, lhs, 2, lhs_dilation, padding, 0)
    view = _window_view(xp, x, 2, rhs.shape[2:], strides, rhs_dilation)  # (N, C, *out, *window)
    out, taps = view.shape[2:2 + nsp], math.prod(rhs.shape[2:])
    cg, og = c // groups, o // groups
    cols = view.reshape((n, groups, cg) + view.shape[2:])
    sp, win = tuple(range(3, 3 + nsp)), tuple(range(3 + nsp, 3 + 2 * nsp))
    cols = cols.transpose((1, 0) + sp + (2,) + win).reshape(groups, n * math.prod(out), cg * taps)
    weights = rhs.reshape(groups, og, cg * taps).transpose(0, 2, 1)
    y = xp.matmul(cols, weights).reshape((groups, n) + out + (og,))
    return y.transpose((1, 0, 2 + nsp) + tuple(range(2, 2 + nsp))).reshape((n, o) + out)


def conv_per_image(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    """im2col through a strided view laid out (N, groups, features x taps, positions), then per image and group
    the weights (O / G, C / G x taps) times its columns: the products land in (N, O, *positions) order."""
    nsp, (n, c), o = lhs.ndim - 2, lhs.shape[:2], rhs.shape[0]
    x = _dilate_and_pad(xp, lhs, 2, lhs_dilation, padding, 0)
    view = _window_view(xp, x, 2, rhs.shape[2:], strides, rhs_dilation)  # (N, C, *out, *window)
    out = view.shape[2:2 + nsp]
    sp, win = tuple(range(2, 2 + nsp)), tuple(range(2 + nsp, 2 + 2 * nsp))
    cols = view.transpose((0, 1) + win + sp).reshape(n, groups, -1, math.prod(out))
    weights = rhs.reshape(groups, o // groups, -1)
    return xp.matmul(weights, cols).reshape((n, o) + out)


def conv_wide_rows(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    """A stride-1 conv computed over "wide" rows: each image padded and flattened, output position q and tap t
    read flat element q + offset(t), so every tap's columns are one contiguous run of the flat image (im2col
    copies runs of a padded row's length instead of an output row's) and one GEMM per image gives outputs over
    the padded width, whose extra columns are cut off after. For groups == 1, non-negative padding only."""
    nsp, (n, c), o = lhs.ndim - 2, lhs.shape[:2], rhs.shape[0]
    window = tuple((w - 1) * r + 1 for w, r in zip(rhs.shape[2:], rhs_dilation))  # the dilated window's extent
    padded = tuple(m + lo + hi for m, (lo, hi) in zip(lhs.shape[2:], padding))
    out = tuple(p - w + 1 for p, w in zip(padded, window))
    step = [math.prod(padded[d + 1:]) for d in range(nsp)]  # flat stride of each spatial dim
    wide = out[0] * step[0]  # output rows over the padded extents of the inner dims
    tail = sum((w - 1) * e for w, e in zip(window[1:], step[1:]))  # the last tap reads this far past the image
    flat = xp.zeros((n, c, math.prod(padded) + tail), lhs.dtype)
    inner = flat[:, :, :math.prod(padded)].reshape((n, c) + padded)
    inner[(slice(None), slice(None)) + tuple(slice(lo, lo + m) for m, (lo, _) in zip(lhs.shape[2:], padding))] = lhs
    item = flat.strides[2]
    view = xp.lib.stride_tricks.as_strided(flat, (n, c) + tuple(rhs.shape[2:]) + (wide,),
                                           flat.strides[:2] + tuple(e * r * item for e, r in zip(step, rhs_dilation))
                                           + (item,))
    cols = view.reshape(n, c * math.prod(rhs.shape[2:]), wide)  # a copy, contiguous runs of ``wide``
    y = xp.matmul(rhs.reshape(o, -1), cols).reshape((n, o, out[0]) + padded[1:])
    return xp.ascontiguousarray(y[(Ellipsis,) + tuple(slice(0, m) for m in out[1:])])


def conv_col2im(xp, lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups):
    """A stride-1 conv of an lhs-dilated input: input element q meets tap t at output q * D + low - t * R, so
    one GEMM gives every (output feature, tap) product of every input element and each tap's products are added
    into the output at a strided slice (no zeros convolved: D^d times fewer products than im2col)."""
    nsp, (n, c), (o, cg) = lhs.ndim - 2, lhs.shape[:2], rhs.shape[:2]
    window, inputs = rhs.shape[2:], lhs.shape[2:]
    og, taps = o // groups, math.prod(window)
    out = tuple(out_size(q, w, 1, p, d, r) for q, w, p, d, r in zip(inputs, window, padding, lhs_dilation,
                                                                    rhs_dilation))
    weights = rhs.reshape(groups, og, cg, taps).transpose(0, 1, 3, 2).reshape(groups, og * taps, cg)
    products = xp.matmul(weights, lhs.reshape(n, groups, cg, -1)).reshape((n, o, taps) + inputs)
    y = xp.zeros((n, o) + out, dtype=products.dtype)
    for t, tap in enumerate(itertools.product(*map(range, window))):
        # input element i meets tap t at output i * d + low - t * r
        spans = [_affine_span(q, m, d, p[0] - t * r) for t, q, m, p, d, r in zip(tap, inputs, out, padding,
                                                                                 lhs_dilation, rhs_dilation)]
        if all(spans):
            y[(Ellipsis,) + tuple(s[1] for s in spans)] += products[(slice(None), slice(None), t)
                                                                    + tuple(s[0] for s in spans)]
    return y


def _affine_span(count, size, step, offset):
    """(source slice, target slice) along one dim: the sources q in [0, count) whose target q * step + offset
    lies in [0, size), and those targets; None when there are none."""
    first = max(0, -(offset // step))  # ceil(-offset / step)
    last = min(count - 1, (size - 1 - offset) // step)
    if last < first:
        return None
    start = first * step + offset
    return slice(first, last + 1), slice(start, start + (last - first) * step + 1, step)


# Windows of at most this many taps reduce tap by tap (one ufunc pass over the output per tap); NumPy's
# reduction over the trailing window axes of a strided view is ~10x slower there (3x3 max-pool of
# 32 x 16 x 32 x 32 float32: 14 ms against ~1 ms); big windows (a global pool) reduce the view at once.
MAX_TAPS_ONE_BY_ONE = 64
_TAP_UFUNCS = {"max": core.MAXIMUM.ufunc, "min": core.MINIMUM.ufunc, "sum": core.ADD.ufunc}


@opdef.kernel(REDUCE_WINDOW)
def reduce_window_kernel(xp, x, kind, window, strides, padding):
    ones = (1,) * x.ndim
    padded = _dilate_and_pad(xp, x, 0, ones, padding, core.reduce_identity(kind, x.dtype))
    view = _window_view(xp, padded, 0, window, strides, ones)
    if kind not in _TAP_UFUNCS or math.prod(window) > MAX_TAPS_ONE_BY_ONE:
        return reduction(xp, kind)(view, axis=tuple(range(x.ndim, 2 * x.ndim))).astype(x.dtype, copy=False)
    combine, taps = getattr(xp, _TAP_UFUNCS[kind]), list(itertools.product(*map(range, window)))
    out = view[(Ellipsis,) + taps[0]].astype(x.dtype)  # a copy: the taps accumulate into it
    for tap in taps[1:]:
        combine(out, view[(Ellipsis,) + tap], out=out)
    return out


@opdef.kernel(WINDOW_SELECT)
def window_select_kernel(xp, x, y, window, strides, padding):
    """The first in-bounds tap equal to the result (padding is NaN: never equal), tap by tap: each hit scores
    taps - t, the highest score is the first hit (elementwise passes only: a boolean-mask assignment per tap is
    ~4x slower)."""
    ones, taps = (1,) * x.ndim, list(itertools.product(*map(range, window)))
    view = _window_view(xp, _dilate_and_pad(xp, x, 0, ones, padding, np.nan), 0, window, strides, ones)
    count = len(taps)
    dtype = np.uint8 if count < 255 else np.int32
    best, hit, score = xp.zeros(y.shape, dtype), xp.empty(y.shape, np.bool_), xp.empty(y.shape, dtype)
    for t, tap in enumerate(taps):
        xp.equal(view[(Ellipsis,) + tap], y, out=hit)
        xp.maximum(best, xp.multiply(hit, dtype(count - t), out=score), out=best)
    return xp.where(best == 0, np.int32(-1), np.int32(count) - best.astype(np.int32))


@opdef.kernel(WINDOW_SCATTER)
def window_scatter_kernel(xp, g, taps, *index, window, strides, low, shape, low_step=None, index_dims=()):
    """Output position q's tap t reads element q * stride + t - low: every window's cotangent is added there by one
    bincount over the span all windows cover (taps -1 add nothing), then that span is cut to ``shape`` (~1.7x
    faster than a strided add per tap). A partitioned shard's low grows by ``low_step`` per shard along each of
    ``index_dims`` (its shard index operand), see partition/rules/windows.py."""
    low = list(low)
    for d, i in zip(index_dims, index):
        low[d] += low_step[d] * int(i)
    span = tuple((m - 1) * s + w for m, s, w in zip(g.shape, strides, window))  # q * stride + t for all q, t
    step = [math.prod(span[d + 1:]) for d in range(len(span))]
    where = xp.zeros(g.shape, dtype=np.int64)  # flat position in the span of each window's tap 0
    for d, (m, s) in enumerate(zip(g.shape, strides)):
        along = (1,) * d + (m,) + (1,) * (g.ndim - d - 1)
        where = where + (xp.arange(m, dtype=np.int64) * (s * step[d])).reshape(along)
    offsets = [sum(t * e for t, e in zip(tap, step)) for tap in itertools.product(*map(range, window))]
    where += xp.asarray(offsets + [0], dtype=np.int64)[taps]  # tap -1 takes the trailing 0, with weight 0
    weights = xp.where(taps >= 0, g, xp.zeros((), dtype=g.dtype))
    sums = xp.bincount(where.reshape(-1), weights=weights.reshape(-1), minlength=math.prod(span)).reshape(span)
    cut = tuple((-lo, n - e + lo) for lo, n, e in zip(low, shape, span))  # element j sits at span position j + low
    return _dilate_and_pad(xp, sums, 0, (1,) * g.ndim, cut, 0).astype(g.dtype)


@opdef.kernel(CUMSUM)
def cumsum_kernel(xp, x, axis):
    return xp.cumsum(x, axis=axis, dtype=x.dtype)


def _dilate_and_pad(xp, x, first, dilation, padding, fill):
    """Dims ``first``.. of x with (d - 1) zeros between elements (lhs dilation: conv only), then padded
    with ``fill`` or, for negative pads, cropped."""
    if any(d > 1 for d in dilation):
        shape = x.shape[:first] + tuple((n - 1) * d + 1 for n, d in zip(x.shape[first:], dilation))
        spread = xp.zeros(shape, x.dtype)
        spread[(slice(None),) * first + tuple(slice(None, None, d) for d in dilation)] = x
        x = spread
    if any(lo > 0 or hi > 0 for lo, hi in padding):  # a filled array and one copy: xp.pad is ~3x slower
        widths = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
        padded = xp.full(x.shape[:first] + tuple(n + lo + hi for n, (lo, hi) in zip(x.shape[first:], widths)), fill,
                         dtype=x.dtype)
        padded[(slice(None),) * first + tuple(slice(lo, lo + n) for n, (lo, _) in zip(x.shape[first:], widths))] = x
        x = padded
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        x = x[(slice(None),) * first + tuple(slice(max(-lo, 0), n - max(-hi, 0))
                                             for n, (lo, hi) in zip(x.shape[first:], padding))]
    return x


def _window_view(xp, x, first, window, strides, dilation):
    """Read-only view (..., *positions, *window) of dims ``first``..: one strided view, no copy."""
    sizes, steps = x.shape[first:], x.strides[first:]
    positions = tuple(max(0, (n - (w - 1) * d - 1) // s + 1) for n, w, s, d in zip(sizes, window, strides, dilation))
    shape = x.shape[:first] + positions + tuple(window)
    view_strides = (x.strides[:first] + tuple(b * s for b, s in zip(steps, strides))
                    + tuple(b * d for b, d in zip(steps, dilation)))
    return xp.lib.stride_tricks.as_strided(x, shape, view_strides)


@opdef.kernel(WINDOW_EDGE)
def window_edge(xp, x, dim, start, stop):
    """Elements [start, stop) of ``dim``: the edge a shard sends to its neighbour, or its block total."""
    return x[(slice(None),) * dim + (slice(start, stop),)]


@opdef.kernel(HALO_WINDOW)
def halo_window(xp, x, *halos_and_index, dim, left, right, block, size, start, step, length, fill, dilation=1):
    """The ``length`` elements of [left halo | block | right halo] along ``dim`` that this shard's window
    reads, from offset start + step * shard; entries outside the global dim [0, size) (uneven-shard
    padding, the global edges, past the extended block) hold ``fill``. With ``dilation`` > 1: the window of
    the dilated input from dilated position start + step * shard (see partition/rules/windows.py's HaloPlan)."""
    *halos, index = halos_and_index
    i = int(index)
    before, after = halos[:1] if left else [], halos[-1:] if right else []
    ext = xp.concatenate(before + [x] + after, axis=dim) if halos else x
    if dilation > 1:
        return _dilated_window(xp, ext, dim, i * block - left, size, start + step * i, length, fill, dilation)
    offset = start + step * i
    origin = i * block - left + offset  # global element index of the window's first entry
    t0 = max(0, -offset, -origin)
    t1 = min(length, ext.shape[dim] - offset, size - origin)
    shape = list(x.shape)
    shape[dim] = length
    out = xp.full(shape, fill, dtype=x.dtype)
    if t1 > t0:
        lead = (slice(None),) * dim
        out[lead + (slice(t0, t1),)] = ext[lead + (slice(offset + t0, offset + t1),)]
    return out


def _dilated_window(xp, ext, dim, base, size, origin, length, fill, dilation):
    """Dilated positions [origin, origin + length) of the input whose real element q sits at q * dilation: the
    elements ``ext`` holds (q in [base, base + len) within [0, size)) where they fall, ``fill`` elsewhere."""
    shape = list(ext.shape)
    shape[dim] = length
    out = xp.full(shape, fill, dtype=ext.dtype)
    t0 = (-origin) % dilation  # the first window position on a real element
    q0 = (origin + t0) // dilation
    count = max(0, -(-(length - t0) // dilation))
    qa, qb = max(q0, base, 0), min(q0 + count, base + ext.shape[dim], size)
    if qb > qa:
        lead, first = (slice(None),) * dim, t0 + (qa - q0) * dilation
        out[lead + (slice(first, first + (qb - qa - 1) * dilation + 1, dilation),)] = \
            ext[lead + (slice(qa - base, qb - base),)]
    return out


@opdef.kernel(CUMSUM_CARRY)
def cumsum_carry(xp, local, totals, index, axis):
    """``local`` plus the sum of the block totals of the shards before this one (an exclusive prefix)."""
    before = totals[(slice(None),) * axis + (slice(0, int(index)),)]
    return (local + xp.sum(before, axis=axis, keepdims=True)).astype(local.dtype, copy=False)
