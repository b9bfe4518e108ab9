"""The linalg decompositions (issue 28: ops/decompositions.py, the ``matrix_function`` op, and the linalg functions
composed of it): the case table against NumPy (reference evaluator) and partitioned on simulated meshes (1..8
ranks, 1-d and 2-d, reordered devices, stacks uneven over most of them), the plans (a split batch dim moves
nothing, split matrix dims are gathered), the named-tuple results, the VJPs by central differences, and
refusals that name the rule."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_decompositions import CASES
from op_cases_gather import check_partitioned, check_reference
from simulated import assert_all_ranks, collectives

MESHES = [sr.Mesh((1,), ("x",)), sr.Mesh((3,), ("x",)), sr.Mesh((2, 3), ("x", "y")),
          sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]
MESH_4 = sr.Mesh((4,), ("x",))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


def _spd(k=8, n=3, seed=0):
    a = np.random.default_rng(seed).standard_normal((k, n, n))
    return a @ a.transpose(0, 2, 1) + 4 * np.eye(n)


def test_a_split_batch_moves_nothing_and_split_matrices_are_gathered():
    x = _spd()
    graph = sr.trace(lambda a: snp.linalg.inv(a), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None, None)], out_specs=[("x", None, None)])
    assert collectives(program) == []
    assert_all_ranks(program, [x], [np.linalg.inv(x)])
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x", None)])
    assert [kind for kind, _ in collectives(program)] == ["all_gather"]
    assert_all_ranks(program, [x], [np.linalg.inv(x)])


def test_an_uneven_batch_is_made_whole_so_no_padding_is_decomposed():
    """5 matrices over 4 ranks: a short block's zero padding would make inv raise (a singular matrix)."""
    x = _spd(k=5)
    graph = sr.trace(lambda a: snp.linalg.inv(a) + snp.linalg.cholesky(a), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None, None)])
    assert_all_ranks(program, [x], [np.linalg.inv(x) + np.linalg.cholesky(x)])


def test_results_are_the_array_apis_named_tuples():
    x = _spd(k=2)
    fields = []

    def fn(a):
        results = (snp.linalg.eigh(a), snp.linalg.slogdet(a), snp.linalg.qr(a), snp.linalg.svd(a))
        fields.extend(r._fields for r in results)
        return results[0].eigenvalues, results[1].logabsdet
    outs = sr.evaluate(sr.trace(fn, x), x)
    assert fields == [("eigenvalues", "eigenvectors"), ("sign", "logabsdet"), ("Q", "R"), ("U", "S", "Vh")]
    np.testing.assert_allclose(outs[0], np.linalg.eigh(x)[0])
    np.testing.assert_allclose(outs[1], np.linalg.slogdet(x)[1])


def _numeric_grad(f, x, eps=1e-6):
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        out[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return out


GRADS = [
    ("inv", lambda m, a: m.linalg.inv(a)),
    ("det", lambda m, a: m.linalg.det(a)),
    ("slogdet", lambda m, a: m.linalg.slogdet(a)[1] * m.linalg.slogdet(a)[0]),
    ("solve_matrix", lambda m, a: m.linalg.solve(a, a[:, :, :2] * 2.0 + 1.0)),
    ("solve_vector", lambda m, a: m.linalg.solve(a, a[0, 0])),
    ("matrix_power", lambda m, a: m.linalg.matrix_power(a, -2) + m.linalg.matrix_power(a, 3)),
]


@pytest.mark.parametrize("fn", [f for _, f in GRADS], ids=[n for n, _ in GRADS])
def test_vjp_matches_central_differences(fn):
    x = _spd(k=2, seed=3)
    w = np.random.default_rng(4).standard_normal(np.shape(fn(np, x)))
    (got,) = sr.evaluate(sr.trace(grad(lambda a: snp.sum(fn(snp, a) * w)), x), x)
    np.testing.assert_allclose(got, _numeric_grad(lambda a: np.sum(fn(np, a) * w), x), rtol=1e-5, atol=1e-6)


def test_a_gradient_through_a_factorisation_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="linalg.cholesky has no VJP"):
        sr.trace(grad(lambda a: snp.sum(snp.linalg.cholesky(a))), _spd(k=1))


@pytest.mark.parametrize("call, match", [
    (lambda a: snp.linalg.inv(a[0, 0]), r"takes a stack of square matrices .*got shape \(5,\)"),
    (lambda a: snp.linalg.det(a[:, :, :2]), "takes a stack of square matrices"),
    (lambda a: snp.linalg.qr(a, mode="r"), "qr's mode must be one of"),
    (lambda a: snp.linalg.solve(a, a[0, :2]), r"needs x2 of shape \(5,\) or \(\.\.\., 5, K\)"),
    (lambda a: snp.linalg.matrix_power(a, 1.5), "matrix_power takes a static int n"),
    (lambda a: snp.linalg.cross(a, a), "cross needs size 3 along axis"),
    (lambda a: snp.linalg.pinv(a, rtol=a), "pinv takes a static float rtol"),
])
def test_bad_input_is_refused_naming_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        sr.trace(call, sr.TensorSpec((3, 5, 5)))
