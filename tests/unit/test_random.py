"""spmd_runtime.random (ops/random.py): Threefry-2x32 against the Random123 paper's known-answer vectors and a
per-entry Python reference (tests/op_cases_random.py), JAX's key values, the global random array the same on
1, 2, 3, 4, 8 ranks and under several shardings with no communication, the distributions' moments, and
dropout masks identical across meshes."""
import math

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.nn as snn
import spmd_runtime.numpy as snp
import spmd_runtime.random as srandom
from spmd_runtime.ops.random import threefry_words

from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from op_cases_random import CASES, KEY, bits_ref, dropout_ref, threefry_ref, uniform_ref
from simulated import collectives, run_everywhere

PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in simulated_meshes()]
RANDOM123 = [((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),  # threefry2x32_20 known answers (Random123 kat_vectors)
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]


def _eval(fn, *args):
    return sr.evaluate(sr.trace(fn, *args), *args)


# ---------------------------------------------------------------- the hash
@pytest.mark.parametrize("key,counter,expected", RANDOM123)
def test_threefry_known_answers(key, counter, expected):
    assert threefry_ref(key, counter) == expected  # the reference is right
    y0, y1 = threefry_words(np, np.array(key, np.uint32), np.array([counter[0]], np.uint32),
                            np.array([counter[1]], np.uint32))
    assert (int(y0[0]), int(y1[0])) == expected


def test_vectorized_threefry_equals_the_reference():
    rng = np.random.default_rng(0)
    key = rng.integers(0, 2 ** 32, 2, dtype=np.uint32)
    x0, x1 = rng.integers(0, 2 ** 32, (2, 500), dtype=np.uint32)
    y0, y1 = threefry_words(np, key, x0, x1)
    assert [(int(a), int(b)) for a, b in zip(y0, y1)] == [threefry_ref(key, c) for c in zip(x0, x1)]


def test_chunked_hash_equals_the_reference_across_chunk_boundaries(monkeypatch):
    import spmd_runtime.ops.random as family
    monkeypatch.setattr(family, "CHUNK", 7)
    (got,) = _eval(lambda k: srandom.bits(k, (5, 11)), KEY)
    np.testing.assert_array_equal(got, bits_ref(KEY, (5, 11)))


# ---------------------------------------------------------------- keys
def test_keys_are_jax_partitionable_values():
    np.testing.assert_array_equal(srandom.key(0), [0, 0])
    np.testing.assert_array_equal(srandom.PRNGKey(42), [0, 42])
    np.testing.assert_array_equal(srandom.key(2 ** 40 + 5), [256, 5])
    # jax.random.split(jax.random.key(0)) with jax_threefry_partitionable (JAX >= 0.5's default)
    np.testing.assert_array_equal(srandom.split(srandom.key(0)), [[1797259609, 2579123966], [928981903, 3453687069]])
    assert srandom.split(KEY, 5).shape == (5, 2) and srandom.split(KEY, 5).dtype == np.uint32
    np.testing.assert_array_equal(srandom.fold_in(KEY, 7), threefry_ref(KEY, (0, 7)))


def test_traced_keys_equal_numpy_keys():
    def fn(k, d):
        a, b = srandom.split(k)
        return srandom.split(k, 3), srandom.fold_in(b, d), srandom.fold_in(a, 9), srandom.key(d)
    split3, folded, folded9, seeded = _eval(fn, KEY, np.int32(11))
    np.testing.assert_array_equal(split3, srandom.split(KEY, 3))
    np.testing.assert_array_equal(folded, srandom.fold_in(srandom.split(KEY)[1], 11))
    np.testing.assert_array_equal(folded9, srandom.fold_in(srandom.split(KEY)[0], 9))
    np.testing.assert_array_equal(seeded, srandom.key(11))


@pytest.mark.parametrize("bad", [np.zeros(2, np.int32), np.zeros(3, np.uint32), np.zeros((2, 2), np.uint32)])
def test_a_bad_key_is_refused_naming_the_rule(bad):
    with pytest.raises(ValueError, match=r"a random key is a uint32 array of shape \(2,\).*; got shape"):
        sr.trace(lambda: srandom.uniform(bad, (3,)))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="uniform draws a floating dtype"):
        sr.trace(lambda: srandom.uniform(KEY, (3,), "int32"))
    with pytest.raises(ValueError, match="static shape"):
        sr.trace(lambda: srandom.normal(KEY, (3, -1)))
    with pytest.raises(ValueError, match="a seed is an integer"):
        srandom.key(1.5)


