"""spmd_runtime.lax: jax.lax's names and signatures over the project's ops, one test per alias family,
against NumPy (and, for the collectives, inside shard_map on simulated meshes)."""
import math

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.lax as lax
from spmd_runtime import P

from simulated import run_everywhere

RNG = np.random.default_rng(0)


def _eval(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


def test_elementwise_family():
    x, y = RNG.uniform(0.5, 2.0, (3, 4)), RNG.uniform(0.5, 2.0, (3, 4))
    outs = _eval(lambda a, b: (lax.add(a, b), lax.sub(a, b), lax.mul(a, b), lax.div(a, b), lax.pow(a, b),
                               lax.integer_pow(a, 3), lax.neg(a), lax.max(a, b), lax.min(a, b), lax.exp(a),
                               lax.log(a), lax.tanh(a), lax.sqrt(a), lax.rsqrt(a), lax.square(a), lax.abs(-a),
                               lax.logistic(a), lax.erf(a), lax.erfc(a), lax.erf_inv(a / 3.0),
                               lax.clamp(0.8, a, 1.5), lax.convert_element_type(a, "float32")), x, y)
    erf = np.vectorize(math.erf)
    want = [x + y, x - y, x * y, x / y, x ** y, x ** 3, -x, np.maximum(x, y), np.minimum(x, y), np.exp(x),
            np.log(x), np.tanh(x), np.sqrt(x), 1 / np.sqrt(x), x * x, x, 1 / (1 + np.exp(-x)), erf(x), 1 - erf(x),
            None, np.clip(x, 0.8, 1.5), x.astype(np.float32)]
    for k, (got, w) in enumerate(zip(outs, want)):
        if w is not None:
            np.testing.assert_allclose(got, w, rtol=1e-6 if w.dtype == np.float32 else 1e-13, err_msg=str(k))
    np.testing.assert_allclose(erf(outs[19]), x / 3.0, rtol=1e-13)
    assert outs[-1].dtype == np.float32


def test_comparisons_and_select():
    x, y = RNG.standard_normal(6), RNG.standard_normal(6)
    eq, ne, lt, le, gt, ge, sel = _eval(lambda a, b: (lax.eq(a, a), lax.ne(a, b), lax.lt(a, b), lax.le(a, b),
                                                      lax.gt(a, b), lax.ge(a, b), lax.select(a < b, a, b)), x, y)
    assert eq.all() and ne.all()
    for got, want in ((lt, x < y), (le, x <= y), (gt, x > y), (ge, x >= y), (sel, np.minimum(x, y))):
        np.testing.assert_array_equal(got, want)


def test_shape_family():
    x = RNG.standard_normal((2, 3, 4))
    outs = _eval(lambda a: (lax.broadcast(a, (5,)), lax.broadcast_in_dim(a[:, :1, 0], (2, 3, 3), (0, 1)),
                            lax.reshape(a, (6, 4)), lax.reshape(a, (4, 6), dimensions=(2, 0, 1)),
                            lax.transpose(a, (2, 0, 1)), lax.squeeze(a[:, :1], (1,)), lax.expand_dims(a, (0, 2)),
                            lax.rev(a, (0, 2)), lax.iota("int32", 5), lax.broadcasted_iota("int32", (2, 3), 1)), x)
    want = [np.broadcast_to(x, (5, 2, 3, 4)), np.broadcast_to(x[:, :1, 0][:, :, None], (2, 3, 3)), x.reshape(6, 4),
            x.transpose(2, 0, 1).reshape(4, 6), x.transpose(2, 0, 1), x[:, 0], x[None, :, None], x[::-1, :, ::-1],
            np.arange(5), np.broadcast_to(np.arange(3), (2, 3))]
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(got, w)


def test_slicing_family():
    x, u = RNG.standard_normal((5, 6)), RNG.standard_normal((2, 6))
    outs = _eval(lambda a, b, i: (lax.slice(a, (1, 0), (5, 6), (2, 3)), lax.slice_in_dim(a, 1, 4, axis=1),
                                  lax.dynamic_slice(a, (i, 2), (2, 3)), lax.dynamic_slice_in_dim(a, i, 3, axis=0),
                                  lax.dynamic_update_slice(a, b, (i, 0)), lax.dynamic_update_slice_in_dim(a, b, i, 0),
                                  lax.pad(a, 0.0, [(1, -2, 1), (0, 0, 0)]), lax.concatenate([a, b], 0)),
                 x, u, np.int32(2))
    updated = x.copy()
    updated[2:4] = u
    padded = np.zeros((1 + 9 - 2, 6))
    padded[1::2] = x[:4]
    want = [x[1:5:2, 0:6:3], x[:, 1:4], x[2:4, 2:5], x[2:5], updated, updated, padded, np.concatenate([x, u])]
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(got, w)


def test_dot_and_dot_general():
    a, b = RNG.standard_normal((2, 3, 4)), RNG.standard_normal((2, 5, 4))
    m, n = RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2))
    batched, plain, dot, f32 = _eval(lambda p, q, r, s: (
        lax.dot_general(p, q, (((2,), (2,)), ((0,), (0,)))), lax.dot_general(r, s, (((1,), (0,)), ((), ()))),
        lax.dot(r, s), lax.dot(r, s, preferred_element_type="float32")), a, b, m, n)
    np.testing.assert_allclose(batched, np.einsum("bik,bjk->bij", a, b), rtol=1e-13)
    np.testing.assert_allclose(plain, m @ n, rtol=1e-13)
    np.testing.assert_allclose(dot, m @ n, rtol=1e-13)
    assert f32.dtype == np.float32
    with pytest.raises(ValueError, match="as many contracting and batch dims on each side"):
        sr.trace(lambda p, q: lax.dot_general(p, q, (((2,), ()), ((0,), (0,)))), a, b)


