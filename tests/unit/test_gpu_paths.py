"""GPU code paths without a GPU, and the CuPy backend where there is one.

CI has no GPU, so most tests here run the real backend, runner, interpreter and ``gpu.Transport``
code against ``FakeCupy``: a module installed as ``sys.modules["cupy"]`` whose arrays hold host
memory but behave like CuPy's where it matters to this project:

* they are not NumPy arrays, and refuse to become one implicitly (``np.asarray`` raises, as
  CuPy's "Implicit conversion to a NumPy array is not allowed"); ``.get()`` copies to the host;
* functions and operators refuse NumPy arrays mixed with device arrays (CuPy's "Unsupported type");
* MPI sees them only through ``__cuda_array_interface__`` (what mpi4py reads of a CuPy array);
* reductions return 0-d device arrays, not NumPy scalars.

So a kernel, rule or runner step that lets a host array meet a device array fails here, in CI,
instead of on the first GPU run. ``sr.run`` in the simulated world then covers both transfer
modes end to end: CUDA-aware (device buffers handed to MPI directly) and staged (through pinned
host buffers), chosen by ``SPMD_CUDA_AWARE`` as on a cluster.

The tests at the end use the real CuPy and skip, saying why, where it or a GPU is missing.
``python tests/unit/test_gpu_paths.py`` prints the CuPy-vs-NumPy table of every op case
(scripts/gpu_check.sh runs it on the GPU machine).
"""
from __future__ import annotations

import functools
import os
import sys
import types
import threading
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from numpy.lib.mixins import NDArrayOperatorsMixin

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the case tables

import spmd_runtime as sr  # noqa: E402
import spmd_runtime.numpy as snp  # noqa: E402
from spmd_runtime.comm import run_simulated  # noqa: E402
from spmd_runtime.exec import backend  # noqa: E402
from spmd_runtime.exec.fused import cuda_source  # noqa: E402
from spmd_runtime.exec.groups import sibling_groups  # noqa: E402

# ------------------------------------------------------------------------------------ the fake CuPy

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy "
             "array explicitly.")


class FakeDeviceArray(NDArrayOperatorsMixin):
    """Host memory posing as a CuPy array (see the module docstring for the CuPy rules it keeps)."""

    __array_priority__ = 100  # NumPy's binary operators defer to ours, as they do to CuPy's

    def __init__(self, host: np.ndarray, module: "FakeCupy"):
        self._host, self._module = host, module

    def __getattr__(self, name):
        # Dunders stay unresolved: forwarding __array_interface__ & co. would let NumPy convert silently.
        if name.startswith("__") or name in ("_host", "_module"):
            raise AttributeError(name)
        value = getattr(self._host, name)
        return functools.partial(self._module.call, value) if callable(value) else self._module.wrap(value)

    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return self._module.call(getattr(ufunc, method), *inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return self._module.call(func, *args, **kwargs)

    def __getitem__(self, key):
        return self._module.wrap(self._host[self._module.unwrap(key, allow_host=True)])

    def __setitem__(self, key, value):
        self._host[self._module.unwrap(key, allow_host=True)] = self._module.unwrap(value, allow_host=True)

    def __len__(self):
        return len(self._host)

    def __bool__(self):
        return bool(self._host)

    def __float__(self):
        return float(self._host)

    def __int__(self):
        return int(self._host)

    def __repr__(self):
        return f"FakeDeviceArray({self._host!r})"

    @property
    def __cuda_array_interface__(self) -> dict:
        host = self._host
        return {"shape": host.shape, "typestr": host.dtype.str, "data": (host.ctypes.data, False),
                "strides": None if host.flags.c_contiguous else host.strides, "version": 3, "stream": None}

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        self._module.events.append("d2h")
        if out is None:
            return self._host.copy()
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"get(out=...) needs a NumPy array of shape {self.shape} and dtype {self.dtype}; "
                             f"got {type(out).__name__} {getattr(out, 'shape', None)} {getattr(out, 'dtype', None)}")
        np.copyto(out, self._host)
        return out

    def set(self, arr: np.ndarray, stream=None) -> None:
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set() needs a NumPy array of shape {self.shape} and dtype {self.dtype}; "
                             f"got {type(arr).__name__} {getattr(arr, 'shape', None)} {getattr(arr, 'dtype', None)}")
        self._module.events.append("h2d")
        np.copyto(self._host, arr)


# backend.is_device_array and array_module_of recognise CuPy arrays by their module's name.
FakeDeviceArray.__module__ = "cupy._fake"


class _FakeUfunc:
    """A NumPy ufunc working on device arrays, methods (``at``, ``reduce``, ...) included, as CuPy's do."""

    def __init__(self, ufunc, module):
        self._ufunc, self._module = ufunc, module

    def __call__(self, *args, **kwargs):
        return self._module.call(self._ufunc, *args, **kwargs)

    def __getattr__(self, name):
        return functools.partial(self._module.call, getattr(self._ufunc, name))


class _FakeSubmodule:
    """A NumPy submodule (``cupy.lib.stride_tricks`` mirrors ``numpy.lib.stride_tricks``) over device arrays."""

    def __init__(self, submodule, module):
        self._submodule, self._module = submodule, module

    def __getattr__(self, name):
        return self._module.device_version(getattr(self._submodule, name))


