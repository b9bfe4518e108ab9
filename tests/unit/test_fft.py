"""The Fourier transforms (issue 28: ops/fft.py): the case table against NumPy (reference evaluator) and
partitioned on simulated meshes (1..8 ranks, 1-d and 2-d, reordered devices, uneven), the plan (a split other
dim moves nothing, a split transformed axis is gathered), dtypes, and refusals that name the rule."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad

from op_cases_fft import CASES
from op_cases_gather import check_partitioned, check_reference
from simulated import assert_all_ranks, collectives

MESHES = [sr.Mesh((1,), ("x",)), sr.Mesh((4,), ("x",)), sr.Mesh((2, 3), ("x", "y")),
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


def test_a_split_other_dim_moves_nothing_and_a_split_axis_is_gathered():
    x = np.random.default_rng(0).standard_normal((8, 6))
    graph = sr.trace(lambda a: snp.fft.fft(a, axis=1), x)
    program = sr.partition(graph, MESH_4, in_specs=[("x", None)], out_specs=[("x", None)])
    assert collectives(program) == []
    assert_all_ranks(program, [x], [np.fft.fft(x, axis=1)], tol=1e-12)
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x")])
    assert [kind for kind, _ in collectives(program)] == ["all_gather"]


@pytest.mark.parametrize("dtype, want", [("float32", "complex64"), ("float64", "complex128"), ("int32", "complex64")])
def test_results_keep_the_operands_precision(dtype, want):
    (y,) = sr.evaluate(sr.trace(lambda a: snp.fft.fft(a), np.ones(4, dtype)), np.ones(4, dtype))
    assert y.dtype == want
    np.testing.assert_allclose(y, [4, 0, 0, 0])


@pytest.mark.parametrize("call, match", [
    (lambda a: snp.fft.fft(a, norm="none"), "fft's norm must be one of"),
    (lambda a: snp.fft.rfft(snp.fft.fft(a)), "rfft transforms real input"),
    (lambda a: snp.fft.fftn(a, s=(2,), axes=(0, 1)), "one length >= 1 each"),
    (lambda a: snp.fft.fftfreq(0), "fftfreq takes a static int n >= 1"),
])
def test_bad_input_is_refused_naming_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        sr.trace(call, sr.TensorSpec((3, 5)))


def test_a_gradient_through_a_transform_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="fft.irfft has no VJP"):
        sr.trace(grad(lambda a: snp.sum(snp.fft.irfft(a))), np.ones(4))


@pytest.mark.parametrize("complex_path", [
    lambda a: snp.sum(snp.real(snp.fft.fft(a))),  # a complex intermediate between real input and real output
    lambda a: snp.sum(snp.imag(a * (1 + 2j))),
    lambda a: snp.sum(snp.real(snp.astype(a, "complex64") * 3.0)),
], ids=["fft", "scaled by a complex", "cast to complex"])
def test_a_gradient_through_complex_values_is_refused_not_zero(complex_path):
    # the autodiff carries real cotangents only: without the refusal these gradients came out as zeros, silently
    with pytest.raises(NotImplementedError, match="through complex values"):
        sr.trace(grad(complex_path), np.ones(4, np.float32))


def test_a_complex_value_off_the_gradients_path_is_no_error():
    def f(a):
        snp.fft.fft(a)  # depends on the input, but no gradient reaches it
        return snp.sum(a * a)
    graph = sr.trace(grad(f), np.ones(4, np.float32))
    assert graph is not None
