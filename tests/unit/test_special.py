"""erf, erfc, erfinv (ops/special.py): the kernels' accuracy against math.erf / math.erfc on 2e6 points (the
figures the module docstring states), special values, the case table on the simulated meshes, and the VJPs
by central finite differences."""
import math

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.nn as snn
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad
from spmd_runtime.ops.special import ERF, ERF_INV, ERFC

from op_cases_gather import check_partitioned, check_reference, simulated_meshes
from op_cases_special import CASES

MESHES = simulated_meshes()
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]


def _points():
    rng = np.random.default_rng(0)
    return np.concatenate([rng.uniform(-6, 6, 10 ** 6), rng.uniform(-1, 1, 10 ** 6)])


def test_cody_error_against_math():
    """The docstring's figures: float64 erf within 3.4e-16 absolute and 6.7e-16 relative, erfc within 1.0e-15
    relative; float32 erf equal to math.erf rounded to float32 everywhere."""
    x = _points()
    erf, erfc = ERF.kernel(np, x), ERFC.kernel(np, x)
    want_erf = np.fromiter(map(math.erf, x), np.float64, len(x))
    want_erfc = np.fromiter(map(math.erfc, x), np.float64, len(x))
    assert np.max(np.abs(erf - want_erf)) <= 3.4e-16
    assert np.max(np.abs(erf - want_erf) / np.abs(want_erf)) <= 6.7e-16
    assert np.max(np.abs(erfc - want_erfc) / want_erfc) <= 1.0e-15
    x32 = x.astype(np.float32)
    got32 = ERF.kernel(np, x32)
    assert got32.dtype == np.float32
    np.testing.assert_array_equal(got32, np.fromiter(map(math.erf, x32.astype(float)), np.float64, len(x)).astype(np.float32))


def test_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 30.0, -30.0, 1e-300])
    np.testing.assert_array_equal(ERF.kernel(np, x), [0.0, -0.0, 1.0, -1.0, np.nan, 1.0, -1.0, math.erf(1e-300)])
    np.testing.assert_array_equal(ERFC.kernel(np, x), [1.0, 1.0, 0.0, 2.0, np.nan, 0.0, 2.0, 1.0])
    y = np.array([0.0, 1.0, -1.0, 1.5, -2.0, np.nan, 0.5])
    got = ERF_INV.kernel(np, y)
    np.testing.assert_array_equal(got[:6], [0.0, np.inf, -np.inf, np.nan, np.nan, np.nan])
    assert abs(got[6] - 0.4769362762044699) < 1e-16  # erfinv(1/2), from the literature


def test_erfinv_inverts_erf_in_the_center_and_the_tails():
    rng = np.random.default_rng(1)
    y = np.concatenate([rng.uniform(-0.5, 0.5, 10 ** 5), 1.0 - 10.0 ** -rng.uniform(0.3, 15.9, 10 ** 5)])
    x = ERF_INV.kernel(np, y)
    center = np.abs(y) <= 0.5
    assert np.max(np.abs(ERF.kernel(np, x[center]) - y[center])) <= 4.5e-16
    tail = ~center
    relative = np.abs(ERFC.kernel(np, x[tail]) - (1.0 - y[tail])) / (1.0 - y[tail])
    assert np.max(relative) <= 1e-14
    np.testing.assert_array_equal(ERF_INV.kernel(np, -y), -x)  # odd


def test_float32_erfinv_takes_one_step_and_rounds_like_the_float64_path():
    rng = np.random.default_rng(2)
    y = np.concatenate([rng.uniform(-1, 1, 10 ** 6), 1 - 10.0 ** -rng.uniform(0, 7.2, 10 ** 5)]).astype(np.float32)
    y = y[np.abs(y) < 1]
    got = ERF_INV.kernel(np, y)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ERF_INV.kernel(np, y.astype(np.float64)).astype(np.float32))


def test_traced_dtypes_follow_jax():
    """Floats keep their dtype; integers are computed in the default float (jax.scipy.special.erf: float32
    without x64)."""
    graph = sr.trace(lambda a, b: (snp.erf(a), snp.erfc(b), snp.erfinv(a)),
                     sr.TensorSpec((3,), "float32"), sr.TensorSpec((3,), "int64"))
    assert [graph.nodes[o].dtype for o in graph.outputs] == ["float32", "float32", "float32"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


def test_split_operand_moves_nothing():
    x = np.linspace(-3, 3, 48).reshape(8, 6)
    graph = sr.trace(lambda a: snp.erf(a) + snp.erfc(a) + snp.erfinv(snp.tanh(a)), x)
    program = sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[("x", None)])
    assert program.comm_summary() == []


@pytest.mark.parametrize("fn", [snp.erf, snp.erfc, lambda a: snp.erfinv(snp.tanh(a) * 0.9),
                                lambda a: snn.gelu(a, approximate=False)],
                         ids=["erf", "erfc", "erfinv", "gelu_exact"])
def test_vjp_by_finite_differences(fn):
    x = np.linspace(-2.5, 2.5, 11)
    loss = lambda a: snp.sum(fn(a) * np.arange(1.0, 12.0))
    (g,) = sr.evaluate(sr.trace(grad(loss), x), x)
    f = lambda a: float(sr.evaluate(sr.trace(loss, a), a)[0])
    eps = 1e-6
    fd = np.array([(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in np.eye(len(x))])
    np.testing.assert_allclose(g, fd, rtol=1e-7, atol=1e-7)
