"""The local reduce kernel (ops/core.py): sums over the trailing dims of a C-ordered float array are one BLAS
matrix-vector product with ones; everything else is NumPy's reduction. Both against float64 sums."""
import numpy as np
import pytest

from spmd_runtime.ops import core
from spmd_runtime.ops.core import _reduce_kernel

CASES = [  # (shape, axes, summed by BLAS)
    ((4, 8, 16, 16), (3,), True),  # attention's softmax rows
    ((4, 16, 32), (1, 2), True),
    ((6, 5), (1,), True),
    ((6, 5), (0,), False),  # a leading dim: not rows
    ((3, 4, 5), (0, 2), True),  # leading and trailing dims: row sums, then the leading dim's
    ((4, 6, 8, 8), (0, 2, 3), True),  # batch norm's statistics over NCHW
    ((2, 3, 4, 5, 6), (0, 1, 4), True),
    ((2, 3, 4, 5), (0, 2), False),  # a kept dim after a reduced middle one: NumPy's
    ((3, 4, 5), (0, 1), False),  # leading dims only
    ((2, 5000, 3), (0, 2), True),
    ((5000, 2, 3), (0, 2), False),  # more leading elements than MAX_BLAS_ROW: pairwise
    ((2, 3, 5000), (0, 2), False),
    ((7,), (0,), False),  # everything: NumPy's pairwise sum
    ((2, 5000), (1,), False),  # rows longer than MAX_BLAS_ROW keep the pairwise sum
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape, axes, blas", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sums_match_float64_sums_into_a_planned_buffer_or_fresh(shape, axes, blas, dtype, monkeypatch):
    calls = []
    real = np.matmul
    monkeypatch.setattr(core.np, "matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    want = x.astype(np.float64).sum(axis=axes)
    fresh = _reduce_kernel(np, x, "sum", axes)
    into = np.empty(want.shape, dtype)  # planned buffers come shaped as the result (exec/buffers.py)
    planned = _reduce_kernel(np, x, "sum", axes, into=into)
    for got in (fresh, planned):
        assert got.shape == want.shape and got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5)
    assert np.shares_memory(planned, into)
    assert bool(calls) == blas


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, as np.sum says
def test_special_values_propagate_through_the_blas_row_sums():
    x = np.ones((4, 8), np.float32)
    x[0, 1], x[1, 2], x[2, 0], x[2, 3] = np.nan, np.inf, np.inf, -np.inf
    got = _reduce_kernel(np, x, "sum", (1,))
    np.testing.assert_array_equal(got, np.sum(x, axis=1))  # nan, inf, nan, 8


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_special_values_propagate_through_the_outer_row_sums():
    x = np.ones((2, 4, 3, 3), np.float32)
    x[0, 1, 0, 0], x[1, 2, 2, 2], x[0, 3, 1, 1], x[1, 3, 0, 1] = np.nan, np.inf, np.inf, -np.inf
    got = _reduce_kernel(np, x, "sum", (0, 2, 3))
    np.testing.assert_array_equal(got, np.sum(x, axis=(0, 2, 3)))  # 18, nan, inf, nan
