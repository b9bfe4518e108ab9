"""Gradients (VJP rules) of the windowed family: conv, reduce_window, cumsum.

Every rule is checked against central finite differences in float64 through the reference evaluator,
the case table (op_cases_windows_grad.py) against explicit loop adjoints and, partitioned on several
meshes, against the reference evaluator in the simulated world. Max/min pooling routes each window's
cotangent to its FIRST in-bounds tap equal to the result (XLA's SelectAndScatter): the tie, infinity
and padding tests pin that down exactly.
"""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff.rules.table import VJP
from spmd_runtime.ops.windows import CONV, CUMSUM, REDUCE_WINDOW

import simulated
from op_cases import make_inputs, partition_case, resolve
from simulated import run_everywhere
from op_cases_windows_grad import CASES, conv_net, cotangent_pattern, loop_reduce_window_adjoint

MESHES = [sr.Mesh((n,), ("x",)) for n in (2, 3, 4)] + [sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3))]
TABLE = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
         for m in MESHES]


def assert_all_ranks(program, args, expected, tol=1e-10):
    simulated.assert_all_ranks(program, args, expected, tol)


def assert_matches_finite_differences(fn, *args, eps=1e-6, tol=1e-6):
    """sr.grad of ``sum(fn(*args) * c)`` (all args) against central differences, both through sr.evaluate."""
    def loss(*xs):
        out = fn(*xs)
        return snp.sum(out * cotangent_pattern(out.shape))
    argnums = tuple(range(len(args)))
    got = sr.evaluate(sr.trace(sr.grad(loss, argnums), *args), *args)
    value = sr.trace(loss, *args)
    f = lambda xs: float(sr.evaluate(value, *xs)[0])
    for k, arg in enumerate(args):
        numeric = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[k][idx] += eps
            minus[k][idx] -= eps
            numeric[idx] = (f(plus) - f(minus)) / (2 * eps)
        assert got[k].shape == arg.shape and got[k].dtype == arg.dtype
        np.testing.assert_allclose(got[k], numeric, rtol=tol, atol=tol, err_msg=f"argument {k}")


def test_rules_are_registered_on_import():
    assert {CONV, REDUCE_WINDOW, CUMSUM} <= set(VJP.ops())


# ---------------------------------------------------------------- finite differences
CONV_CONFIGS = [  # (lhs shape, rhs shape, kwargs)
    ((2, 3, 9), (4, 3, 3), dict(window_strides=1, padding="SAME")),
    ((2, 3, 9), (4, 3, 3), dict(window_strides=1, padding="VALID")),
    ((2, 2, 10), (3, 2, 4), dict(window_strides=2, padding="SAME")),
    ((2, 2, 11), (3, 2, 3), dict(window_strides=2, padding="VALID")),  # the last input element is never read
    ((1, 2, 10), (3, 2, 3), dict(window_strides=3, padding=((2, -1),))),
    ((1, 2, 6), (2, 2, 2), dict(padding=((4, 3),))),  # windows made of padding only
    ((2, 2, 11), (2, 2, 3), dict(padding="SAME", rhs_dilation=2)),
    ((2, 2, 7), (3, 2, 3), dict(window_strides=2, padding=((1, 1),), lhs_dilation=2)),  # transposed conv
    ((2, 4, 9), (6, 2, 3), dict(padding="SAME", feature_group_count=2)),
    ((1, 2, 6, 5), (3, 2, 3, 3), dict(window_strides=1, padding="SAME")),
    ((1, 2, 7, 6), (3, 2, 3, 2), dict(window_strides=2, padding="VALID")),
    ((1, 2, 7, 6), (2, 2, 3, 3), dict(window_strides=(2, 1), padding=((1, 2), (0, 1)), rhs_dilation=(1, 2))),
    ((1, 4, 5, 6), (4, 2, 3, 3), dict(window_strides=2, padding="SAME", rhs_dilation=2, feature_group_count=2)),
    ((1, 2, 4, 5), (2, 2, 2, 3), dict(padding="SAME", lhs_dilation=(2, 1), rhs_dilation=(1, 2))),
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CONV_CONFIGS, ids=str)
def test_conv_gradients_match_finite_differences(lhs_shape, rhs_shape, kwargs):
    rng = np.random.default_rng(0)
    x, k = rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape)
    assert_matches_finite_differences(lambda a, b: snp.conv(a, b, **kwargs), x, k)