class FakeCupy(types.ModuleType):
    """A module named "cupy": NumPy's functions over ``FakeDeviceArray``, one fake GPU, and the
    ``cuda`` pieces this project calls. ``events`` records syncs, pinned allocations and copies."""

    def __init__(self):
        super().__init__("cupy")
        self.ndarray = FakeDeviceArray
        self.events: list[str] = []  # list.append is atomic: safe from the simulated ranks' threads
        stream = types.SimpleNamespace(synchronize=lambda: self.events.append("sync"))
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
            Device=lambda i=0: types.SimpleNamespace(id=i, use=lambda: self.events.append(f"use{i}")),
            get_current_stream=lambda: stream,
            alloc_pinned_memory=self._alloc_pinned)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.device_version(getattr(np, name))

    def device_version(self, value):
        """NumPy's ``value`` (function, ufunc, submodule such as ``lib.stride_tricks``) over device arrays."""
        if isinstance(value, np.ufunc):
            return _FakeUfunc(value, self)
        if isinstance(value, types.ModuleType):
            return _FakeSubmodule(value, self)
        if callable(value) and not isinstance(value, type):
            return functools.partial(self.call, value)
        return value  # dtypes, constants

    def _alloc_pinned(self, nbytes: int) -> bytearray:
        self.events.append("pin")
        return bytearray(nbytes)

    # -- host <-> device --------------------------------------------------------------------------
    def asarray(self, a, dtype=None, order=None):
        if isinstance(a, FakeDeviceArray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        self.events.append("h2d")
        return FakeDeviceArray(np.array(a, dtype=dtype, copy=True), self)

    array = asarray

    def asnumpy(self, a):
        return a.get() if isinstance(a, FakeDeviceArray) else np.asarray(a)

    def get_array_module(self, *arrays):
        return self if any(isinstance(a, FakeDeviceArray) for a in arrays) else np

    # -- the CuPy rules ---------------------------------------------------------------------------
    def call(self, func, *args, **kwargs):
        return self.wrap(func(*self.unwrap(args), **self.unwrap(kwargs)))

    # -- sorts: CuPy's are always stable (thrust's) and take no other kind ------------------------
    def sort(self, a, axis=-1, kind=None):
        return self._stable(np.sort, a, axis, kind)

    def argsort(self, a, axis=-1, kind=None):
        return self._stable(np.argsort, a, axis, kind)

    def _stable(self, func, a, axis, kind):
        if kind not in (None, "stable"):
            raise NotImplementedError(f"cupy sorts are stable: kind must be None; got {kind!r}")
        return self.call(func, a, axis=axis, kind="stable")

    def unwrap(self, obj, allow_host=False):
        """Host views of device arrays; a NumPy array of rank >= 1 is refused unless ``allow_host``
        (indexing and assignment, where CuPy converts it)."""
        if isinstance(obj, FakeDeviceArray):
            return obj._host
        if isinstance(obj, np.ndarray) and obj.ndim > 0 and not allow_host:
            raise TypeError(f"Unsupported type {type(obj)}: a NumPy array meets device arrays; "
                            f"move it with xp.asarray first (shape {obj.shape})")
        if isinstance(obj, (tuple, list)):
            return _same_kind(obj, [self.unwrap(o, allow_host) for o in obj])
        if isinstance(obj, dict):
            return {k: self.unwrap(v, allow_host) for k, v in obj.items()}
        return obj

    def wrap(self, obj):
        """Device arrays for NumPy results; NumPy scalars become 0-d device arrays, as CuPy returns."""
        if isinstance(obj, (np.ndarray, np.generic)):
            return FakeDeviceArray(np.asarray(obj), self)
        if isinstance(obj, (tuple, list)):
            return _same_kind(obj, [self.wrap(o) for o in obj])
        return obj


def _same_kind(obj, items: list):
    """``items`` in a sequence of ``obj``'s type: a named tuple (NumPy's linalg results) takes them positionally."""
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


@pytest.fixture
def fake_cupy(monkeypatch):
    """``FakeCupy`` installed as ``cupy``, with the backend variables cleared."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for var in ("SPMD_BACKEND", "SPMD_DEVICE", "SPMD_CUDA_AWARE"):
        monkeypatch.delenv(var, raising=False)
    return fake


def test_fake_cupy_keeps_the_cupy_rules(fake_cupy):
    x = fake_cupy.asarray(np.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    s = fake_cupy.sum(x * 2.0)
    assert isinstance(s, FakeDeviceArray) and s.shape == () and float(s) == 30.0
    assert isinstance(x.T, FakeDeviceArray) and backend.is_device_array(x.T) and not isinstance(x, np.ndarray)
    np.testing.assert_array_equal(backend.to_host(x.reshape(3, 2)[1:]), np.arange(2.0, 6.0).reshape(2, 2))
    assert backend.get_array_module("cupy") is fake_cupy and backend.array_module_of(x) is fake_cupy


# ------------------------------------------------------------------------- MPI buffers as MPI sees them


def buffer_kind(buf) -> str:
    if hasattr(buf, "__cuda_array_interface__"):
        return "device"
    return "host" if isinstance(buf, np.ndarray) else type(buf).__name__


class RecordingComm:
    """A simulated communicator that notes, for every MPI buffer call, what kind of buffers it got."""

    def __init__(self, comm, seen: list):
        self._comm, self._seen = comm, seen

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _note(self, call, *buffers):
        self._seen.append((call, tuple(buffer_kind(b) for b in buffers if b is not None)))

    def Split(self, *args, **kwargs):
        return RecordingComm(self._comm.Split(*args, **kwargs), self._seen)

    def Allreduce(self, send, recv, op=MPI.SUM):
        self._note("Allreduce", send, recv)
        self._comm.Allreduce(send, recv, op)

    def Allgather(self, send, recv):
        self._note("Allgather", send, recv)
        self._comm.Allgather(send, recv)

    def Reduce_scatter_block(self, send, recv, op=MPI.SUM):
        self._note("Reduce_scatter_block", send, recv)
        self._comm.Reduce_scatter_block(send, recv, op)

    def Alltoall(self, send, recv):
        self._note("Alltoall", send, recv)
        self._comm.Alltoall(send, recv)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        self._note("Sendrecv", sendbuf, recvbuf)
        self._comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Iallreduce(self, send, recv, op=MPI.SUM):
        self._note("Iallreduce", send, recv)
        return self._comm.Iallreduce(send, recv, op)

    def Iallgather(self, send, recv):
        self._note("Iallgather", send, recv)
        return self._comm.Iallgather(send, recv)

    def Isend(self, buf, dest, tag=0):
        self._note("Isend", buf)
        return self._comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag=0):
        self._note("Irecv", buf)
        return self._comm.Irecv(buf, source, tag)


def run_on_fake_gpus(program, inputs, seen_per_rank=None):
    """``sr.run(..., backend="cupy")`` on every simulated rank; returns each rank's outputs."""
    def body(comm):
        if seen_per_rank is not None:
            comm = RecordingComm(comm, seen_per_rank[comm.Get_rank()])
        return sr.run(program, *inputs, comm=comm, backend="cupy")
    return run_simulated(program.mesh.size, body)


def megatron_mlp(m, x, w1, w2):
    h = m.tanh(x @ w1)
    return m.sum(h @ w2, axis=0), m.transpose(h)


# Uneven sizes (10, 7, 6, 5 over 2 or 3 shards): padding and masking run on device arrays too.
MLP_SHAPES = ((10, 7), (7, 6), (6, 5))
MLP_MESHES = [(sr.Mesh((2, 2), ("x", "y")), [("x", None), (None, "y"), ("y", None)]),
              (sr.Mesh((3,), ("x",)), [(None, "x"), ("x", None), (None, None)])]


def mlp_program(mesh, specs):
    inputs = [np.random.default_rng(i).standard_normal(s) for i, s in enumerate(MLP_SHAPES)]
    graph = sr.trace(lambda *a: megatron_mlp(snp, *a), *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = sr.partition(graph, mesh, in_specs=specs)
    return graph, program, inputs


@pytest.mark.parametrize("mesh, specs", MLP_MESHES, ids=lambda p: str(p) if isinstance(p, sr.Mesh) else "")
@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_run_on_device_arrays(fake_cupy, monkeypatch, mesh, specs, cuda_aware):
    monkeypatch.setenv("SPMD_CUDA_AWARE", "1" if cuda_aware else "0")
    graph, program, inputs = mlp_program(mesh, specs)
    seen = [[] for _ in range(mesh.size)]
    outs = run_on_fake_gpus(program, inputs, seen)
    expected = sr.evaluate(graph, *inputs)
    assert {"all_reduce"} <= set(program.collectives())  # the contraction over a split dim sums partials
    for rank, got in enumerate(outs):
        for g, e in zip(got, expected):
            assert backend.is_device_array(g), f"rank {rank} returned {type(g).__name__}, not a device array"
            np.testing.assert_allclose(backend.to_host(g), e, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    calls = [kinds for rank_calls in seen for _, kinds in rank_calls]
    assert calls, "the program moved no data through MPI"
    # CUDA-aware MPI gets the device buffers themselves; any other MPI only pinned host copies.
    assert {k for kinds in calls for k in kinds} == ({"device"} if cuda_aware else {"host"})
    assert fake_cupy.events.count("sync") >= len(calls)  # kernels finish before MPI reads their output
    assert ("pin" in fake_cupy.events) == (not cuda_aware)
    assert fake_cupy.events.count("use0") == mesh.size  # each rank bound its GPU once


def test_staged_run_reuses_pinned_buffers(fake_cupy, monkeypatch):
    monkeypatch.setenv("SPMD_CUDA_AWARE", "0")
    mesh, specs = MLP_MESHES[0]
    graph, program, inputs = mlp_program(mesh, specs)

    pins_after_first_run = []

    def body(comm):
        outs = sr.run(program, *inputs, comm=comm, backend="cupy")
        comm.Barrier()  # every rank finished run 1 ...
        if comm.Get_rank() == 0:
            pins_after_first_run.append(fake_cupy.events.count("pin"))
        comm.Barrier()  # ... before any starts run 2
        return [outs] + [sr.run(program, *inputs, comm=comm, backend="cupy") for _ in range(2)]
    runs = run_simulated(mesh.size, body)
    assert pins_after_first_run[0] >= mesh.size  # every rank staged something
    assert fake_cupy.events.count("pin") == pins_after_first_run[0], "later runs pinned new host buffers"
    expected = sr.evaluate(graph, *inputs)
    for got in runs[-1][-1]:
        assert backend.is_device_array(got)
    np.testing.assert_allclose(backend.to_host(runs[-1][-1][0]), expected[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "scheduled"])
def test_an_all_reduced_output_survives_the_next_run(fake_cupy, monkeypatch, overlap):
    """On device arrays an all-reduce into its dying operand cannot run in place (MPI.IN_PLACE is the host path):
    its result is then a fresh buffer, never a kept receive buffer that the next run would overwrite."""
    monkeypatch.setenv("SPMD_CUDA_AWARE", "0")
    graph = sr.trace(lambda a, w: (a.sum(0), snp.exp(w)), sr.TensorSpec((8, 3), "float64"),
                     sr.TensorSpec((4,), "float64"))
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), None], overlap=overlap)
    reduce = next(i for i in program.instrs if i.op in ("all_reduce", "all_reduce_done"))
    assert reduce.op == ("all_reduce_done" if overlap else "all_reduce") and reduce.donate >= 0

    def body(comm):
        first = sr.run(program, np.ones((8, 3)), np.zeros(4), comm=comm, backend="cupy")[0]
        sr.run(program, np.full((8, 3), 2.0), np.zeros(4), comm=comm, backend="cupy")
        return backend.to_host(first)
    for got in run_simulated(2, body):
        np.testing.assert_array_equal(got, np.full(3, 8.0))


