"""The elementwise math of ops/core.py: the case table against NumPy and on the simulated meshes (1..8 ranks,
1-d and 2-d, even and uneven), the gradients against central finite differences, NumPy's edge semantics
(integer division by 0, negative operands, shifts past the width), the Tensor operators and methods, and the
fixes of issue 28 (sum's declared dtype, the mean of an empty array, complex Python scalars)."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp

from op_cases_elementwise import CASES
from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from simulated import run_everywhere
from test_autodiff import check_grads, rand, weighted_sum

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]


def evaluate(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    with np.errstate(all="ignore"):
        check_reference(case)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


# ---------------------------------------------------------------- NumPy's semantics, written out
def test_integer_floor_division_and_remainders_follow_numpy_with_negative_operands_and_zero():
    a = np.array([7, -7, 7, -7, 5, -5, 0], np.int32)
    b = np.array([2, 2, -2, -2, 0, 0, 3], np.int32)
    with np.errstate(all="ignore"):
        fd, rem, fm = evaluate(lambda x, y: (x // y, x % y, snp.fmod(x, y)), a, b)
    np.testing.assert_array_equal(fd, [3, -4, -4, 3, 0, 0, 0])
    np.testing.assert_array_equal(rem, [1, 1, -1, -1, 0, 0, 0])
    np.testing.assert_array_equal(fm, [1, -1, 1, -1, 0, 0, 0])
    assert fd.dtype == rem.dtype == fm.dtype == np.int32


def test_float_remainder_takes_the_divisor_sign_and_division_by_zero_gives_inf_or_nan():
    a = np.array([7.5, -7.5, 1.0, -1.0, 0.0], np.float32)
    b = np.array([2.0, 2.0, 0.0, 0.0, 0.0], np.float32)
    with np.errstate(all="ignore"):
        fd, rem = evaluate(lambda x, y: (x // y, x % y), a, b)
    np.testing.assert_array_equal(fd, [3.0, -4.0, np.inf, -np.inf, np.nan])
    np.testing.assert_array_equal(rem[:2], [1.5, 0.5])
    assert np.isnan(rem[2:]).all() and fd.dtype == np.float32


def test_bitwise_operators_are_bitwise_on_integers_and_logical_on_bools():
    a, b = np.array([12, -3, 5], np.int32), np.array([10, 6, 0], np.int32)
    got = evaluate(lambda x, y: (x & y, x | y, x ^ y, ~x, x << 2, x >> 1, 1 << y), a, b)
    for g, w in zip(got, (a & b, a | b, a ^ b, ~a, a << 2, a >> 1, 1 << b)):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == np.int32
    np.testing.assert_array_equal(got[0], [8, 4, 0])  # 12 & 10 is 8, not the logical True
    p, q = np.array([True, True, False]), np.array([True, False, False])
    got = evaluate(lambda x, y: (x & y, x | y, x ^ y, ~x), p, q)
    np.testing.assert_array_equal(np.stack(got), [[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]])
    assert all(g.dtype == np.bool_ for g in got)


def test_shifts_by_the_bit_width_or_more_give_zero_or_minus_one():
    x = np.array([5, -5, 1], np.int32)
    left, right = evaluate(lambda a: (a << 33, a >> 40), x)
    np.testing.assert_array_equal(left, [0, 0, 0])
    np.testing.assert_array_equal(right, [0, -1, 0])


def test_bitwise_of_floats_is_refused_naming_the_rule():
    with pytest.raises(TypeError, match=r"bitwise_and \(&\) takes integers or bools.*got float32"):
        sr.trace(lambda x: x & 1, np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"left_shift \(<<\) takes integers.*got bool"):
        sr.trace(lambda x, y: snp.left_shift(x, y), np.ones(3, bool), np.ones(3, bool))
    with pytest.raises(TypeError, match=r"invert \(~\) takes integers or bools.*got float64"):
        sr.trace(lambda x: ~x, np.ones(3))


def test_float32_math_stays_float32():
    x = np.linspace(0.1, 0.9, 6).astype(np.float32)
    fns = [snp.sin, snp.arccos, snp.sinh, snp.arctanh, snp.log1p, snp.expm1, snp.log2, snp.exp2, snp.cbrt,
           snp.reciprocal, snp.rsqrt, snp.sigmoid, snp.floor, snp.round, snp.sign, snp.nan_to_num, snp.deg2rad,
           lambda v: snp.clip(v, 0.2, 0.5), lambda v: snp.hypot(v, 1.0), lambda v: snp.logaddexp(v, v),
           lambda v: v // 0.25, lambda v: v % 0.25, lambda v: snp.float_power(v, 2)]
    for fn in fns:
        (out,) = evaluate(fn, x)
        assert out.dtype == np.float32, fn


def test_integer_math_promotes_to_the_default_float_and_rounding_keeps_integers():
    i = np.arange(1, 5, dtype=np.int32)
    s, f, r, c = evaluate(lambda v: (snp.sin(v), snp.floor(v), snp.round(v), snp.clip(v, 2, 3)), i)
    assert s.dtype == np.float32 and f.dtype == r.dtype == c.dtype == np.int32
    np.testing.assert_allclose(s, np.sin(i.astype(np.float32)), rtol=1e-6)
    np.testing.assert_array_equal(c, [2, 2, 3, 3])


def test_sigmoid_does_not_overflow_and_is_accurate_in_both_tails():
    x = np.array([-1000.0, -40.0, -1.0, 0.0, 1.0, 40.0, 1000.0])
    with np.errstate(over="raise"):
        (y,) = evaluate(snp.sigmoid, x)
    np.testing.assert_allclose(y, [0.0, 4.248354255291589e-18, 0.2689414213699951, 0.5, 0.7310585786300049, 1.0,
                                   1.0], rtol=1e-14, atol=0.0)


def test_round_with_decimals_and_clip_with_none_bounds():
    x = np.array([1.25, 2.5, -0.125, 12345.678])
    r1, r0, rm, lo, hi = evaluate(lambda v: (snp.round(v, 1), snp.round(v), snp.round(v, -2), snp.clip(v, min=0.0),
                                             snp.clip(v, max=2.0)), x)
    np.testing.assert_array_equal(r1, np.round(x, 1))
    np.testing.assert_array_equal(r0, [1.0, 2.0, -0.0, 12346.0])  # half to even
    np.testing.assert_array_equal(rm, [0.0, 0.0, -0.0, 12300.0])
    np.testing.assert_array_equal(lo, np.clip(x, 0.0, None))
    np.testing.assert_array_equal(hi, np.clip(x, None, 2.0))


def test_nan_to_num_and_fmax_ignore_nans():
    x = np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)
    y = np.array([2.0, np.nan, 0.0, np.nan], np.float32)
    a, b, c = evaluate(lambda u, v: (snp.nan_to_num(u), snp.fmax(u, v), snp.fmin(u, v)), x, y)
    np.testing.assert_array_equal(a, np.nan_to_num(x))
    np.testing.assert_array_equal(b, np.fmax(x, y))
    np.testing.assert_array_equal(c, np.fmin(x, y))


# ---------------------------------------------------------------- gradients (central finite differences)
def unit(*shape, seed=0, low=-0.9, high=0.9):
    return np.random.default_rng(seed).uniform(low, high, shape)


GRAD_CASES = [
    ("sin_cos_tan", lambda a: snp.sin(a) * snp.cos(a) + snp.tan(a), [unit(3, 4)]),
    ("inverse_trig", lambda a: snp.arcsin(a) + snp.arccos(a * 0.5) + snp.arctan(a * 3.0), [unit(3, 4)]),
    ("hyperbolic", lambda a: snp.sinh(a) + snp.cosh(a) + snp.arcsinh(a) + snp.arctanh(a), [unit(3, 4)]),
    ("arccosh", lambda a: snp.arccosh(a), [unit(3, 4, low=1.2, high=3.0)]),
    ("log_exp", lambda a: snp.log1p(a) + snp.expm1(a) + snp.log2(a) + snp.log10(a) + snp.exp2(a),
     [unit(3, 4, low=0.2, high=2.0)]),
    ("cbrt_reciprocal_rsqrt", lambda a: snp.cbrt(a) + snp.reciprocal(a) + snp.rsqrt(a),
     [unit(3, 4, low=0.2, high=2.0)]),
    ("sigmoid", snp.sigmoid, [rand(3, 4)]),
    ("arctan2", snp.arctan2, [rand(3, 4), rand(3, 4, seed=3)]),
    ("hypot", snp.hypot, [rand(3, 4), rand(3, 4, seed=3)]),
    ("logaddexp", snp.logaddexp, [rand(3, 4), rand(3, 4, seed=3)]),
    ("copysign", snp.copysign, [rand(3, 4), rand(3, 4, seed=3)]),
    ("remainder", snp.remainder, [rand(3, 4), unit(3, 4, seed=3, low=0.3, high=0.9)]),
    ("fmod", snp.fmod, [rand(3, 4), unit(3, 4, seed=3, low=-0.9, high=-0.3)]),
    ("fmax_fmin", lambda a, b: snp.fmax(a, b) + snp.fmin(a, b * 2.0), [rand(3, 4), rand(3, 4, seed=3)]),
    ("clip", lambda a: snp.clip(a, -0.5, 0.5), [rand(3, 4)]),
    ("float_power_deg2rad", lambda a: snp.float_power(a, 3) + snp.deg2rad(a) + snp.rad2deg(a), [rand(3, 4)]),
    ("round_decimals", lambda a: snp.round(a, 2) * a, [rand(3, 4)]),  # the rounded factor has no gradient
    ("nan_to_num", lambda a: snp.nan_to_num(snp.log(a)), [unit(3, 4, low=0.2, high=2.0)]),
]


@pytest.mark.parametrize("name,fn,args", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradient_matches_finite_differences(name, fn, args):
    check_grads(weighted_sum(fn), args, rtol=1e-5, atol=1e-7)


def test_piecewise_constant_ops_have_zero_gradient():
    x = rand(3, 4)
    fns = [snp.floor, snp.ceil, snp.trunc, snp.rint, snp.sign, lambda v: v // 0.3,
           lambda v: snp.heaviside(v, 0.5), lambda v: snp.where(snp.isfinite(v), 0.0, 1.0)]
    for fn in fns:
        (g,) = evaluate(sr.grad(lambda v: snp.sum(fn(v) + 0.0 * v)), x)
        np.testing.assert_array_equal(g, np.zeros_like(x))


def test_gradient_of_new_ops_partitions_on_simulated_meshes():
    x = unit(12, 7, low=0.2, high=0.9)
    loss = lambda v: snp.sum(snp.sigmoid(snp.arcsin(v)) * snp.log1p(v) + snp.hypot(v, 1.0))
    graph = sr.trace(sr.grad(loss), x)
    want = sr.evaluate(graph, x)
    for mesh, spec in ((sr.Mesh((3,), ("x",)), ("x", None)), (sr.Mesh((2, 4), ("x", "y")), ("x", "y"))):
        program = sr.partition(graph, mesh, in_specs=[spec])
        for outs in run_everywhere(program, x):
            np.testing.assert_allclose(outs[0], want[0], rtol=1e-12)


# ---------------------------------------------------------------- Tensor operators and methods
def test_tensor_operators_and_their_reflections():
    x, y = np.array([7, -7, 9], np.int64), np.array([2, 3, -4], np.int64)
    got = evaluate(lambda a, b: (a // b, a % b, 20 // a, 20 % a, a ^ b, 6 ^ a, a << 1, 2 << b.clip(0, 5),
                                 a >> 1, 64 >> b.clip(0, 5), abs(a), +a, *divmod(a, b), *divmod(100, a),
                                 5 & a, 5 | a), x, y)
    want = (x // y, x % y, 20 // x, 20 % x, x ^ y, 6 ^ x, x << 1, 2 << y.clip(0, 5), x >> 1, 64 >> y.clip(0, 5),
            abs(x), +x, *divmod(x, y), *divmod(100, x), 5 & x, 5 | x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_comparisons_of_mixed_dtypes():
    i, f = np.array([1, 2, 3], np.int32), np.array([1.5, 2.0, 2.5], np.float32)
    got = evaluate(lambda a, b: (a < b, a == b, a >= 2.5, b != 2), i, f)
    for g, w in zip(got, (i < f, i == f, i >= 2.5, f != 2)):
        np.testing.assert_array_equal(g, w)


def test_tensor_methods():
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    got = evaluate(lambda a: (a.flatten(), a.ravel(), a.argmax(), a.argmin(axis=1), a.clip(-0.5, 0.5), a.round(1),
                              a.mT, a.reshape(6, 4), a.sum(axis=0), a.mean(), a.max(axis=(0, 2)), a.cumsum(1),
                              a.prod(axis=2), a.any(axis=0), (a > 0).all(axis=1), a.std(axis=2), a.cumprod(1)), x)
    want = (x.flatten(), x.ravel(), x.argmax(), x.argmin(axis=1), x.clip(-0.5, 0.5), x.round(1),
            np.swapaxes(x, -1, -2), x.reshape(6, 4), x.sum(axis=0), x.mean(), x.max(axis=(0, 2)), x.cumsum(1),
            x.prod(axis=2), x.any(axis=0), (x > 0).all(axis=1), x.std(axis=2), x.cumprod(1))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6)


# ---------------------------------------------------------------- issue 28's fixes
@pytest.mark.parametrize("dtype,want", [("uint8", "uint32"), ("int8", "int32"), ("bool", "int32"),
                                        ("uint16", "uint32"), ("int32", "int32"), ("int64", "int64")])
def test_sum_of_narrow_integers_declares_and_produces_the_default_integer(dtype, want):
    x = (np.arange(40) % 7).astype(dtype).reshape(8, 5)
    graph = sr.trace(lambda a: snp.sum(a), x)
    assert graph.nodes[graph.outputs[0]].dtype == want
    (got,) = sr.evaluate(graph, x)
    assert got.dtype == want and got == np.sum(x)
    program = sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[("x", None)])
    for (out,) in run_everywhere(program, x):
        assert out.dtype == want and out == np.sum(x)


def test_sum_with_dtype_sums_in_that_dtype_on_every_rank():
    x = np.full((8, 5), 100, np.uint8)
    graph = sr.trace(lambda a: snp.sum(a, axis=0, dtype="uint8"), x)
    (got,) = sr.evaluate(graph, x)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, np.sum(x, axis=0, dtype=np.uint8))  # wraps modulo 256, as NumPy's
    program = sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[("x", None)])
    for (out,) in run_everywhere(program, x):
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(out, np.sum(x, axis=0, dtype=np.uint8))


def test_mean_of_an_empty_array_is_nan():
    (m,) = evaluate(lambda a: snp.mean(a), np.zeros((0, 3), np.float32))
    assert np.isnan(m) and m.dtype == np.float32
    (m,) = evaluate(lambda a: snp.mean(a, axis=0), np.zeros((0, 3), np.float32))
    assert m.shape == (3,) and np.isnan(m).all()


def test_python_complex_scalars_are_weak_complex():
    x = np.array([1.0, -2.0], np.float32)
    a, b = evaluate(lambda v: (v * 1j, v + (2 + 0.5j)), x)
    assert a.dtype == b.dtype == np.complex64
    np.testing.assert_array_equal(a, x * 1j)
    np.testing.assert_array_equal(b, x + (2 + 0.5j))