POOL_CONFIGS = [  # (shape, window, strides, padding)
    ((11,), (3,), 1, "SAME"),
    ((11,), (3,), 2, "VALID"),
    ((10,), (2,), 2, "SAME"),
    ((10,), (4,), 3, ((2, 1),)),
    ((2, 2, 6, 7), (1, 1, 3, 3), 1, "VALID"),
    ((2, 2, 6, 7), (1, 1, 3, 3), (1, 1, 2, 2), "SAME"),
    ((2, 2, 7, 6), (1, 1, 2, 2), (1, 1, 2, 2), "VALID"),
    ((2, 6, 7, 3), (1, 3, 2, 1), (1, 2, 1, 1), "SAME"),  # NHWC: the folded dims are not leading
    ((3, 4), (1, 1), 1, "VALID"),  # one-element windows: the identity
]


@pytest.mark.parametrize("kind", ["max", "min", "avg", "sum"])
@pytest.mark.parametrize("shape,window,strides,padding", POOL_CONFIGS, ids=str)
def test_reduce_window_gradients_match_finite_differences(kind, shape, window, strides, padding):
    x = np.random.default_rng(1).standard_normal(shape)  # distinct values: no ties within eps
    assert_matches_finite_differences(lambda a: snp.reduce_window(a, kind, window, strides, padding), x)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, None])
def test_cumsum_gradient_matches_finite_differences(axis):
    x = np.random.default_rng(2).standard_normal((3, 4, 5))
    assert_matches_finite_differences(lambda a: snp.cumsum(a, axis), x)


# ---------------------------------------------------------------- max/min routing: ties, infinities, padding
def pool_grad(x, kind, window, strides, padding, g):
    """The traced gradient of sum(reduce_window(x) * g), from the reference evaluator."""
    loss = lambda a: snp.sum(snp.reduce_window(a, kind, window, strides, padding) * g)
    return sr.evaluate(sr.trace(sr.grad(loss), x), x)[0]


def test_ties_send_the_whole_cotangent_to_the_first_maximum_of_each_window():
    g = np.array([1.0, 10.0, 100.0])
    got = pool_grad(np.ones(5), "max", (3,), 1, "VALID", g)
    np.testing.assert_array_equal(got, [1.0, 10.0, 100.0, 0.0, 0.0])