def test_run_local_keeps_device_blocks(fake_cupy, monkeypatch):
    monkeypatch.setenv("SPMD_CUDA_AWARE", "0")
    mesh = sr.Mesh((2,), ("x",))
    x = np.arange(10 * 3, dtype=np.float64).reshape(10, 3)
    program = sr.partition(sr.trace(lambda a: snp.tanh(a) * 2.0, x), mesh, in_specs=[("x", None)])
    outs = run_simulated(2, lambda comm: sr.run_local(program, x[comm.Get_rank() * 5:][:5], comm=comm,
                                                      backend="cupy"))
    for rank, (out,) in enumerate(outs):
        assert backend.is_device_array(out)
        np.testing.assert_allclose(backend.to_host(out), np.tanh(x[rank * 5:][:5]) * 2.0, rtol=1e-12)


# ------------------------------------------------------------------ every op case on device arrays


def op_case_table():
    """Every op case of tests/op_cases.py and its family tables."""
    import op_cases
    return op_cases.all_cases() if hasattr(op_cases, "all_cases") else list(op_cases.CASES)


def _case_params():
    return [pytest.param(c, s, id=f"{c.name}-spec{i}") for c in op_case_table() for i, s in enumerate(c.specs)]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log(0) cases: NumPy warns, CuPy does not
