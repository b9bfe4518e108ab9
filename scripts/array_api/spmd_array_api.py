"""``spmd_runtime.numpy`` on eager DArrays as an Array API namespace, for data-apis/array-api-tests.

``scripts/array_api_suite.py`` points the suite here (``ARRAY_API_TESTS_MODULE=spmd_array_api``). Every name
is ``spmd_runtime.numpy``'s own: a function snp lacks stays missing (the suite counts it as a failure). What
this module adds is only what a test harness must: a mesh over the MPI world (the context mesh, so snp calls
outside a trace make DArrays on it), ``asarray`` from Python data (NumPy parses the data, then the array is
laid out on a dim drawn by a seeded generator: the same draws on every rank, so the ranks agree), and the
namespace metadata the suite reads (``__array_api_version__``, ``__array_namespace_info__``, dtype objects).
Data-type defaults follow NumPy's (float64 / int64): the suite runs with JAX's x64 switch on (``sr.config``).
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp

__array_api_version__ = "2023.12"
_WORLD = MPI.COMM_WORLD.Get_size()
MESH = sr.Mesh((_WORLD,), ("x",))
sr.set_mesh(MESH)
sr.config.update("enable_x64", True)  # the standard's float64 / int64 where asked for, NumPy's defaults
_draws = np.random.default_rng(int(os.environ.get("SPMD_ARRAY_API_SEED", "0")))
SHARDED = _WORLD > 1 and os.environ.get("SPMD_ARRAY_API_SHARDED", "1") != "0"

DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64",
          "complex64", "complex128")
for _name in DTYPES:
    globals()[_name] = np.dtype(_name)


def __getattr__(name):
    """snp's name, or AttributeError (the suite stubs it and fails the tests that use it)."""
    return getattr(snp, name)


def _laid_out(host: np.ndarray) -> sr.DArray:
    """``host`` on the mesh: split over the world on a drawn dim (one of size >= 1), or replicated."""
    dims = [d for d, n in enumerate(host.shape) if n >= 1]
    if not SHARDED or not dims:
        return sr.device_put(host, sr.P(), MESH)
    dim = dims[int(_draws.integers(len(dims)))]
    return sr.device_put(host, sr.P(*([None] * dim), "x"), MESH)


def asarray(obj, /, *, dtype=None, device=None, copy=None):
    """Python data or an array as a DArray (a DArray stays as it is, cast where ``dtype`` asks)."""
    if isinstance(obj, sr.DArray):
        return obj if dtype is None or np.dtype(dtype) == obj.dtype else snp.astype(obj, dtype)
    return _laid_out(np.asarray(obj, dtype=dtype))


class _Info:
    """The inspection namespace (``__array_namespace_info__``): one device, NumPy's default dtypes."""

    def capabilities(self):
        return {"boolean indexing": False, "data-dependent shapes": False, "max dimensions": 64}

    def default_device(self):
        return MESH  # what a DArray's ``.device`` is

    def devices(self):
        return [MESH]

    def default_dtypes(self, *, device=None):
        return {"real floating": float64, "complex floating": complex128, "integral": int64, "indexing": int64}

    def dtypes(self, *, device=None, kind=None):
        return {n: globals()[n] for n in DTYPES if kind is None or np.isdtype(globals()[n], kind)}


def __array_namespace_info__():
    return _Info()
