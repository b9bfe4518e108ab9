"""``spmd_runtime.numpy`` on eager DArrays as an Array API namespace, for data-apis/array-api-tests.

``scripts/array_api_suite.py`` points the suite here (``ARRAY_API_TESTS_MODULE=spmd_array_api``). Every name
is ``spmd_runtime.numpy``'s own: a function snp lacks stays missing (the suite counts it as a failure). What
this module adds is only what a test harness must: a mesh over the MPI world (the context mesh, so snp calls
outside a trace make DArrays on it), ``asarray`` from Python data (NumPy parses the data, then the array is
laid out on a drawn dim), and the namespace metadata the suite reads (``__array_api_version__``,
``__array_namespace_info__``, dtype objects).

At ``mpiexec -n N`` every input array the suite draws is split over the N ranks on a drawn dim: hypothesis
builds each one flat and reshapes it (``ArrayStrategy.do_draw``); here it does so on the host with NumPy, and
the layout is chosen after that, on the array of the test's shape (``_drawn_laid_out``). Any dim may be drawn, sizes below
N included (some ranks then hold empty blocks: the uneven case) and size 0; a 0-d array stays replicated.
The draws come from a generator seeded by the test's name (``$PYTEST_CURRENT_TEST``) and the seed
``$SPMD_ARRAY_API_SEED``: every rank runs the same examples in the same order, so every rank draws the same
dims, and a test run alone (``-k``) lays its inputs out as in the whole run. ``SPMD_ARRAY_API_SHARDED=0``
keeps everything replicated.

The ranks must also take the same examples: ``spmd_suite_plugin.py`` keeps hypothesis off the clock at N ranks.
Data-type defaults follow NumPy's (float64 / int64): the suite runs with JAX's x64 switch on (``sr.config``).
"""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
from hypothesis.extra import array_api as hypothesis_array_api
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp

__array_api_version__ = "2023.12"
_WORLD = MPI.COMM_WORLD.Get_size()
MESH = sr.Mesh((_WORLD,), ("x",))
sr.set_mesh(MESH)
sr.config.update("enable_x64", True)  # the standard's float64 / int64 where asked for, NumPy's defaults
SEED = int(os.environ.get("SPMD_ARRAY_API_SEED", "0"))
SHARDED = _WORLD > 1 and os.environ.get("SPMD_ARRAY_API_SHARDED", "1") != "0"

DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64",
          "complex64", "complex128")
for _name in DTYPES:
    globals()[_name] = np.dtype(_name)


def __getattr__(name):
    """snp's name, or AttributeError (the suite stubs it and fails the tests that use it)."""
    return getattr(snp, name)


class _Draws:
    """The split dims: a generator seeded by (SEED, the current test's name), reseeded when the test changes."""
    test, rng = None, None

    @classmethod
    def dim(cls, ndim: int) -> int:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "path::name[id] (call)"
        if cls.rng is None or test != cls.test:
            cls.test, cls.rng = test, np.random.default_rng([SEED, zlib.crc32(test.encode())])
        return int(cls.rng.integers(ndim))


def laid_out(host: np.ndarray) -> sr.DArray:
    """``host`` split over the world on a drawn dim; 0-d (or unsharded runs): replicated."""
    spec = sr.P(*([None] * _Draws.dim(host.ndim)), "x") if SHARDED and host.ndim else sr.P()
    return sr.device_put(host, spec, MESH)


def asarray(obj, /, *, dtype=None, device=None, copy=None):
    """Python data or an array as a DArray. A DArray stays as it is unless ``dtype`` asks for a cast or ``copy``
    for a copy (its own block: ``x[i] = v`` on either leaves the other as it was); ``copy=False`` refuses a cast."""
    if isinstance(obj, sr.DArray):
        if dtype is not None and np.dtype(dtype) != obj.dtype:
            if copy is False:
                raise ValueError(f"asarray(copy=False) cannot cast without a copy; got a DArray of {obj.dtype} and "
                                 f"dtype={np.dtype(dtype)}")
            return snp.astype(obj, dtype)
        return sr.DArray(obj.local.copy(), obj.shape, obj.dtype, obj.mesh, obj.sharding, obj.comm) if copy else obj
    return laid_out(np.asarray(obj, dtype=dtype))


_drawn = hypothesis_array_api.ArrayStrategy.do_draw


def _drawn_laid_out(strategy, data):
    """hypothesis's array of this namespace, built on the host by NumPy (flat, its elements read back, reshaped:
    the harness's own steps, not the tests'), then laid out once on a drawn dim of its shape."""
    if strategy.xp.__name__ != __name__:
        return _drawn(strategy, data)
    strategy.xp = np
    try:
        host = _drawn(strategy, data)
    finally:
        strategy.xp = sys.modules[__name__]
    return laid_out(host)


hypothesis_array_api.ArrayStrategy.do_draw = _drawn_laid_out



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
