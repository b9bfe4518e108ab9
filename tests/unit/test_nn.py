"""spmd_runtime.nn against NumPy references written here (PyTorch's formulas where the docstring names them:
exact GELU, cross_entropy's reductions and ignore_index, layer_norm's optional bias), gradients by central
finite differences, and partitioned attention / cross-entropy on simulated meshes."""
import math

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.nn as snn
import spmd_runtime.numpy as snp

from simulated import assert_all_ranks

np_erfc = np.vectorize(math.erfc)  # 1 + erf(x) would cancel in the negative tail
X = np.concatenate([np.linspace(-8, 8, 41), [-50.0, -1e-10, 1e-10, 0.0, 50.0, 700.0, -700.0]])


def _eval(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


def np_sigmoid(x):
    return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


ACTIVATIONS = {
    "relu": (snn.relu, lambda x: np.maximum(x, 0)),
    "relu6": (snn.relu6, lambda x: np.clip(x, 0, 6)),
    "sigmoid": (snn.sigmoid, np_sigmoid),
    "silu": (snn.silu, lambda x: x * np_sigmoid(x)),
    "swish": (snn.swish, lambda x: x * np_sigmoid(x)),
    "gelu_tanh": (snn.gelu, lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))),
    "gelu_exact": (lambda x: snn.gelu(x, approximate=False), lambda x: 0.5 * x * np_erfc(-x / np.sqrt(2))),
    "softplus": (snn.softplus, lambda x: np.logaddexp(x, 0.0)),
    "log_sigmoid": (snn.log_sigmoid, lambda x: -np.logaddexp(0.0, -x)),
    "elu": (snn.elu, lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0)))),
    "elu_alpha": (lambda x: snn.elu(x, alpha=0.5), lambda x: np.where(x > 0, x, 0.5 * np.expm1(np.minimum(x, 0)))),
    "leaky_relu": (snn.leaky_relu, lambda x: np.where(x >= 0, x, 0.01 * x)),
    "tanh": (snn.tanh, np.tanh),
    "hard_tanh": (snn.hard_tanh, lambda x: np.clip(x, -1, 1)),
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_matches_numpy_to_float64_rounding(name):
    fn, ref = ACTIVATIONS[name]
    with np.errstate(over="ignore"):
        want = ref(X)
    (got,) = _eval(fn, X)
    np.testing.assert_allclose(got, want, rtol=4e-15, atol=1e-300)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_in_float32(name):
    fn, ref = ACTIVATIONS[name]
    x = X.astype(np.float32)
    with np.errstate(over="ignore"):
        want = ref(x.astype(np.float64)).astype(np.float32)
    (got,) = _eval(fn, x)
    assert got.dtype == np.float32
    cancels = 1e-6 if name == "gelu_tanh" else 1e-37  # 1 + tanh(...) near -1: the formula's own float32 rounding
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=cancels)


def test_gelu_default_is_tanh_as_jax_and_exact_differs_as_documented():
    (tanh_form, exact) = _eval(lambda a: (snn.gelu(a), snn.gelu(a, approximate=False)), X)
    gap = np.max(np.abs(tanh_form - exact))
    assert 1e-4 < gap < 5e-4  # the docstring's ~1.5e-4 (PyTorch's nn.GELU() is the exact one)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "gelu_tanh", "gelu_exact", "softplus", "log_sigmoid", "elu",
                                  "tanh"])
def test_activation_gradient_by_finite_differences(name):
    fn = ACTIVATIONS[name][0]
    x = np.linspace(-3.1, 3.3, 13)
    _check_grad(lambda a: snp.sum(fn(a) * np.arange(1.0, 14.0)), x)


def _check_grad(loss, *args, argnum=0, eps=1e-6, tol=1e-6):
    (g,) = _eval(sr.grad(loss, argnums=argnum) if argnum else sr.grad(loss), *args)
    base = [np.array(a, dtype=np.float64) for a in args]
    f = lambda vals: float(_eval(loss, *vals)[0])
    x = base[argnum]
    fd = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = [b.copy() for b in base], [b.copy() for b in base]
        hi[argnum][i] += eps
        lo[argnum][i] -= eps
        fd[i] = (f(hi) - f(lo)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=tol, atol=tol)


