"""The compiled scatter of max-pooling's gradient (exec/backends/window_loops.py) against NumPy's bincount kernel
(ops/windows.py), bit for bit, on 1-d and 2-d windows with padding, crops, strides past the window and ties."""
import numpy as np
import pytest

from spmd_runtime.exec.backends import numpy_c, window_loops
from spmd_runtime.ops import windows

pytestmark = pytest.mark.skipif(not numpy_c.enabled() or not numpy_c.compiler_available(),
                                reason="no C compiler: the NumPy kernel runs")

CASES = [  # x shape, window, strides, padding
    ((32, 16, 32, 32), (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))),  # the conv net's pool
    ((4, 5, 7), (1, 1, 3), (1, 1, 2), ((0, 0), (0, 0), (1, 0))),  # 1-d
    ((3, 4, 4, 4), (1, 1, 4, 4), (1, 1, 4, 4), ((0, 0),) * 4),  # a global pool
    ((2, 3, 9, 8), (1, 1, 2, 3), (1, 1, 1, 2), ((0, 0), (0, 0), (0, 1), (2, 2))),
    ((2, 3, 9, 8), (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (-1, 1), (1, -2))),  # crops
    ((2, 3, 5, 4), (1, 1, 2, 2), (1, 1, 3, 3), ((0, 0),) * 4),  # strides past the window: elements no window reads
    ((6, 10), (3, 2), (2, 1), ((1, 1), (0, 1))),  # every dim a window dim
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape, window, strides, padding", CASES)
def test_compiled_scatter_gives_the_bincount_kernels_bits(shape, window, strides, padding, dtype):
    rng = np.random.default_rng(len(shape) + sum(window))
    x = np.round(np.maximum(rng.standard_normal(shape), 0), 1).astype(dtype)  # ReLU'd and rounded: many ties
    y = windows.reduce_window_kernel(np, x, "max", window, strides, padding)
    taps = windows.window_select_kernel(np, x, y, window, strides, padding)
    g = rng.standard_normal(y.shape).astype(dtype)
    low = tuple(lo for lo, _ in padding)
    want = windows.window_scatter_kernel(np, g, taps, window=window, strides=strides, low=low, shape=shape)
    geo = window_loops.geometry(shape, g.shape, window, strides, low)
    got = window_loops.scatter_loop(dtype)(g, taps, shape, geo)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_other_forms_and_dtypes_keep_the_numpy_kernel():
    assert window_loops.geometry((2, 4, 4, 4), (2, 2, 2, 2), (1, 3, 3, 3), (1, 2, 2, 2), (0, 1, 1, 1)) is None  # 3-d
    assert window_loops.scatter_loop("float16") is None and window_loops.scatter_loop("int32") is None
    assert window_loops.geometry((8, 3, 4), (8, 3, 2), (1, 1, 2), (1, 1, 2), (0, 0, 0)) == (24, 1, 4, 1, 2, 1, 2,
                                                                                           1, 2, 0, 0)
