"""max / min pooling's gradient scatter (``window_scatter``) as a compiled C loop on the CPU, over windows of the
last two dims: one pass over the windows.

NumPy scatters each window's cotangent to its tap with one ``bincount`` over an int64 index array it builds
first (``ops/windows.py``): 0.87 ms of a conv net's ~23 ms step here (32 x 16 x 32 x 32 float32, 3x3 / 2); this
loop takes 0.41 ms. It is compiled once per machine with the fusions' compiler, flags and trusted cache
(``numpy_c.KernelLibrary``), and gives bincount's bits: each input element's cotangents summed in double in
window order, rounded once. (The pooling itself and its ``window_select`` stay NumPy's tap-by-tap passes: loops
over a window's taps per output row, 16 outputs long here, measured 1.5-3x slower than those passes.)

``geometry(...)`` puts an op in the loop's form: leading dims with a window of 1, stride 1 and no padding
flattened into one batch dim, at most two window dims after them (one is taken as 1 x W); any other op (3-d
windows, a window over a leading dim, other dtypes) runs NumPy's kernel (``exec/rules/windows.py`` decides once, at
bind).
"""
from __future__ import annotations

import ctypes
import math
import subprocess

import numpy as np

from . import numpy_c

DTYPES = {"float32": "f32", "float64": "f64"}

_LOOPS = r"""
#include <string.h>
/* each window's cotangent added at its tap, summed in double in window order (bincount's), rounded once */
#define SCATTER_LOOP(T, S)                                                                                      \
void pool_scatter_##S(const T* g, const int32_t* taps, T* out, double* acc, int64_t B, int64_t H, int64_t W,      \
                      int64_t OH, int64_t OW, int64_t KW, int64_t SH, int64_t SW, int64_t LH, int64_t LW) {        \
    memset(acc, 0, sizeof(double) * B * H * W);                                                                 \
    for (int64_t b = 0; b < B; b++) for (int64_t oh = 0; oh < OH; oh++) for (int64_t ow = 0; ow < OW; ow++) {   \
        int64_t q = (b * OH + oh) * OW + ow;                                                                    \
        int32_t t = taps[q];                                                                                    \
        if (t < 0) continue;                                                                                    \
        int64_t ih = oh * SH + t / KW - LH, iw = ow * SW + t % KW - LW;                                         \
        if (ih >= 0 && ih < H && iw >= 0 && iw < W) acc[(b * H + ih) * W + iw] += (double)g[q];                 \
    }                                                                                                           \
    for (int64_t i = 0; i < B * H * W; i++) out[i] = (T)acc[i];                                                 \
}
SCATTER_LOOP(float, f32)
SCATTER_LOOP(double, f64)
"""


def _library():
    """The compiled loop (ctypes CDLL), or None when compiling is off (``$SPMD_CPU_KERNELS``), impossible or
    fails (said once)."""
    if not numpy_c.enabled() or not numpy_c.compiler_available():
        return None
    try:
        return numpy_c.KernelLibrary({"pool_loops": _LOOPS}).lib  # compiled once per machine, loaded once
    except (numpy_c.CompileError, OSError, subprocess.SubprocessError) as error:
        numpy_c.warn_fallback(error)
        return None


def geometry(in_shape, out_shape, window, strides, low) -> tuple | None:
    """(B, H, W, OH, OW, KH, KW, SH, SW, PH, PW): the op over [B, H, W] -> [B, OH, OW] windows, or None when
    it has another form. ``low``: each dim's padding before the first element (negative: cropped)."""
    nd = len(in_shape)
    lead = next((d for d in range(nd) if window[d] != 1 or strides[d] != 1 or low[d] != 0
                 or in_shape[d] != out_shape[d]), nd)
    if nd - lead > 2 or nd == 0:
        return None
    lead = min(lead, nd - 1)  # at least one window dim (a trivial window: an identity pooling)
    pad = lambda v, fill: (fill,) * (2 - (nd - lead)) + tuple(v[lead:])
    b = math.prod(in_shape[:lead])
    (h, w), (oh, ow) = pad(in_shape, 1), pad(out_shape, 1)
    (kh, kw), (sh, sw), (ph, pw) = pad(window, 1), pad(strides, 1), pad(low, 0)
    return b, h, w, oh, ow, kh, kw, sh, sw, ph, pw


def scatter_loop(dtype):
    """``f(g, taps, shape, geometry) -> array of shape`` for ``window_scatter``, or None."""
    lib = _library()
    if lib is None or np.dtype(dtype).name not in DTYPES:
        return None
    fn = _typed(getattr(lib, f"pool_scatter_{DTYPES[np.dtype(dtype).name]}"), 4, 10)

    acc = []  # the double accumulator, made on the first call and reused (one output shape per bound instruction)

    def run(g, taps, shape, geo):
        b, h, w, oh, ow, _, kw, sh, sw, lh, lw = geo
        g, taps = np.ascontiguousarray(g), np.ascontiguousarray(taps, dtype=np.int32)
        if not acc or acc[0].size != math.prod(shape):
            acc[:] = [np.empty(math.prod(shape), np.float64)]
        out = np.empty(shape, g.dtype)
        fn(g.ctypes.data, taps.ctypes.data, out.ctypes.data, acc[0].ctypes.data, b, h, w, oh, ow, kw, sh, sw, lh, lw)
        return out
    return run


def _typed(fn, pointers: int, ints: int):
    """``fn`` with its C signature: ``pointers`` buffers, then ``ints`` int64 values."""
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * ints
    fn.restype = None
    return fn