@pytest.mark.parametrize("case, specs", _case_params())
def test_every_op_case_runs_on_device_arrays(fake_cupy, monkeypatch, case, specs):
    from op_cases import partition_case, tolerance
    monkeypatch.setenv("SPMD_CUDA_AWARE", "0")
    graph, program, args, expected = partition_case(case, specs, sr.Mesh((2, 2), ("x", "y")))
    got = run_on_fake_gpus(program, args)[3]  # the last rank: its shards are the padded ones
    tol = tolerance(case.dtype)
    for g, e in zip(got, expected):
        assert backend.is_device_array(g)
        np.testing.assert_allclose(backend.to_host(g), e, rtol=tol, atol=tol)


# --------------------------------------------------------- numerics: a device module against NumPy

NUMERIC_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want| over entries that differ (equal infinities and NaN pairs count as equal)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    with np.errstate(invalid="ignore"):  # inf - inf where they differ in sign: still counted, as nan
        return float(np.max(np.abs(g - w)[~same], initial=0.0))


def op_case_diffs(xp, dtypes=("float32", "float64")):
    """(case, dtype, max abs diff, tolerance, ok) for every op case evaluated with ``xp`` against NumPy.

    Float cases run once per dtype in ``dtypes`` (inputs cast, graph traced anew); integer cases in
    their own dtype, where the results must be equal. ok: ``np.allclose`` within the tolerance.
    """
    from op_cases import make_inputs
    rows = []
    for case in op_case_table():
        for dtype in (dtypes if case.dtype.startswith("float") else (case.dtype,)):
            inputs = [x.astype(dtype) for x in make_inputs(case)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = sr.trace(lambda *a, fn=case.fn: fn(snp, *a), *inputs)
                want = sr.evaluate(graph, *inputs)
                got = [backend.to_host(o) for o in sr.evaluate(graph, *inputs, xp=xp)]
            tol = NUMERIC_TOLERANCE.get(dtype, 0.0)
            diff = max(max_abs_diff(g, w) for g, w in zip(got, want))
            ok = all(g.shape == w.shape and g.dtype == w.dtype
                     and np.allclose(g, w, rtol=tol, atol=tol, equal_nan=True) for g, w in zip(got, want))
            rows.append((case.name, dtype, diff, tol, ok))
    return rows


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_op_case_numerics_on_the_fake_device(fake_cupy, monkeypatch):
    from spmd_runtime.ops import core
    # The same NumPy kernels underneath: exact, scatter_add included (NumPy adds each repeat in index order as
    # a device does, ops/gather._add_sorted), once the host's BLAS row sums (ops/core._row_sums, a NumPy-only
    # speed-up with its own test) are off.
    monkeypatch.setattr(core, "MAX_BLAS_ROW", 0)
    rows = op_case_diffs(fake_cupy)
    assert {dtype for _, dtype, *_ in rows} >= {"float32", "float64"}
    bad = [r for r in rows if not r[4] or r[2] != 0.0]
    assert not bad, bad


# ------------------------------------------------------------------------- the real CuPy, where present


@pytest.fixture
def cupy(monkeypatch):
    """The real cupy with a GPU, or a skip that says which is missing."""
    cp = pytest.importorskip("cupy", reason="cupy is not installed (pip install spmd_runtime[gpu]): "
                                            "the CuPy backend tests need it and a GPU")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver or device
        pytest.skip(f"cupy is installed but CUDA reports no GPU: {type(e).__name__}: {e}")
    if count < 1:
        pytest.skip("cupy is installed but no GPU is visible")
    for var in ("SPMD_BACKEND", "SPMD_CUDA_AWARE"):
        monkeypatch.delenv(var, raising=False)
    return cp


def test_cupy_matches_numpy_on_every_op_case(cupy):
    bad = [r for r in op_case_diffs(cupy) if not r[4]]
    assert not bad, "\n".join(f"{name} {dtype}: max abs diff {diff:.3e} > {tol:.0e}" for name, dtype, diff, tol, _
                              in bad)


def test_cupy_staged_run_in_the_simulated_world(cupy, monkeypatch):
    # The simulated communicator reads buffers on the host: only the staged path suits a real GPU here.
    monkeypatch.setenv("SPMD_CUDA_AWARE", "0")
    mesh, specs = MLP_MESHES[0]
    graph, program, inputs = mlp_program(mesh, specs)
    outs = run_simulated(mesh.size, lambda comm: sr.run(program, *inputs, comm=comm, backend="cupy"))
    for rank, got in enumerate(outs):
        for g, e in zip(got, sr.evaluate(graph, *inputs)):
            assert isinstance(g, cupy.ndarray), f"rank {rank} returned {type(g).__name__}"
            np.testing.assert_allclose(g.get(), e, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cupy_generated_kernels_match_numpy(cupy, dtype):
    """The generated CUDA kernels on the real GPU (the fake GPU compiles the same source with g++): fused
    chains, a sibling group (AdamW), fused sum/max/min reductions over rows with -inf, +inf and NaN."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 5, 6)).astype(dtype)
    x[0, 0, :], x[1, 0, :] = -np.inf, np.inf
    x[0, 1, 0], x[0, 2, -1] = np.nan, np.nan
    reductions = sr.trace(lambda a: (snp.sum(snp.exp(a * 0.5) * 2.0, axis=-1), snp.max(a * 2.0, axis=-1),
                                     snp.min(a - 1.0, axis=-1)), x)
    adam = [rng.standard_normal((6, 4)).astype(dtype) for _ in range(4)]
    update = sr.trace(adamw_update, *adam)
    for graph, inputs in ((reductions, [x]), (update, adam)):
        program = sr.partition(graph, sr.Mesh((1,), ("x",)))
        got = run_simulated(1, lambda comm: sr.run(program, *inputs, comm=comm, backend="cupy"))[0]
        with np.errstate(invalid="ignore", over="ignore"):
            want = sr.evaluate(graph, *inputs)
        for g, w in zip(got, want):
            assert isinstance(g, cupy.ndarray)
            np.testing.assert_allclose(g.get(), w, rtol=2e-6 if dtype == "float32" else 1e-12, equal_nan=True)


def test_cupy_device_ops_stage_through_pinned_memory(cupy):
    from spmd_runtime.comm.gpu import CupyDeviceOps, Transport
    transport = Transport(cuda_aware=False, device_ops=CupyDeviceOps())
    x = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    recv = cupy.empty_like(x)
    transport.run(lambda s, r: np.copyto(r, s * 2), x, recv)  # an "MPI call" on the host buffers
    np.testing.assert_array_equal(recv.get(), np.arange(12, dtype=np.float32).reshape(3, 4) * 2)
    host = transport.pinned("send", (3, 4), np.float32)
    assert cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data).type == 1  # cudaMemoryTypeHost: page-locked


# ------------------------------------------------------------- the table scripts/gpu_check.sh prints


def print_numerics_table(xp) -> int:
    """Print every op case's max abs diff, ``xp`` against NumPy; returns the number of failures."""
    rows = op_case_diffs(xp)
    print(f"{'case':<28}{'dtype':<9}{'max abs diff':>14}{'tolerance':>11}  ok")
    for name, dtype, diff, tol, ok in rows:
        print(f"{name:<28}{dtype:<9}{diff:>14.3e}{tol:>11.0e}  {'yes' if ok else 'NO'}")
    failed = sum(not r[4] for r in rows)
    print(f"# {backend.backend_name(xp)} vs numpy: {len(rows) - failed} of {len(rows)} case/dtype pairs within "
          f"tolerance, worst diff {max(r[2] for r in rows):.3e}")
    return failed


if __name__ == "__main__":
    sys.exit(1 if print_numerics_table(backend.get_array_module(os.environ.get("SPMD_BACKEND") or "cupy")) else 0)


# ------------------------------------------------------------------------ fused kernels (ElementwiseKernel)
class HostElementwiseKernel:
    """``cupy.ElementwiseKernel`` for the fake GPU: the generated operation compiled by the host C++ compiler
    into a loop over broadcast operands, so the CUDA source itself (types, casts, literals, NaN rules) runs."""

    _C = {"float32": "float", "float64": "double", "bool": "bool", "int32": "int", "int64": "long long"}
    _built: dict = {}  # source -> compiled function
    _lock = threading.Lock()  # simulated ranks are threads: one builds, the others wait (no half-written .so)

    def __init__(self, fake, in_params, out_params, operation, name, tmp_path, preamble=""):
        import ctypes
        import subprocess
        fake.events.append("compile")
        self.fake, self.params = fake, [p.split() for p in in_params.split(", ")]
        outs = [p.split() for p in out_params.split(", ")]  # one, or several (a sibling group's kernel)
        self.out_dtypes = [np.dtype(d) for d, _ in outs]
        args = ", ".join([f"const {self._C[d]}* {n}_" for d, n in self.params]
                         + [f"{self._C[d]}* {n}_" for d, n in outs])
        loads = " ".join(f"const {self._C[d]} {n} = {n}_[i];" for d, n in self.params)
        results = " ".join(f"{self._C[d]} {n};" for d, n in outs)
        stores = " ".join(f"{n}_[i] = {n};" for _, n in outs)
        source = (f"#include <cmath>\nusing namespace std;\n#define __device__\n{preamble}\n"
                  f"extern \"C\" void {name}({args}, long n) {{ for (long i = 0; i < n; ++i) {{ {loads} {results}\n"
                  f"{operation}\n{stores} }} }}\n")
        with self._lock:
            if source not in self._built:  # every rank generates the same source: build it once
                stem = tmp_path / f"{name}_{len(self._built)}"
                stem.with_suffix(".cpp").write_text(source)
                subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(stem.with_suffix(".so")),
                                str(stem.with_suffix(".cpp"))], check=True)
                self._built[source] = getattr(ctypes.CDLL(str(stem.with_suffix(".so"))), name)
            self.fn = self._built[source]

    def __call__(self, *args):
        arrays = [self.fake.unwrap(a) for a in args]
        ins, outs = arrays[:len(self.params)], arrays[len(self.params):]
        assert [o.dtype for o in outs] == self.out_dtypes and all(o.flags.c_contiguous for o in outs)
        assert len({o.shape for o in outs}) == 1
        flat = [np.ascontiguousarray(np.broadcast_to(a, outs[0].shape), np.dtype(d))
                for a, (d, _) in zip(ins, self.params)]
        import ctypes
        self.fn(*[a.ctypes.data_as(ctypes.c_void_p) for a in flat + outs], ctypes.c_long(outs[0].size))
        return args[-1] if len(outs) == 1 else tuple(args[len(self.params):])


