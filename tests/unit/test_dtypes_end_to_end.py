"""Bool, integer and complex arrays end to end: ``sr.partition`` / ``sr.jit`` + ``sr.run`` on every 1-d and 2-d
mesh of 1 to 4 simulated ranks (tests/mesh_cases.py), through the collectives and the program format, equal to
NumPy in value and in JAX's dtype (a sum of bools or narrow integers is in the default integer, int32 / uint32
without x64, where NumPy's is int64 / uint64: ``JAX_SUM``); a complex max over a split axis ends with "not
supported: ..." on every rank."""
from __future__ import annotations

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.program import load_program

from mesh_cases import meshes_for
from simulated import errors_on_every_rank

ROWS = 12  # divisible by every group size of 1..4 ranks


def _bools(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 2, shape) > 0


def _ints(dtype, shape, seed=0):
    return np.random.default_rng(seed).integers(0, 5, shape).astype(dtype)


def _complex(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype)


# (name, fn over snp or np, inputs, split dims per input: the dim split over every mesh axis, or None)
CASES = [
    ("sum of a split bool array", lambda m, x: m.sum(x), [_bools((ROWS, 5))], [0]),
    ("sum over the split axis of bools", lambda m, x: m.sum(x, axis=0), [_bools((ROWS, 5))], [0]),
    ("sum over the other axis of bools", lambda m, x: m.sum(x, axis=1), [_bools((ROWS, 5))], [0]),
    ("max of split bools", lambda m, x: m.max(x), [_bools((ROWS, 3))], [0]),
    ("min of split bools", lambda m, x: m.min(x, axis=0), [_bools((ROWS, 3))], [0]),
    ("all-true min of split bools", lambda m, x: m.min(x), [np.ones((ROWS, 2), bool)], [0]),
    ("bool sum as bool (a logical or)", lambda m, x: m.sum(x, axis=0, dtype=bool), [_bools((ROWS, 3))], [0]),
    *[(f"sum of split {d}", lambda m, x: m.sum(x), [_ints(d, (ROWS, 4))], [0])
      for d in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")],
    ("int8 sum over the split axis", lambda m, x: m.sum(x, axis=0), [_ints("int8", (ROWS, 4)) + 100], [0]),
    ("int32 max over the split axis", lambda m, x: m.max(x, axis=0), [_ints("int32", (ROWS, 4))], [0]),
    ("complex64 matmul contracting a split dim", lambda m, a, w: a.astype(np.complex64) @ w,
     [np.arange(3 * ROWS, dtype=np.float32).reshape(3, ROWS), _complex(np.complex64, (ROWS, 2))], [1, 0]),
    ("complex64 matmul of split rows", lambda m, a, w: a.astype(np.complex64) @ w,
     [np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3), _complex(np.complex64, (3, 2))], [0, None]),
    ("complex128 sum", lambda m, x: m.sum(x, axis=0), [_complex(np.complex128, (ROWS, 3))], [0]),
]
# jax.numpy.sum's dtype without x64 (bools and integers narrower than int32 sum in int32, unsigned ones in uint32,
# 32-bit ones in themselves); NumPy's platform-integer sums (int64 / uint64) are what this replaces.
JAX_SUM = {"bool": "int32", "int8": "int32", "int16": "int32", "int32": "int32", "uint8": "uint32",
           "uint16": "uint32", "uint32": "uint32"}


def _expected(name, fn, inputs):
    """NumPy's value, in JAX's dtype for a sum of bools or narrow integers (no ``dtype=``)."""
    expected = np.asarray(fn(np, *inputs))
    if "sum" in name and "as bool" not in name and inputs[0].dtype.name in JAX_SUM:
        return expected.astype(JAX_SUM[inputs[0].dtype.name])
    return expected


MESHES = [m for n in (1, 2, 3, 4) for m in meshes_for(n)]
PARAMS = [pytest.param(c, m, id=f"{c[0]}-{m}") for c in CASES for m in MESHES]


