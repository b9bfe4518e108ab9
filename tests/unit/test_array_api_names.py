"""The Array API names added for the conformance suite (issue 28): the case table (``unique_*`` with a static
size, ``real`` / ``imag`` / ``conj``, ``all`` / ``any`` over nothing) against NumPy and partitioned on the
simulated meshes; the eager calls of data-dependent length (no ``size=`` outside a trace), element writes
that compile one program, the dtype functions, DLPack, and the creation keywords of the standard."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import eager
from spmd_runtime.autodiff import grad

from op_cases_array_api import CASES
from op_cases_gather import check_partitioned, check_reference, simulated_meshes

MESHES = simulated_meshes()[::2]  # 1, 3, 6 ranks; 2x2, 2x4, reordered 2x4
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
    check_reference(case)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    check_partitioned(case, specs, mesh)


@pytest.fixture
def mesh1():
    with sr.Mesh((1,), ("x",)) as mesh:
        yield mesh


def test_eager_data_dependent_lengths_need_no_size(mesh1):
    a = np.array([[3.0, np.nan, 1.0, 0.0], [3.0, 2.0, np.nan, 1.0]])
    x = sr.device_put(a)
    got, want = snp.unique_all(x), np.unique_all(a)
    for field in want._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field))
    np.testing.assert_array_equal(np.asarray(snp.unique_values(x)), np.unique_values(a))
    for g, w in zip(snp.nonzero(x), np.nonzero(a)):
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_array_equal(np.asarray(snp.argwhere(x)), np.argwhere(a))
    assert np.asarray(snp.unique_values(sr.device_put(np.zeros((0, 3))))).shape == (0,)


def test_a_traced_unique_still_needs_a_static_size():
    with pytest.raises(ValueError, match="needs a static size="):
        sr.trace(lambda a: snp.unique_values(a), sr.TensorSpec((4,)))


def test_element_writes_compile_one_program(mesh1):
    """x[i] = v for every i and many values (how hypothesis fills arrays): indices and value are data."""
    x = sr.device_put(np.zeros((6, 2), np.float32))
    before = len(eager._compiled)
    for i in range(6):
        x[i, 1] = i * 1.5
        x[i, 0] = -i
    assert len(eager._compiled) - before == 1
    np.testing.assert_array_equal(np.asarray(x), np.stack([-np.arange(6), np.arange(6) * 1.5], 1))
    x[1:3] = 7.0  # a slice key: the general path
    np.testing.assert_array_equal(np.asarray(x)[1:3], 7.0)


@pytest.mark.parametrize("a, b", [("int8", "uint8"), ("int64", "float32"), ("float64", "float32"), ("bool", "int8"),
                                  ("uint16", "int16"), ("complex64", "float64")])
def test_dtype_functions_are_the_standards(a, b):
    sr.config.update("enable_x64", True)
    try:
        assert snp.result_type(a, b) == np.result_type(a, b) or {a, b} == {"int64", "float32"}
        assert snp.can_cast(a, b) == np.can_cast(a, b, "safe")
        for kind in ("bool", "signed integer", "unsigned integer", "integral", "real floating", "complex floating",
                     "numeric", ("integral", "bool")):
            assert snp.isdtype(np.dtype(a), kind) == np.isdtype(np.dtype(a), kind)
    finally:
        sr.config.update("enable_x64", False)


def test_dlpack_round_trip(mesh1):
    x = sr.device_put(np.arange(6.0).reshape(2, 3))
    assert x.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(x), np.arange(6.0).reshape(2, 3))
    y = snp.from_dlpack(np.arange(3))
    assert isinstance(y, sr.DArray) and snp.from_dlpack(x) is x
    np.testing.assert_array_equal(np.asarray(y), np.arange(3))


def test_creation_keywords_of_the_standard():
    graph = sr.trace(lambda: (snp.full((2,), 3), snp.full((2,), 1.5), snp.zeros(2, dtype="int8", device="cpu"),
                              snp.arange(3, dtype="float32", device=None),
                              snp.reshape(snp.ones((2, 3)), shape=(3, 2), copy=None),
                              snp.astype(snp.ones(2), "int32", copy=False)))
    outs = sr.evaluate(graph)
    assert [o.dtype for o in outs] == [np.int32, np.float32, np.int8, np.float32, np.float32, np.int32]
    assert outs[4].shape == (3, 2)
    with pytest.raises(ValueError, match="device= must be None, 'cpu' or a mesh"):
        sr.trace(lambda: snp.zeros(2, device="gpu:1"))


def test_real_and_conj_pass_the_gradient():
    x = np.random.default_rng(0).standard_normal(5)
    (g,) = sr.evaluate(sr.trace(grad(lambda a: snp.sum(snp.real(a) * 2.0 + snp.conj(a) + snp.imag(a))), x), x)
    np.testing.assert_allclose(g, np.full(5, 3.0))


def test_eager_boolean_masks_index_and_assign(mesh1):
    a = np.arange(12.0).reshape(3, 4)
    x, mask = sr.device_put(a), sr.device_put(a % 3 == 0)
    np.testing.assert_array_equal(np.asarray(x[mask]), a[a % 3 == 0])
    np.testing.assert_array_equal(np.asarray(x[sr.device_put(np.array([True, False, True]))]), a[[0, 2]])
    x[mask] = -1.0
    a[a % 3 == 0] = -1.0
    np.testing.assert_array_equal(np.asarray(x), a)
    assert np.asarray(sr.device_put(np.zeros(0))[sr.device_put(np.zeros(0, bool))]).shape == (0,)


def test_a_0d_integer_darray_is_an_index(mesh1):
    import operator
    assert operator.index(sr.device_put(np.asarray(3, np.uint8))) == 3 and list(range(sr.device_put(np.int64(2))))
    with pytest.raises(TypeError):
        operator.index(sr.device_put(np.asarray(1.5)))