class HostReductionKernel:
    """``cupy.ReductionKernel`` for the fake GPU, for the reductions the runtime generates: the map expression
    (and its preamble) compiled by the host g++ into a loop writing each element's mapped value in double, then
    a second generated loop folding each output's elements with ``reduce_expr`` from ``identity`` in
    ``reduce_type`` (the kernel's own strings, CUDA's -inf/+inf intrinsics given host definitions), cast to
    the output type."""

    _folds: dict = {}  # source -> compiled fold
    _HOST_INTRINSICS = (
        "#include <cstring>\n"
        "static inline float __int_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }\n"
        "static inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }\n")

    def __init__(self, fake, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name,
                 tmp_path, reduce_type=None, preamble=""):
        import ctypes
        import subprocess
        (self.out_dtype, _), = [p.split() for p in out_params.split(", ")]
        self.fake = fake
        fake.events.append("reduction kernel")
        self.mapped = HostElementwiseKernel(fake, in_params, "float64 out", f"out = (double){map_expr};", name,
                                            tmp_path, preamble)
        source = (f"{self._HOST_INTRINSICS}typedef {reduce_type} T;\n#define REDUCE(a, b) ({reduce_expr})\n"
                  f"extern \"C\" void fold(const double* x, double* out, long rows, long n) {{\n"
                  f"  for (long r = 0; r < rows; ++r) {{ T a = (T)({identity});\n"
                  f"    for (long j = 0; j < n; ++j) {{ const T b = (T)x[r * n + j]; a = REDUCE(a, b); }}\n"
                  f"    out[r] = (double)a; }} }}\n")
        with HostElementwiseKernel._lock:  # simulated ranks are threads: one builds, the others wait
            if source not in self._folds:
                stem = tmp_path / f"{name}_fold_{len(self._folds)}"
                stem.with_suffix(".cpp").write_text(source)
                subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(stem.with_suffix(".so")),
                                str(stem.with_suffix(".cpp"))], check=True)
                self._folds[source] = ctypes.CDLL(str(stem.with_suffix(".so"))).fold
            self.fold = self._folds[source]

    def __call__(self, *args, axis):
        import ctypes
        ins = [self.fake.unwrap(a) for a in args]
        shape = np.broadcast_shapes(*[a.shape for a in ins])
        mapped = self.fake.asarray(np.empty(shape))
        self.mapped(*args, mapped)
        axes = tuple(a % len(shape) for a in np.atleast_1d(axis))
        kept = [d for d in range(len(shape)) if d not in axes]
        rows = np.ascontiguousarray(np.transpose(self.fake.unwrap(mapped), kept + list(axes)))
        n = int(np.prod([shape[d] for d in axes]))
        out = np.empty(rows.size // max(n, 1))
        self.fold(rows.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                  ctypes.c_long(out.size), ctypes.c_long(n))
        return self.fake.asarray(out.reshape([shape[d] for d in kept]).astype(self.out_dtype))


@pytest.fixture
def host_kernels(fake_cupy, monkeypatch, tmp_path):
    """The fake GPU's ElementwiseKernel and ReductionKernel: the generated CUDA code compiled by the host g++."""
    import shutil
    if shutil.which("g++") is None:
        pytest.skip("the fake ElementwiseKernel compiles the generated CUDA body with the host g++; none here")
    monkeypatch.setattr(fake_cupy, "ElementwiseKernel",
                        lambda *a, **k: HostElementwiseKernel(fake_cupy, *a, tmp_path, **k), raising=False)
    monkeypatch.setattr(fake_cupy, "ReductionKernel",
                        lambda *a, **k: HostReductionKernel(fake_cupy, *a, tmp_path=tmp_path, **k), raising=False)


def fused_case(m, x, w, b):
    h = x @ w
    return m.where(h > 0.0, m.tanh(h * 0.5 + b), m.maximum(h, -0.25) * 2.0), m.exp(-(x * x))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_instructions_run_as_generated_elementwise_kernels(fake_cupy, host_kernels, dtype):
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype(dtype) for s in ((6, 5), (5, 4), (4,))]
    inputs[0][0, 0] = np.nan  # through maximum: NaN must propagate as in NumPy
    graph = sr.trace(lambda *a: fused_case(snp, *a), *inputs)
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), (None, None), (None,)])
    n_fusions = sum(i.op == "fusion" for i in program.instrs)
    assert n_fusions >= 2
    def twice(comm):  # one world, two runs: the second reuses the bound program
        first = sr.run(program, *inputs, comm=comm, backend="cupy")
        compiled = fake_cupy.events.count("compile")
        return [first, sr.run(program, *inputs, comm=comm, backend="cupy")], compiled

    results = run_simulated(program.mesh.size, twice)
    # one kernel per fused instruction and rank, made while binding; none made by a second run
    assert fake_cupy.events.count("compile") == n_fusions * program.mesh.size
    assert all(compiled <= n_fusions * program.mesh.size for _, compiled in results)
    expected = sr.evaluate(graph, *inputs)
    for outs in [o for runs, _ in results for o in runs]:
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(backend.to_host(got), want, rtol=2e-6 if dtype == "float32" else 1e-12,
                                       atol=1e-7 if dtype == "float32" else 1e-14)