# ---------------------------------------------------------------- the global array
@pytest.mark.parametrize("shape,width", [((7, 5), 32), ((3, 4, 2), 8), ((6,), 16), ((4, 3), 64), ((), 32),
                                         ((0, 3), 32)])
def test_bits_are_the_hash_of_the_global_index(shape, width):
    (got,) = _eval(lambda k: srandom.bits(k, shape, f"uint{width}"), KEY)
    assert got.dtype == np.dtype(f"uint{width}") and got.shape == shape
    np.testing.assert_array_equal(got, bits_ref(KEY, shape, width))


SHAPE = (12, 10)
LAYOUTS = [(sr.Mesh((n,), ("x",)), spec) for n in (1, 2, 3, 4, 8) for spec in (("x", None), (None, "x"))] + [
    (sr.Mesh((2, 4), ("x", "y")), ("y", "x")), (sr.Mesh((2, 4), ("x", "y")), (("x", "y"), None)),
    (sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0)), ("x", "y"))]


@pytest.mark.parametrize("mesh,spec", LAYOUTS, ids=[f"{m}-{s}" for m, s in LAYOUTS])
def test_same_global_bits_on_every_mesh_and_sharding_without_communication(mesh, spec):
    graph = sr.trace(lambda k: (srandom.bits(k, SHAPE), srandom.uniform(k, SHAPE)), KEY)
    program = sr.partition(graph, mesh, out_specs=[spec, spec])
    assert collectives(program) == []
    local = [i for i in program.instrs if i.op == "random_bits"]  # each rank hashes its block only
    assert local and all(i.shape == i.sharding.local_shape(SHAPE, mesh) for i in local)
    assert all(math.prod(i.shape) < math.prod(SHAPE) for i in local) or mesh.size == 1
    want = [bits_ref(KEY, SHAPE), uniform_ref(KEY, SHAPE)]
    for outs in run_everywhere(program, KEY):
        for got, expected in zip(outs, want):
            np.testing.assert_array_equal(got, expected)