def _specs(mesh, inputs, dims):
    axes = mesh.axis_names
    return [None if d is None else sr.P(*[axes if i == d else None for i in range(x.ndim)])
            for x, d in zip(inputs, dims)]


def _assert_numpy(outs, expected, what):
    for rank, got in enumerate(outs):
        got = got[0] if isinstance(got, (list, tuple)) else got
        assert got.dtype == expected.dtype and got.shape == expected.shape, (what, rank, got.dtype, expected.dtype)
        np.testing.assert_array_equal(got, expected, err_msg=f"{what} on rank {rank}")


@pytest.mark.parametrize("case, mesh", PARAMS)
def test_partitioned_run_equals_numpy(case, mesh):
    name, fn, inputs, dims = case
    expected = _expected(name, fn, inputs)
    program = sr.partition(sr.trace(lambda *a: fn(snp, *a), *inputs), mesh, in_specs=_specs(mesh, inputs, dims))
    _assert_numpy(run_simulated(mesh.size, lambda comm: sr.run(program, *inputs, comm=comm)), expected, name)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_jit_and_the_program_format_carry_the_dtypes(case, tmp_path):
    name, fn, inputs, dims = case
    mesh, expected = sr.Mesh((2, 2), ("x", "y")), _expected(name, fn, inputs)
    specs = tuple(_specs(mesh, inputs, dims))
    outs = run_simulated(4, lambda comm: np.asarray(sr.jit(lambda *a: fn(snp, *a), mesh=mesh, in_specs=specs,
                                                           comm=comm)(*inputs)))  # a DArray gathers: every rank
    _assert_numpy(outs, expected, f"{name} (jit)")
    program = sr.partition(sr.trace(lambda *a: fn(snp, *a), *inputs), mesh, in_specs=list(specs))
    program.save(tmp_path / "program")
    loaded = load_program(tmp_path / "program")
    _assert_numpy(run_simulated(4, lambda comm: sr.run(loaded, *inputs, comm=comm)), expected, f"{name} (saved)")


def test_a_traced_sum_has_jaxs_dtype():
    """The partial sums and their all-reduce have the dtype of JAX's sum (the default integer for bools and
    narrow integers, ``JAX_SUM``), so they agree (a bool all-reduce of int64 partials was an MPI datatype
    mismatch)."""
    for dtype in ("bool", "int8", "int16", "int32", "uint8", "uint32", "int64", "uint64", "float16", "complex64"):
        x = np.zeros((4, 2), dtype)
        want = JAX_SUM.get(dtype, dtype)
        graph = sr.trace(lambda x: snp.sum(x), x)
        assert graph.output_specs[0].dtype == want, dtype
        program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[sr.P("x", None)])
        reduced = [c for c in program.instrs if c.op == "all_reduce"]
        assert [c.dtype for c in reduced] == [want], (dtype, program)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_complex_max_over_a_split_axis_is_refused_on_every_rank(n, capfd):
    """NumPy orders complex numbers; MPI's MAX does not: every rank ends with "not supported: ..." at the bind of
    the all-reduce, before any collective (one rank: no all-reduce, NumPy's answer)."""
    x = _complex(np.complex64, (ROWS, 2))
    mesh = sr.Mesh((n,), ("x",))
    program = sr.partition(sr.trace(lambda x: snp.max(x), x), mesh, in_specs=[sr.P("x", None)])
    if n == 1:
        _assert_numpy(run_simulated(1, lambda comm: sr.run(program, x, comm=comm)), np.max(x), "one rank")
        return
    errors = errors_on_every_rank(n, lambda comm: sr.run(program, x, comm=comm))
    assert all(e is not None for e in errors), errors
    said = capfd.readouterr().err + "\n".join(errors)
    refusal = "not supported: all_reduce of complex64 with op 'max' (NumPy orders complex numbers lexicographically"
    assert said.count(refusal) >= n, said
