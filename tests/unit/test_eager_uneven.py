"""Eager DArrays laid out as the Array API suite draws them at ``--ranks N`` (scripts/array_api): split on one
dim whose size may be below the rank count (some ranks hold empty blocks) or 0, and 0-d arrays. Each case is
NumPy's own function on the global array (the expectation) and snp's on the DArray, run in the simulated
world at 1-8 ranks: every rank's gathered result equals NumPy's (shape, dtype, values)."""
from __future__ import annotations

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

RANKS = (1, 2, 3, 4, 6, 8)
CASES = [  # (name, fn(m, x), shape, dtype, split dim)
    ("max_all_short", lambda m, x: m.max(x), (3,), "float64", 0),
    ("min_axis_short", lambda m, x: m.min(x, axis=0), (2, 5), "int16", 0),
    ("max_kept_split", lambda m, x: m.max(x, axis=1), (5, 2), "float32", 0),
    ("min_one_row", lambda m, x: m.min(x, axis=0, keepdims=True), (1, 4), "uint8", 0),
    ("any_empty", lambda m, x: m.any(x), (0,), "bool", 0),
    ("all_empty", lambda m, x: m.all(x), (0, 3), "bool", 0),
    ("all_empty_axis", lambda m, x: m.all(x, axis=1), (2, 0), "float64", 0),
    ("all_short", lambda m, x: m.all(x > -1), (2,), "float64", 0),
    ("any_short_axis", lambda m, x: m.any(x > 0, axis=0), (3, 2), "float64", 0),
    ("argmax_short", lambda m, x: m.argmax(x), (3,), "float64", 0),
    ("argmin_axis_short", lambda m, x: m.argmin(x, axis=0), (2, 3), "int32", 0),
    ("argmax_kept_split", lambda m, x: m.argmax(x, axis=1), (5, 3), "float64", 0),
    ("cumsum_short", lambda m, x: m.cumulative_sum(x, axis=0), (3, 2), "float64", 0),
    ("sort_short", lambda m, x: m.sort(x, axis=0), (3, 2), "float64", 0),
    ("argsort_short", lambda m, x: m.argsort(x, axis=1), (2, 3), "float64", 1),
    ("flip_short", lambda m, x: m.flip(x, axis=0), (3, 2), "int64", 0),
    ("roll_short", lambda m, x: m.roll(x, 1, axis=0), (3, 2), "int64", 0),
    ("reshape_short", lambda m, x: m.reshape(x, (2, 3)), (3, 2), "float64", 0),
    ("reshape_flat", lambda m, x: m.reshape(x, (-1,)), (2, 3), "float64", 1),
    ("concat_short", lambda m, x: m.concatenate([x, x], axis=0), (1, 3), "float64", 0),
    ("stack_short", lambda m, x: m.stack([x, x], axis=1), (3,), "float64", 0),
    ("sum_short", lambda m, x: m.sum(x, axis=0), (2, 3), "int8", 0),
    ("prod_short", lambda m, x: m.prod(x), (3,), "float64", 0),
    ("mean_short", lambda m, x: m.mean(x, axis=0), (3, 2), "float64", 0),
    ("var_short", lambda m, x: m.var(x, axis=0), (3, 2), "float64", 0),
    ("matmul_short", lambda m, x: m.matmul(x, np.ones((3, 2))), (2, 3), "float64", 1),
    ("take_short", lambda m, x: m.take(x, np.asarray([2, 0]), axis=0), (3, 2), "float64", 0),
    ("where_short", lambda m, x: m.where(x > 0, x, 0.0), (3, 2), "float64", 0),
    ("squeeze_split", lambda m, x: m.squeeze(x, axis=1), (3, 1), "float64", 0),
    ("expand_split", lambda m, x: m.expand_dims(x, axis=0), (3,), "float64", 0),
    ("transpose_short", lambda m, x: m.permute_dims(x, (1, 0)), (3, 2), "float64", 0),
    ("tile_short", lambda m, x: m.tile(x, (2, 1)), (1, 2), "float64", 0),
    ("repeat_short", lambda m, x: m.repeat(x, 2, axis=0), (3,), "float64", 0),
    ("getitem_step", lambda m, x: x[::-2], (3,), "float64", 0),
    ("getitem_int", lambda m, x: x[-1], (3, 2), "float64", 0),
    ("empty_sum", lambda m, x: m.sum(x, axis=0), (0, 2), "float64", 0),
    ("empty_elementwise", lambda m, x: m.exp(x) + 1, (0, 2), "float64", 0),
    ("empty_sort", lambda m, x: m.sort(x, axis=0), (0, 2), "float64", 0),
]


def _input(shape, dtype):
    rng = np.random.default_rng(0)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(autouse=True)
def x64():
    """NumPy's default dtypes, as the suite's adapter runs (JAX's x64 switch)."""
    sr.config.update("enable_x64", True)
    yield
    sr.config.update("enable_x64", False)


def eager_on_every_rank(n, fn, x, dim):
    """``fn(snp, DArray)`` with ``x`` split on ``dim`` over ``n`` simulated ranks: each rank's global result."""
    mesh = sr.Mesh((n,), ("x",))
    spec = sr.P(*([None] * dim), "x") if x.ndim else sr.P()

    def body(comm):
        with mesh:
            return np.asarray(fn(snp, sr.device_put(x, spec, mesh, comm=comm)))
    return run_simulated(n, body)


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name,fn,shape,dtype,dim", CASES, ids=[c[0] for c in CASES])
def test_eager_split_on_short_or_empty_dims_matches_numpy(name, fn, shape, dtype, dim, n):
    x = _input(shape, dtype)
    want = np.asarray(fn(np, x))
    for rank, got in enumerate(eager_on_every_rank(n, fn, x, dim)):
        assert got.shape == want.shape and got.dtype == want.dtype, f"rank {rank}: {got.dtype}{got.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, err_msg=f"rank {rank}")  # summation order


@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_min_of_nothing_is_refused_on_every_rank_as_numpy_refuses_it(kind):
    x = np.zeros((0, 3))
    with pytest.raises(ValueError):
        getattr(np, kind)(x, axis=0)
    errors = run_simulated(2, lambda comm: _error(lambda: getattr(snp, kind)(
        sr.device_put(x, sr.P("x"), sr.Mesh((2,), ("x",)), comm=comm), axis=0)))
    assert all(e is not None and "zero-size" in e and "[0, 3]" in e for e in errors), errors


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None