def test_each_rank_hashes_only_its_block():
    """Sharded consumers: the bits come out split like them, each rank's random_bits of its block's shape."""
    x = np.ones(SHAPE)
    graph = sr.trace(lambda a, k: a * srandom.uniform(k, a.shape, "float64"), x, KEY)
    program = sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[("x", None), None])
    assert collectives(program) == []
    (bits,) = [i for i in program.instrs if i.op == "random_bits"]
    assert bits.shape == (3, 10) and bits.attrs["split"] == (0,)
    for (got,) in run_everywhere(program, x, KEY):
        np.testing.assert_array_equal(got, uniform_ref(KEY, SHAPE, "float64"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


# ---------------------------------------------------------------- distributions
N = 200_000


def _moments_close(x, mean, var, sigmas=5.0):
    x = np.asarray(x, np.float64)
    assert abs(x.mean() - mean) < sigmas * math.sqrt(var / x.size)
    assert abs(x.var() - var) < sigmas * var * math.sqrt(2.0 / x.size) * 2


def test_uniform_in_unit_interval_with_uniform_moments():
    u, scaled, half = _eval(lambda k: (srandom.uniform(k, (N,)), srandom.uniform(k, (N,), minval=-2.0, maxval=3.0),
                                       srandom.uniform(k, (1000,), "float16")), KEY)
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    _moments_close(u, 0.5, 1 / 12)
    assert scaled.min() >= -2.0 and scaled.max() < 3.0
    _moments_close(scaled, 0.5, 25 / 12)
    assert half.dtype == np.float16 and half.min() >= 0 and half.max() < 1
    np.testing.assert_array_equal(u[:50], uniform_ref(KEY, (N,))[:50])


def test_normal_and_truncated_normal():
    z, t = _eval(lambda k: (srandom.normal(k, (N,)), srandom.truncated_normal(k, -1.0, 2.0, (N,))), KEY)
    assert z.dtype == np.float32 and np.isfinite(z).all()
    _moments_close(z, 0.0, 1.0)
    assert abs(np.mean(np.abs(z) < 1.0) - math.erf(1 / math.sqrt(2))) < 5 * math.sqrt(0.25 / N)
    pdf = lambda v: math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
    mass = 0.5 * (math.erf(2 / math.sqrt(2)) - math.erf(-1 / math.sqrt(2)))
    assert t.min() > -1.0 and t.max() < 2.0
    assert abs(t.mean() - (pdf(-1.0) - pdf(2.0)) / mass) < 0.01


def test_bernoulli_gumbel_categorical():
    p = np.array([0.1, 0.2, 0.7], np.float32)
    b, g, c = _eval(lambda k: (srandom.bernoulli(k, 0.3, (N,)), srandom.gumbel(k, (N,)),
                               srandom.categorical(k, np.log(p), shape=(N,))), KEY)
    assert b.dtype == np.bool_ and abs(b.mean() - 0.3) < 5 * math.sqrt(0.21 / N)
    _moments_close(g, 0.5772156649, math.pi ** 2 / 6, sigmas=6)
    assert c.dtype == np.int32
    np.testing.assert_allclose(np.bincount(c, minlength=3) / N, p, atol=5 * math.sqrt(0.25 / N))


def test_categorical_batch_and_axis():
    logits = np.log(np.array([[0.5, 0.5, 1e-9], [1e-9, 1e-9, 1.0]], np.float32)).T  # classes on axis 0
    (c,) = _eval(lambda k, lg: srandom.categorical(k, lg, axis=0, shape=(4000, 2)), KEY, logits)
    assert c.shape == (4000, 2) and set(np.unique(c[:, 0])) == {0, 1} and (c[:, 1] == 2).all()


def _randint_ref(key, shape, lo, hi, nbits=32):
    """JAX's randint formula on the reference bits of split(key)'s two keys (spans below 2^nbits)."""
    k1, k2 = srandom.split(key)
    higher, lower = bits_ref(k1, shape).astype(object), bits_ref(k2, shape).astype(object)
    span = hi - lo
    mult = (2 ** (nbits // 2) % span) ** 2 % 2 ** nbits % span
    return np.array([lo + ((h % span) * mult % 2 ** nbits + l % span) % 2 ** nbits % span
                     for h, l in zip(higher.ravel(), lower.ravel())]).reshape(shape)


def test_randint():
    a, b, full, empty = _eval(lambda k: (srandom.randint(k, (N,), 3, 10), srandom.randint(k, (40,), -7, 100003),
                                         srandom.randint(k, (N,), 0, 256, "uint8"), srandom.randint(k, (5,), 4, 4)),
                              KEY)
    assert a.dtype == np.int32 and a.min() == 3 and a.max() == 9
    np.testing.assert_allclose(np.bincount(a - 3) / N, np.full(7, 1 / 7), atol=5 * math.sqrt(1 / 7 / N))
    np.testing.assert_array_equal(b, _randint_ref(KEY, (40,), -7, 100003))
    assert full.dtype == np.uint8 and full.min() == 0 and full.max() == 255
    np.testing.assert_array_equal(empty, np.full(5, 4))


@pytest.mark.parametrize("n", [1, 10, 2000])
def test_permutation_is_a_permutation(n):
    x = np.arange(3.0 * n).reshape(3, n)
    perm, permuted = _eval(lambda k, a: (srandom.permutation(k, n), srandom.permutation(k, a, axis=1)), KEY, x)
    np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    np.testing.assert_array_equal(permuted, x[:, perm])
    if n >= 10:
        assert (perm != np.arange(n)).any()


# ---------------------------------------------------------------- dropout
DROPOUT_LAYOUTS = [(sr.Mesh((n,), ("x",)), spec) for n in (1, 2, 4) for spec in (("x", None), (None, "x"))] + [
    (sr.Mesh((2, 2), ("x", "y")), ("x", "y"))]


@pytest.mark.parametrize("mesh,spec", DROPOUT_LAYOUTS, ids=[f"{m}-{s}" for m, s in DROPOUT_LAYOUTS])
def test_dropout_masks_identical_across_meshes_and_shardings(mesh, spec):
    x = np.random.default_rng(3).standard_normal((16, 12)).astype(np.float32)
    key = srandom.fold_in(srandom.key(2024), 3)
    graph = sr.trace(lambda a, k: snn.dropout(k, a, 0.4), x, key)
    program = sr.partition(graph, mesh, in_specs=[spec, None], out_specs=[spec])
    assert collectives(program) == []
    want = dropout_ref(key, x, 0.4)
    for (got,) in run_everywhere(program, x, key):
        np.testing.assert_array_equal(got, want.astype(np.float32))
    kept = want != 0
    assert 0.45 < kept.mean() < 0.75 and np.allclose(want[kept], x[kept] / 0.6)


def test_dropout_deterministic_and_edge_rates():
    x = np.ones((4, 4), np.float32)
    same, zero, full = _eval(lambda a, k: (snn.dropout(k, a, 0.5, deterministic=True), snn.dropout(k, a, 1.0),
                                           snn.dropout(k, a, 0.0)), x, KEY)
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(zero, 0 * x)
    np.testing.assert_array_equal(full, x)
    with pytest.raises(ValueError, match=r"dropout's rate is a probability in \[0, 1\]; got 1.5"):
        sr.trace(lambda a: snn.dropout(KEY, a, 1.5), x)


def test_dropout_gradient_is_the_mask_scaled():
    x = np.random.default_rng(4).standard_normal((6, 5))
    (g,) = _eval(sr.grad(lambda a: snp.sum(snn.dropout(KEY, a, 0.3))), x)
    want = dropout_ref(KEY, np.ones_like(x), 0.3)
    np.testing.assert_allclose(g, want, rtol=1e-15)


def test_dropout_per_step_inside_a_scan_partitioned():
    """A key folded with the traced step number inside a scan body (dropout per layer): the same masks as the
    reference on every mesh, no communication."""
    x, key = np.ones((8, 6), np.float32), srandom.key(3)

    def fn(a, k):
        def body(c, i):
            return snn.dropout(srandom.fold_in(k, i), c, 0.5) * 0.5, None
        return sr.scan(body, a, snp.arange(3, dtype="int32"))[0]
    want = x
    for i in range(3):
        want = (dropout_ref(srandom.fold_in(key, i), want, 0.5) * 0.5).astype(np.float32)
    graph = sr.trace(fn, x, key)
    np.testing.assert_array_equal(sr.evaluate(graph, x, key)[0], want)
    for mesh, spec in ((sr.Mesh((4,), ("x",)), ("x", None)), (sr.Mesh((2,), ("x",)), (None, "x"))):
        program = sr.partition(graph, mesh, in_specs=[spec, None])
        assert collectives(program) == []
        for (got,) in run_everywhere(program, x, key):
            np.testing.assert_array_equal(got, want)


def test_jit_takes_a_key_and_a_step():
    x, key = np.ones((8, 6), np.float32), srandom.key(3)
    step = sr.jit(lambda a, k, i: snn.dropout(srandom.fold_in(k, i), a, 0.5), mesh=sr.Mesh((1,), ("x",)))
    np.testing.assert_array_equal(np.asarray(step(x, key, np.int32(4))),
                                  dropout_ref(srandom.fold_in(key, 4), x, 0.5).astype(np.float32))


def test_a_saved_program_draws_the_same_numbers(tmp_path):
    x, key = np.ones((8, 6), np.float32), srandom.key(3)
    graph = sr.trace(lambda a, k: (snn.dropout(k, a, 0.3), srandom.randint(k, (8, 6), 0, 5),
                                   srandom.normal(srandom.split(k)[1], (8, 6)), snp.erf(a)), x, key)
    program = sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[("x", None), None])
    program.save(tmp_path / "random.json")
    loaded = sr.load_program(tmp_path / "random.json")
    want = sr.evaluate(graph, x, key)
    for outs in run_everywhere(loaded, x, key):
        for got, expected in zip(outs, want):
            np.testing.assert_array_equal(got, expected)


def test_samplers_and_nn_run_eagerly_outside_a_trace():
    """Outside a trace, as snp's functions: one cached program per call, a replicated DArray on the context mesh."""
    x = np.linspace(-2.0, 2.0, 6)
    with sr.Mesh((1,), ("x",)):
        u, d = srandom.uniform(KEY, (6,)), snn.dropout(KEY, x, 0.3)
        perm = srandom.permutation(KEY, 5)
    assert isinstance(u, sr.DArray)
    np.testing.assert_array_equal(np.asarray(u), uniform_ref(KEY, (6,)))
    np.testing.assert_array_equal(np.asarray(d), dropout_ref(KEY, x, 0.3))
    np.testing.assert_array_equal(np.sort(np.asarray(perm)), np.arange(5))