def adamw_update(p, g, m, v):
    """AdamW's shape: the new moments are results and feed the new parameter (exec/groups.py's sibling group)."""
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g * g
    return p - 0.01 * (m2 / (snp.sqrt(v2) + 1e-8) + 0.1 * p), m2, v2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_sibling_group_runs_as_one_elementwise_kernel_with_an_output_per_member(fake_cupy, host_kernels, dtype):
    inputs = [np.random.default_rng(5).standard_normal((6, 4)).astype(dtype) for _ in range(4)]
    graph = sr.trace(adamw_update, *inputs)
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None)] * 4)
    (group,) = sibling_groups(program).values()
    assert len(group.members) == 3 and sum(i.op == "fusion" for i in program.instrs) == 3
    _, out_params, operation = cuda_source(group.fusion, group.dtypes, group.results)
    assert out_params == f"{dtype} out0, {dtype} out1, {dtype} out2" and operation.count(" = t") == 3
    results = run_simulated(2, lambda comm: sr.run(program, *inputs, comm=comm, backend="cupy"))
    assert fake_cupy.events.count("compile") == 2  # one kernel per rank for the three fusions
    expected = sr.evaluate(graph, *inputs)
    for outs in results:
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(backend.to_host(got), want, rtol=2e-6 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_abs_clears_the_sign_of_negative_zero_as_numpy(fake_cupy, host_kernels, dtype):
    """abs(-0.0) is +0.0 in NumPy; a generated kernel's ``x < 0 ? -x : x`` kept -0.0 (seen through + -0.0)."""
    x = np.array([-0.0, 0.0, -1.5, np.nan, -np.inf, 2.0], dtype)
    graph = sr.trace(lambda a, b: snp.abs(a) + b, x, np.full_like(x, -0.0))
    program = sr.partition(graph, sr.Mesh((1,), ("x",)))
    assert [i.op for i in program.instrs if i.op == "fusion"] == ["fusion"]
    got = run_simulated(1, lambda comm: sr.run(program, x, np.full_like(x, -0.0), comm=comm, backend="cupy"))[0][0]
    want = np.abs(x) + np.full_like(x, -0.0)
    np.testing.assert_array_equal(np.signbit(backend.to_host(got)), np.signbit(want))
    np.testing.assert_array_equal(backend.to_host(got), want)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_scheduled_collectives_overlap_on_device_arrays(fake_cupy, monkeypatch, cuda_aware):
    """A program's start/done pairs on device arrays post MPI's nonblocking calls at the start (on the device
    buffers, or on pinned host copies) and the done completes them: the GPU computes in between."""
    from windowed_cases import windowed_program
    monkeypatch.setenv("SPMD_CUDA_AWARE", "1" if cuda_aware else "0")
    graph, inputs, program = windowed_program("gather_kept", sr.Mesh((3,), ("x",)), ("x",), 7)
    starts = [i for i in program.instrs if i.op.endswith("_start")]
    seen = [[] for _ in range(3)]
    outs = run_on_fake_gpus(program, inputs, seen)
    want = sr.evaluate(graph, *inputs)[0]
    for got in outs:
        np.testing.assert_allclose(backend.to_host(got[0]), want, rtol=1e-12, atol=1e-12)
    posted = [kinds for rank_calls in seen for call, kinds in rank_calls if call.startswith("I")]
    assert starts and len(posted) >= len(starts), "the starts did not post nonblocking MPI calls"
    assert {k for kinds in posted for k in kinds} == ({"device"} if cuda_aware else {"host"})


@pytest.mark.parametrize("pattern", ["gather_kept", "gather_contracted", "reduce_scatter"])
@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_windowed_einsum_rings_run_on_device_arrays(fake_cupy, monkeypatch, pattern, cuda_aware):
    """A ring's permutes, shifted slices and rotated joins on device arrays, uneven blocks (7 over 3)."""
    from windowed_cases import windowed_program
    monkeypatch.setenv("SPMD_CUDA_AWARE", "1" if cuda_aware else "0")
    graph, inputs, program = windowed_program(pattern, sr.Mesh((3,), ("x",)), ("x",), 7)
    assert "collective_permute_start" in str(program)
    outs = run_on_fake_gpus(program, inputs, [[] for _ in range(3)])
    want = sr.evaluate(graph, *inputs)[0]
    for got in outs:
        assert backend.is_device_array(got[0])
        np.testing.assert_allclose(backend.to_host(got[0]), want, rtol=1e-12, atol=1e-12)


def test_fused_reductions_run_on_device_arrays(fake_cupy, host_kernels):
    """A fused_reduce on the fake GPU: a sum and a max each as one generated ReductionKernel (the chain as its
    map), nothing else compiled."""
    x = np.random.default_rng(0).standard_normal((4, 6, 40))
    graph = sr.trace(lambda a: (snp.sum(snp.exp(a) * 2.0, axis=-1), snp.max(-a, axis=(1, 2))), x)
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None, None)])
    assert [i.attrs["kind"] for i in program.instrs if i.op == "fused_reduce"] == ["sum", "max"]
    outs = run_on_fake_gpus(program, [x], [[] for _ in range(2)])
    for got in outs:
        for g, want in zip(got, sr.evaluate(graph, x)):
            assert backend.is_device_array(g)
            np.testing.assert_allclose(backend.to_host(g), want, rtol=1e-12, atol=1e-12)
    assert fake_cupy.events.count("compile") == 2 * 2  # per rank: the sum's map, the max's map
    assert fake_cupy.events.count("reduction kernel") == 2 * 2  # per rank: the sum and the max, one kernel each


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_max_and_min_kernels_keep_nan_and_infinities_as_numpy(fake_cupy, host_kernels, dtype):
    """The generated max/min ReductionKernels start from -inf/+inf and keep a NaN from either side, as
    np.max/np.min: rows of all -inf, a NaN first or last, a row of +inf."""
    x = np.random.default_rng(1).standard_normal((4, 5, 6)).astype(dtype)
    x[0, 0, :] = -np.inf
    x[0, 1, 0], x[0, 2, -1] = np.nan, np.nan
    x[1, 0, :] = np.inf
    graph = sr.trace(lambda a: (snp.max(a * 2.0, axis=-1), snp.min(a - 1.0, axis=-1)), x)
    program = sr.partition(graph, sr.Mesh((1,), ("x",)))
    assert sorted(i.attrs["kind"] for i in program.instrs if i.op == "fused_reduce") == ["max", "min"]
    got = run_simulated(1, lambda comm: sr.run(program, x, comm=comm, backend="cupy"))[0]
    with np.errstate(invalid="ignore"):
        want = sr.evaluate(graph, x)
    assert fake_cupy.events.count("reduction kernel") == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(backend.to_host(g), w)