def test_ties_in_2d_windows_follow_row_major_tap_order():
    x = np.array([[0.0, 2.0, 2.0], [2.0, 2.0, 1.0], [2.0, 0.0, 2.0]])
    g = np.array([[1.0, 10.0], [100.0, 1000.0]])
    got = pool_grad(x, "max", (2, 2), 1, "VALID", g)
    # windows (0,0), (0,1), (1,0), (1,1) pick their first 2 in row-major order: (0,1), (0,1), (1,0), (1,1)
    want = np.array([[0.0, 11.0, 0.0], [100.0, 1000.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, loop_reduce_window_adjoint(x, g, "max", (2, 2), 1, "VALID"))


@pytest.mark.parametrize("kind", ["max", "min"])
def test_integer_valued_ties_match_the_loop_adjoint(kind):
    x = np.random.default_rng(3).integers(0, 3, (2, 3, 9, 8)).astype(np.float64)  # ties everywhere
    args = (kind, (1, 1, 3, 3), (1, 1, 2, 1), "SAME")
    g = cotangent_pattern(sr.evaluate(sr.trace(lambda a: snp.reduce_window(a, *args), x), x)[0].shape)
    np.testing.assert_allclose(pool_grad(x, *args, g), loop_reduce_window_adjoint(x, g, *args), rtol=1e-15)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the loss itself is inf - inf
def test_infinities_are_chosen_and_padding_never_is():
    x = np.array([-np.inf, -np.inf, 3.0, np.inf, 1.0])
    g = np.array([1.0, 10.0, 100.0, 1000.0, 10000.0])
    # SAME windows of 3: [pad, -inf, -inf] -> first in-bounds -inf (x0), [-inf, -inf, 3] -> x2, [-inf, 3, inf] -> x3,
    # [3, inf, 1] -> x3, [inf, 1, pad] -> x3
    np.testing.assert_array_equal(pool_grad(x, "max", (3,), 1, "SAME", g), [1.0, 0.0, 10.0, 11100.0, 0.0])
    # min: [pad, -inf, -inf] and [-inf, -inf, 3] -> x0, [-inf, 3, inf] -> x1, [3, inf, 1] and [inf, 1, pad] -> x4
    np.testing.assert_array_equal(pool_grad(x, "min", (3,), 1, "SAME", g), [11.0, 100.0, 0.0, 0.0, 11000.0])


def test_pooling_gradient_of_a_gradient_matches_finite_differences():
    """window_scatter's own VJP (the cotangents read back at the chosen taps): the gradient of sum(pool(x)^2)
    is scatter(2 pool(x)), linear in the pooled values, so it has a second derivative (distinct values: no ties)."""
    x = np.random.default_rng(8).permutation(2 * 9 * 8).reshape(2, 9, 8) / 10.0
    args = ("max", (1, 3, 2), (1, 2, 1), ((0, 0), (1, 1), (0, 1)))
    grad = sr.grad(lambda a: snp.sum(snp.reduce_window(a, *args) ** 2))
    assert_matches_finite_differences(lambda a: grad(a) * (1.0 + a), x)


def test_windows_of_padding_only_route_nothing():
    x = np.array([2.0, 5.0])
    got = pool_grad(x, "max", (2,), 1, ((3, 0),), np.array([1.0, 10.0, 100.0, 1000.0]))
    np.testing.assert_array_equal(got, [100.0, 1000.0])  # the two [pad, pad] windows (-inf) are dropped


def test_float32_gradients_keep_the_dtype():
    rng = np.random.default_rng(4)
    x, k = rng.standard_normal((2, 3, 8, 8)), rng.standard_normal((4, 3, 3, 3))
    net = lambda a, b: conv_net(snp, a, b)
    graph64 = sr.trace(sr.grad(net, (0, 1)), x, k)
    x32, k32 = x.astype(np.float32), k.astype(np.float32)
    got = sr.evaluate(sr.trace(sr.grad(net, (0, 1)), x32, k32), x32, k32)
    for g32, g64 in zip(got, sr.evaluate(graph64, x, k)):
        assert g32.dtype == np.float32
        np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- case table: loop adjoints and partitioned
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_gradients_match_loop_adjoints(case):
    args = make_inputs(case)
    got = sr.evaluate(sr.trace(lambda *a: case.fn(snp, *a), *args), *args)
    want = case.fn(np, *args)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", TABLE)
def test_partitioned_gradients_match_reference(case, specs, mesh):
    graph, program, args, expected = partition_case(case, specs, mesh)
    assert_all_ranks(program, args, expected)


NET_LAYOUTS = [  # (mesh, x spec): spatial split on 1-d meshes, batch and spatial on (2, 2)
    (sr.Mesh((2,), ("x",)), (None, None, "x", None)),
    (sr.Mesh((4,), ("x",)), (None, None, "x", None)),
    (sr.Mesh((2, 2), ("x", "y")), ("x", None, "y", None)),
]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh,spec", NET_LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("height", [12, 11])  # even and uneven spatial blocks
def test_partitioned_conv_net_gradients(mesh, spec, height):
    rng = np.random.default_rng(5)
    x, k = rng.standard_normal((4, 3, height, 6)), rng.standard_normal((5, 3, 3, 3))
    graph = sr.trace(sr.value_and_grad(lambda a, b: conv_net(snp, a, b), (0, 1)), x, k)
    program = sr.partition(graph, mesh, in_specs=[spec, None], out_specs=[(), spec, None])
    assert_all_ranks(program, [x, k], sr.evaluate(graph, x, k))


@pytest.mark.parametrize("height", [16, 13])
def test_pooling_gradient_on_split_rows_is_a_halo_exchange(height):
    """Max and avg pooling gradients ride on the conv's halo plan: only neighbour collective-permutes
    on the split axis (a strided slice of the split dim would have gathered it), and nothing noted."""
    mesh = sr.Mesh((4,), ("x",))
    x = np.random.default_rng(6).standard_normal((2, 3, height, 7))

    def loss(a):
        p = snp.reduce_window(a, "max", (1, 1, 3, 3), (1, 1, 2, 2), "SAME")
        q = snp.reduce_window(p, "avg", (1, 1, 2, 1), 1, "VALID")
        return snp.sum(q * cotangent_pattern(q.shape))
    graph = sr.trace(sr.grad(loss), x)
    rows = (None, None, "x", None)
    program = sr.partition(graph, mesh, in_specs=[rows], out_specs=[rows])
    kinds = {(c["kind"], c["axes"]) for c in program.comm_summary()}
    assert kinds == {("collective_permute", ("x",))}, program.comm_summary()
    assert not program.notes, program.notes
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


@pytest.mark.parametrize("ranks", [6, 8])
@pytest.mark.parametrize("window,stride,rows", [(7, 1, 13), (2, 3, 26)])
def test_max_pool_gradient_halos_span_shards_or_skip_rows(ranks, window, stride, rows):
    """window_select and window_scatter on rows split 6 or 8 ways: a window of 7 over blocks of 2 or 3 rows needs
    halos from two shards away (one collective-permute per hop); stride 3 past a window of 2 leaves rows in no
    window (26 rows: at least 8 outputs, so the pooled rows split too). Neighbour exchanges only, nothing
    replicated (no notes)."""
    mesh = sr.Mesh((ranks,), ("x",))
    x = np.random.default_rng(9).standard_normal((2, 1, rows, 3))
    pool = ("max", (1, 1, window, 1), (1, 1, stride, 1), ((0, 0), (0, 0), (window // 2, window // 2), (0, 0)))
    graph = sr.trace(sr.grad(lambda a: snp.sum(snp.reduce_window(a, *pool) ** 2)), x)
    rows = (None, None, "x", None)
    program = sr.partition(graph, mesh, in_specs=[rows], out_specs=[rows])
    assert {c["kind"] for c in program.comm_summary()} == {"collective_permute"}, program.comm_summary()
    assert not program.notes, program.notes
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


def test_cumsum_gradient_on_a_split_axis_collectives():
    """flip (a block swap), cumsum (all-gather of one block total per shard), flip back."""
    mesh = sr.Mesh((4,), ("x",))
    x = np.random.default_rng(7).standard_normal((12, 5))
    graph = sr.trace(sr.grad(lambda a: snp.sum(snp.cumsum(a, 0) * cotangent_pattern((12, 5)))), x)
    program = sr.partition(graph, mesh, in_specs=[("x", None)], out_specs=[("x", None)])
    assert [c["kind"] for c in program.comm_summary()] == ["collective_permute", "all_gather", "collective_permute"]
    assert_all_ranks(program, [x], sr.evaluate(graph, x))


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_gradient_program_survives_save_and_load(tmp_path):
    x, k = make_inputs(CASES[-1])
    mesh = sr.Mesh((2, 2), ("x", "y"))
    graph = sr.trace(lambda *a: CASES[-1].fn(snp, *a), x, k)
    program = sr.partition(graph, mesh, in_specs=[resolve(s, mesh) for s in CASES[-1].specs[1]])
    program.save(tmp_path / "p.json")
    loaded = sr.load_program(tmp_path / "p.json")
    assert loaded.hash == program.hash
    assert_all_ranks(loaded, [x, k], sr.evaluate(graph, x, k))
