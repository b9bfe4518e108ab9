"""Eager DArrays (spmd_runtime/eager.py): operators, methods and snp functions outside jit, on every mesh of
this world size, against NumPy on the global arrays.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_eager_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import operator

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import eager

pytestmark = pytest.mark.mpi

A = (np.arange(7 * 5, dtype="float32").reshape(7, 5) - 11) / 7  # uneven over 2, 3, 4, 6, 8
B = np.linspace(0.5, 2.0, 35, dtype="float32").reshape(7, 5)

# (name, on DArrays / NumPy arrays x, y, the same on NumPy's global arrays)
CASES = [
    ("add", lambda x, y: x + y, None),
    ("sub scalar", lambda x, y: x - 1.5, None),
    ("reflected rsub", lambda x, y: 2.0 - x, None),
    ("rtruediv", lambda x, y: 1.0 / y, None),
    ("mul pow", lambda x, y: x * y ** 2, None),
    ("neg", lambda x, y: -x, None),
    ("compare", lambda x, y: x < y, None),
    ("eq", lambda x, y: x == x, None),
    ("matmul", lambda x, y: x.T @ y, None),
    ("getitem", lambda x, y: x[1:6:2, ::-1], None),
    ("getitem int", lambda x, y: x[3], None),
    ("sum all", lambda x, y: x.sum(), None),
    ("sum axis", lambda x, y: x.sum(axis=0), None),
    ("mean keepdims", lambda x, y: x.mean(axis=1, keepdims=True), None),
    ("max", lambda x, y: x.max(axis=0), None),
    ("reshape", lambda x, y: x.reshape(5, 7), None),
    ("transpose", lambda x, y: x.T, None),
    ("astype", lambda x, y: x.astype("float64"), None),
    ("snp.exp", lambda x, y: snp.exp(x), lambda x, y: np.exp(x)),
    ("snp.where", lambda x, y: snp.where(x > 0, x, y), lambda x, y: np.where(x > 0, x, y)),
    ("snp.concatenate", lambda x, y: snp.concatenate([x, y], axis=1), lambda x, y: np.concatenate([x, y], axis=1)),
    ("snp.einsum", lambda x, y: snp.einsum("ij,ij->i", x, y), lambda x, y: np.einsum("ij,ij->i", x, y)),
    ("snp.maximum", lambda x, y: snp.maximum(x, 0.0), lambda x, y: np.maximum(x, np.float32(0))),
    ("snp.sum kw", lambda x, y: snp.sum(x * y, axis=1), lambda x, y: np.sum(x * y, axis=1)),
]
SPECS = [lambda m: sr.P(m.axis_names[0]), lambda m: sr.P(None, m.axis_names[-1]), lambda m: sr.P()]


@pytest.mark.parametrize("name,fn,np_fn", CASES, ids=[c[0] for c in CASES])
def test_eager_matches_numpy(world_meshes, name, fn, np_fn):
    want = (np_fn or fn)(A, B)
    for mesh in world_meshes:
        for spec in SPECS:
            x, y = sr.device_put(A, spec(mesh), mesh), sr.device_put(B, spec(mesh), mesh)
            got = fn(x, y)
            assert isinstance(got, sr.DArray), (name, type(got))
            assert got.dtype == want.dtype and got.shape == want.shape, (name, mesh, got, want.dtype, want.shape)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6, err_msg=f"{name} {mesh}")


def test_mixed_darray_and_numpy_operands(world_meshes):
    """A NumPy operand is a global array every rank holds (agreed by digest, as jit's)."""
    for mesh in world_meshes:
        x = sr.device_put(A, sr.P(mesh.axis_names[0]), mesh)
        np.testing.assert_allclose(np.asarray(x + B), A + B, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(B * x), A * B, rtol=1e-6)  # ndarray.__mul__ defers to the DArray


def test_results_chain_and_keep_layout():
    n = MPI.COMM_WORLD.size
    mesh = sr.Mesh((n,), ("x",))
    a = np.linspace(-1, 1, (2 * n + 1) * 3, dtype="float32").reshape(2 * n + 1, 3)  # uneven, no rank empty
    x = sr.device_put(a, sr.P("x"), mesh)
    z = snp.tanh(x * 2.0 + 1.0) - x
    assert z.sharding == x.sharding  # elementwise results keep their operands' layout: nothing moved
    assert z.local.shape == x.local.shape
    np.testing.assert_allclose(np.asarray(z), np.tanh(a * 2 + 1) - a, rtol=1e-6, atol=1e-6)


def test_one_program_per_signature():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    x + 1.0
    before = len(eager._compiled)
    for _ in range(3):
        x + 1.0
    assert len(eager._compiled) == before  # the same (op, static args, layout): the program is reused
    x + 2.0
    assert len(eager._compiled) == before + 1  # another static scalar: its own program


def test_weak_python_scalars_keep_the_dtype():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    assert (x * 2.0).dtype == np.float32 and (2 * x).dtype == np.float32
    i = sr.device_put(np.arange(6, dtype="int32"), sr.P("x"), mesh)
    assert (i + 1).dtype == np.int32


def test_scalar_conversions():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    assert float(x.sum()) == pytest.approx(float(A.sum()), rel=1e-6)
    assert bool(x.max() > 0) is True and len(x) == 7
    with pytest.raises(TypeError, match="only a 0-d DArray converts"):
        float(x)


def test_bad_input_is_an_error_on_every_rank():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    with pytest.raises(ValueError, match="jit"):  # a shape error while tracing, agreed on by every rank
        x + np.ones((3, 3), "float32")
    with pytest.raises(ValueError, match="no DArray operand .* needs a mesh"):
        eager.apply(operator.add, 1, 2)


def test_snp_outside_a_trace_makes_replicated_darrays_on_the_context_mesh():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    with pytest.raises(ValueError, match="needs a mesh"):  # no context mesh, no DArray operand
        snp.zeros((2, 3))
    with mesh:
        z, e = snp.ones((2, 3), "float32"), snp.exp(B)
    assert isinstance(z, sr.DArray) and z.sharding.is_replicated and z.mesh == mesh
    np.testing.assert_array_equal(np.asarray(z), np.ones((2, 3), "float32"))
    np.testing.assert_allclose(np.asarray(e), np.exp(B), rtol=1e-6)


def test_array_api_object_protocol():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    assert x.__array_namespace__() is snp and x.device == mesh and x.to_device(mesh) is x
    with pytest.raises(ValueError, match="lives on its mesh"):
        x.to_device("cpu")


def test_element_access_compiles_one_program_per_layout():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    def programs():
        return sum(j.cache_info()["misses"] for j in eager._compiled.values())
    x[0, 0]
    before = programs()
    got = [[float(x[i, j]) for j in range(5)] for i in range(-7, 7)]
    np.testing.assert_array_equal(np.array(got, "float32"), A[list(range(-7, 7))])
    np.testing.assert_array_equal(np.asarray(x[-1]), A[-1])
    assert programs() <= before + 1  # x[i] (one index) may be one more program; the 70 x[i, j] none
    with pytest.raises(IndexError, match="index 7 is out of bounds for axis 0 with size 7"):
        x[7, 0]


def test_setitem_updates_the_darray_in_its_layout():
    mesh = sr.Mesh((MPI.COMM_WORLD.size,), ("x",))
    x = sr.device_put(A, sr.P("x"), mesh)
    want = A.copy()
    x[2:5, 1] = 7.0
    want[2:5, 1] = 7.0
    x[[0, 6]] = np.ones(5, "float32")
    want[[0, 6]] = 1.0
    assert x.sharding == sr.device_put(A, sr.P("x"), mesh).sharding
    np.testing.assert_array_equal(np.asarray(x), want)