# The elementwise math of ops/core.py through the generated CUDA (exec/backends/cupy.py: _c_expr and its device
# functions): each op's result times 1 is a fused chain, so every op runs as generated code, on special values.
FLOAT_MATH = [snp.sin, snp.cos, snp.tan, snp.arcsin, snp.arccos, snp.arctan, snp.sinh, snp.cosh, snp.arcsinh,
              snp.arccosh, snp.arctanh, snp.log1p, snp.expm1, snp.log2, snp.log10, snp.exp2, snp.cbrt, snp.reciprocal,
              snp.floor, snp.ceil, snp.trunc, snp.rint, snp.sign, lambda a: snp.where(snp.signbit(a), 1.0, 0.0),
              lambda a: snp.where(snp.isnan(a), 1.0, 0.0), lambda a: snp.where(snp.isinf(a), 1.0, 0.0),
              lambda a: snp.where(snp.isfinite(a), 1.0, 0.0)]
FLOAT_MATH2 = [snp.arctan2, snp.logaddexp, snp.copysign, snp.hypot, snp.floor_divide, snp.remainder, snp.fmod,
               snp.fmax, snp.fmin, snp.heaviside]
INT_MATH2 = [snp.floor_divide, snp.remainder, snp.fmod, snp.bitwise_and, snp.bitwise_or, snp.bitwise_xor,
             lambda a, b: ~a, lambda a, b: a << b, lambda a, b: a >> b, lambda a, b: snp.sign(a) + snp.fmax(a, b),
             lambda a, b: snp.fmin(a, b), lambda a, b: snp.where(snp.signbit(a) | snp.isnan(b), 1, 0)]