# ---------------------------------------------------------------- softmax family
def np_log_softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def test_softmax_and_log_softmax_with_and_without_where():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 7)) * 5
    where = rng.random((4, 7)) < 0.6
    where[:, 0] = True
    sm, lsm, smw, lsmw, sm0 = _eval(lambda a, w: (snn.softmax(a), snn.log_softmax(a), snn.softmax(a, where=w),
                                                  snn.log_softmax(a, where=w), snn.softmax(a, axis=0)), x, where)
    np.testing.assert_allclose(lsm, np_log_softmax(x), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(sm, np.exp(np_log_softmax(x)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(sm0, np.exp(np_log_softmax(x, 0)), rtol=1e-13, atol=1e-15)
    masked = np.where(where, x, -np.inf)
    np.testing.assert_allclose(smw, np.exp(np_log_softmax(masked)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lsmw[where], np_log_softmax(masked)[where], rtol=1e-13, atol=1e-13)
    assert (lsmw[~where] == -np.inf).all() and (smw[~where] == 0).all()


def test_one_hot():
    ids = np.array([[0, 3, 1], [4, -1, 2]])
    a, b = _eval(lambda i: (snn.one_hot(i, 4), snn.one_hot(i, 4, dtype="int32", axis=0)), ids)
    want = (ids[..., None] == np.arange(4)).astype(np.float32)
    np.testing.assert_array_equal(a, want)
    assert a.dtype == np.float32 and b.dtype == np.int32
    np.testing.assert_array_equal(b, np.moveaxis(want, -1, 0))
    assert a[1, 0].sum() == 0 and a[1, 1].sum() == 0  # 4 and -1 are outside [0, 4)


def test_standardize_layer_norm_rms_norm():
    rng = np.random.default_rng(1)
    x, g, b = rng.standard_normal((3, 8)), rng.standard_normal(8), rng.standard_normal(8)
    st, ln, ln_nobias, ln_bare, rms, rms_bare = _eval(
        lambda a, gg, bb: (snn.standardize(a), snn.layer_norm(a, gg, bb), snn.layer_norm(a, gg),
                           snn.layer_norm(a), snn.rms_norm(a, gg, eps=1e-5), snn.rms_norm(a)), x, g, b)
    z = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(st, z, rtol=1e-13)
    np.testing.assert_allclose(ln, z * g + b, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ln_nobias, z * g, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ln_bare, z, rtol=1e-13)
    np.testing.assert_allclose(rms, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g, rtol=1e-13)
    np.testing.assert_allclose(rms_bare, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6), rtol=1e-13)
    _check_grad(lambda a, gg: snp.sum(snn.rms_norm(a, gg) * np.arange(24.0).reshape(3, 8)), x, g)
    _check_grad(lambda a, gg, bb: snp.sum(snn.layer_norm(a, gg, bb) ** 2.0), x, g, b, argnum=1)


# ---------------------------------------------------------------- attention
def np_attention(q, k, v, bias=None, mask=None, causal=False, scale=None):
    """Head by head: query head n uses kv head n // (N / K) (jax.nn's grouping)."""
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(h) if scale is None else scale
    out = np.zeros_like(q)
    for i in range(b):
        for head in range(n):
            j = head // (n // kv)
            logits = q[i, :, head] @ k[i, :, j].T * scale
            if bias is not None:
                logits = logits + np.broadcast_to(bias, (b, n, t, s))[i, head]
            keep = np.ones((t, s), bool)
            if mask is not None:
                keep &= np.broadcast_to(mask, (b, n, t, s))[i, head]
            if causal:
                keep &= np.tril(np.ones((t, s), bool))
            logits = np.where(keep, logits, -0.7 * np.finfo(q.dtype).max)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[i, :, head] = (p / p.sum(-1, keepdims=True)) @ v[i, :, j]
    return out


ATTENTION = [("mha", 4, 4, {}), ("gqa", 6, 2, {}), ("mqa", 4, 1, {}), ("causal_gqa", 4, 2, {"is_causal": True}),
             ("bias_mask", 4, 2, {"bias": True, "mask": True}), ("scale", 2, 2, {"scale": 0.3})]


@pytest.mark.parametrize("name,n,kv,opts", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_dot_product_attention_matches_numpy(name, n, kv, opts):
    rng = np.random.default_rng(2)
    b, t, s, h = 2, 5, 5, 3
    q, k, v = rng.standard_normal((b, t, n, h)), rng.standard_normal((b, s, kv, h)), rng.standard_normal((b, s, kv, h))
    bias = rng.standard_normal((1, n, t, s)) if opts.get("bias") else None
    mask = rng.random((b, 1, t, s)) < 0.7 if opts.get("mask") else None
    args = [q, k, v] + [a for a in (bias, mask) if a is not None]

    def fn(q, k, v, *extra):
        extra = list(extra)
        kw = {"bias": extra.pop(0) if bias is not None else None, "mask": extra.pop(0) if mask is not None else None}
        return snn.dot_product_attention(q, k, v, **kw, scale=opts.get("scale"), is_causal=opts.get("is_causal", False))
    (got,) = _eval(fn, *args)
    want = np_attention(q, k, v, bias, mask, opts.get("is_causal", False), opts.get("scale"))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_attention_unbatched_float32_and_gradient():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 4, 2)), rng.standard_normal((4, 2, 2)), rng.standard_normal((4, 2, 2))
    (got,) = _eval(lambda a, b, c: snn.dot_product_attention(a, b, c, is_causal=True), q, k, v)
    np.testing.assert_allclose(got, np_attention(q[None], k[None], v[None], causal=True)[0], rtol=1e-12, atol=1e-12)
    (f32,) = _eval(lambda a, b, c: snn.dot_product_attention(a, b, c), *(t.astype(np.float32) for t in (q, k, v)))
    assert f32.dtype == np.float32
    w = rng.standard_normal((4, 4, 2))
    for argnum in (0, 1, 2):
        _check_grad(lambda a, b, c: snp.sum(snn.dot_product_attention(a, b, c, is_causal=True) * w), q, k, v,
                    argnum=argnum)


def test_attention_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="multiple of the kv heads K.*got N=3, K=2"):
        sr.trace(lambda a, b: snn.dot_product_attention(a, b, b), sr.TensorSpec((1, 2, 3, 4)),
                 sr.TensorSpec((1, 2, 2, 4)))


def test_attention_partitioned_over_batch_and_heads():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((4, 6, 4, 8)), rng.standard_normal((4, 6, 2, 8)), rng.standard_normal((4, 6, 2, 8))
    graph = sr.trace(lambda a, b, c: snn.dot_product_attention(a, b, c, is_causal=True), q, k, v)
    mesh = sr.Mesh((2, 2), ("x", "y"))
    program = sr.partition(graph, mesh, in_specs=[("x", None, "y", None), ("x", None, "y", None),
                                                  ("x", None, "y", None)])
    assert_all_ranks(program, [q, k, v], sr.evaluate(graph, q, k, v), tol=1e-12)


# ---------------------------------------------------------------- losses and layers
def np_cross_entropy(logits, labels, reduction="mean", ignore_index=None):
    """PyTorch's F.cross_entropy (classes moved last): mean over the non-ignored entries."""
    lsm = np_log_softmax(logits)
    picked = np.take_along_axis(lsm, np.clip(labels, 0, logits.shape[-1] - 1)[..., None], -1)[..., 0]
    keep = np.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    loss = np.where(keep, -picked, 0.0)
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / keep.sum()}[reduction]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [None, -100])
def test_cross_entropy_matches_pytorch_semantics(reduction, ignore):
    rng = np.random.default_rng(5)
    logits, labels = rng.standard_normal((3, 4, 7)) * 3, rng.integers(0, 7, (3, 4))
    if ignore is not None:
        labels[0, 1] = labels[2, 3] = ignore
    (got,) = _eval(lambda a, y: snn.cross_entropy(a, y, reduction, ignore_index=ignore), logits, labels)
    np.testing.assert_allclose(got, np_cross_entropy(logits, labels, reduction, ignore), rtol=1e-13, atol=1e-14)