def _np_conv_nchw(x, w, stride):
    n, c, hh, ww = x.shape
    o, _, kh, kw = w.shape
    oh, ow = (hh - kh) // stride + 1, (ww - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w)
    return out


def test_conv_general_dilated_layouts():
    x, w = RNG.standard_normal((2, 3, 7, 6)), RNG.standard_normal((4, 3, 3, 2))
    nhwc, hwio = x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0)
    default, layouts = _eval(lambda a, b, c, d: (
        lax.conv_general_dilated(a, b, (2, 2), "VALID"),
        lax.conv_general_dilated(c, d, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))),
        x, w, nhwc, hwio)
    want = _np_conv_nchw(x, w, 2)
    np.testing.assert_allclose(default, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layouts, want.transpose(0, 2, 3, 1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="layout strings"):
        sr.trace(lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "VALID", dimension_numbers=("NHW", "OIHW",
                                                                                                   "NCHW")), x, w)


def test_reductions_windows_and_indexing():
    x = RNG.standard_normal((4, 6))
    pooled, summed, s, mx, mn, am, cs, rcs, vals, idx = _eval(lambda a: (
        lax.reduce_window(a, -np.inf, lax.max, (2, 2), (2, 2), "VALID"),
        lax.reduce_window(a, 0.0, lax.add, (1, 3), (1, 1), "VALID"),
        lax.reduce_sum(a, (1,)), lax.reduce_max(a, (0,)), lax.reduce_min(a, (0, 1)), lax.argmax(a, 1, "int32"),
        lax.cumsum(a, 1), lax.cumsum(a, 1, reverse=True), lax.top_k(a, 2)), x)
    np.testing.assert_array_equal(pooled, x.reshape(2, 2, 3, 2).max(axis=(1, 3)))
    np.testing.assert_allclose(summed, x[:, :4] + x[:, 1:5] + x[:, 2:], rtol=1e-13)
    np.testing.assert_allclose(s, x.sum(1), rtol=1e-13)
    np.testing.assert_array_equal(mx, x.max(0))
    assert mn == x.min()
    assert am.dtype == np.int32 and (am == x.argmax(1)).all()
    np.testing.assert_allclose(cs, np.cumsum(x, 1), rtol=1e-13)
    np.testing.assert_allclose(rcs, np.cumsum(x[:, ::-1], 1)[:, ::-1], rtol=1e-13)
    np.testing.assert_array_equal(idx, np.argsort(-x, 1)[:, :2])
    with pytest.raises(ValueError, match="lax.add, lax.max or lax.min with its identity"):
        sr.trace(lambda a: lax.reduce_window(a, 1.0, lax.add, (2, 2), (1, 1), "VALID"), x)


def test_control_flow_family():
    x = RNG.standard_normal(5)
    carry, ys, looped, counted, chosen = _eval(lambda a: (
        lax.scan(lambda c, v: (c + v, c * v), 0.0 * a[0], a, unroll=2),
        lax.fori_loop(0, 4, lambda i, v: v * 2.0, a),
        lax.while_loop(lambda v: v[0] < 10.0, lambda v: v + 1.0, a - a + 1.0),
        lax.cond(a[0] > 0, lambda v: v * 3.0, lambda v: -v, a)), x)
    prefix = np.concatenate([[0.0], np.cumsum(x)[:-1]])
    np.testing.assert_allclose(carry, x.sum(), rtol=1e-13)
    np.testing.assert_allclose(ys, prefix * x, rtol=1e-13)
    np.testing.assert_allclose(looped, x * 16.0, rtol=1e-13)
    np.testing.assert_array_equal(counted, np.full(5, 10.0))
    np.testing.assert_allclose(chosen, x * 3.0 if x[0] > 0 else -x, rtol=1e-13)


def test_stop_gradient():
    x = RNG.standard_normal(3)
    (g,) = _eval(sr.grad(lambda a: sr.numpy.sum(a * lax.stop_gradient(a))), x)
    np.testing.assert_allclose(g, x, rtol=1e-13)


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_inside_shard_map(n):
    mesh = sr.Mesh((n,), ("x",))
    x = RNG.standard_normal((4 * n, 3))

    def local(a):
        i = lax.axis_index("x")
        shifted = lax.ppermute(a, "x", [(k, (k + 1) % n) for k in range(n)])
        gathered = lax.all_gather(a, "x", axis=0, tiled=True)
        return (lax.psum(a, "x") + lax.pmax(a, "x") - lax.pmin(a, "x") + shifted + gathered[:4] * 0.0
                + lax.convert_element_type(i, "float64"))

    fn = sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P("x"))
    graph = sr.trace(fn, x)
    blocks = x.reshape(n, 4, 3)
    want = np.concatenate([blocks.sum(0) + blocks.max(0) - blocks.min(0) + blocks[(k - 1) % n] + k
                           for k in range(n)])
    program = sr.partition(graph, mesh)
    for (got,) in run_everywhere(program, x):
        np.testing.assert_allclose(got, want, rtol=1e-13)