def _math_chains(ops, *args):
    return tuple(op(*args) * 1 for op in ops)


@pytest.mark.parametrize("dtype", ["float32", "int32"])  # float64, int64: the same templates and calls in double
def test_fused_elementwise_math_gives_numpys_values_as_generated_kernels(fake_cupy, host_kernels, dtype):
    if dtype.startswith("float"):
        x = np.array([0.5, -0.5, 0.0, -0.0, 2.5, -7.5, np.inf, -np.inf, np.nan, 3.0, 1e-3, -1.0], dtype)
        y = np.array([2.0, 2.0, -3.0, 0.0, -2.0, 2.0, 1.0, np.inf, 1.0, 0.0, -0.0, -1.0], dtype)
        fn = lambda a, b: _math_chains(FLOAT_MATH, a) + _math_chains(FLOAT_MATH2, a, b)
    else:
        x = np.array([7, -7, 7, -7, 5, -5, 0, 1, -1, 12, 3, -128], dtype)
        y = np.array([2, 2, -2, -2, 0, 0, 3, 40, 70, 2, 31, 1], dtype)
        fn = lambda a, b: _math_chains(INT_MATH2, a, b)
    graph = sr.trace(fn, x, y)
    program = sr.partition(graph, sr.Mesh((1,), ("x",)))
    assert sum(i.op == "fusion" for i in program.instrs) == len(graph.outputs)
    with np.errstate(all="ignore"):
        got = run_simulated(1, lambda comm: sr.run(program, x, y, comm=comm, backend="cupy"))[0]
        want = sr.evaluate(graph, x, y)
    assert fake_cupy.events.count("compile") == len(graph.outputs)
    for k, (g, w) in enumerate(zip(got, want)):
        g = backend.to_host(g)
        assert g.dtype == w.dtype, k
        np.testing.assert_allclose(g, w, rtol=4e-7 if dtype == "float32" else 1e-15, atol=0, err_msg=f"output {k}")
        signed = ~np.isnan(w)  # a NaN's sign bit means nothing
        np.testing.assert_array_equal(np.signbit(g[signed]), np.signbit(w[signed]), err_msg=f"the sign of output {k}")