def test_cross_entropy_gradient_and_partitioned_class_dim():
    rng = np.random.default_rng(6)
    logits, labels = rng.standard_normal((4, 6)), rng.integers(0, 6, 4)
    (g,) = _eval(sr.grad(lambda a: snn.cross_entropy(a, labels)), logits)
    p = np.exp(np_log_softmax(logits))
    np.testing.assert_allclose(g, (p - np.eye(6)[labels]) / 4, rtol=1e-12, atol=1e-14)
    graph = sr.trace(lambda a, y: snn.cross_entropy(a, y), logits, labels)
    program = sr.partition(graph, sr.Mesh((3,), ("x",)), in_specs=[(None, "x"), None])
    assert_all_ranks(program, [logits, labels], sr.evaluate(graph, logits, labels), tol=1e-12)


def test_cross_entropy_of_a_minus_inf_logit_in_another_class_is_finite():
    """The label's logit is picked by a select: a -inf logit elsewhere (a masked class) takes no part (a product
    with a float one-hot would give -inf * 0 = NaN), as in PyTorch."""
    logits = np.array([[1.0, -np.inf, 0.5], [-np.inf, 2.0, 0.0]])
    labels = np.array([0, 2])
    (got,) = _eval(lambda a, y: snn.cross_entropy(a, y, "none"), logits, labels)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_cross_entropy(logits, labels, "none"), rtol=1e-13)


def test_cross_entropy_refuses_float_labels():
    with pytest.raises(ValueError, match="integer labels"):
        sr.trace(lambda a, y: snn.cross_entropy(a, y), sr.TensorSpec((2, 3)), sr.TensorSpec((2,)))


def test_embedding():
    table, ids = np.arange(12.0).reshape(4, 3), np.array([[3, 0], [1, 1]])
    (got,) = _eval(snn.embedding, table, ids)
    np.testing.assert_array_equal(got, table[ids])
