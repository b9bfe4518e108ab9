"""Backend selection (spmd_runtime.exec.backend) without needing a GPU.

cupy is simulated: ``sys.modules['cupy'] = None`` makes ``import cupy`` fail
as if it were not installed, and a small fake module stands in for an
installed cupy with 0, 2 or broken GPUs. The real-cupy class at the end runs
only where cupy and a GPU are present.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from spmd_runtime import devices
from spmd_runtime.comm.testing import HostDeviceArray
from spmd_runtime.exec import backend as bk, backends


# --------------------------------------------------------------- helpers
class _FakeCudaRuntimeError(RuntimeError):
    pass


def _fake_cupy(ndev: int | None) -> types.ModuleType:
    """A stand-in cupy module with ``ndev`` GPUs (None: the CUDA runtime errors)."""
    mod = types.ModuleType("cupy")
    used: list[int] = []

    def get_device_count():
        if ndev is None:
            raise _FakeCudaRuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return ndev

    class Device:
        def __init__(self, i):
            self.id = i

        def use(self):
            used.append(self.id)

    mod.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count), Device=Device)
    mod.asarray = lambda x: ("on-device", np.asarray(x))
    mod.used = used
    return mod


class _FakeComm:
    """Enough of an mpi4py communicator for select_device: node-local rank."""

    def __init__(self, local_rank):
        self.local_rank = local_rank
        self.split_args = None
        self.freed = False

    def Get_rank(self):
        return 100 + self.local_rank

    def Split_type(self, split_type, key=0):
        self.split_args = (split_type, key)
        parent = self

        class _Local:
            def Get_rank(self):
                return parent.local_rank

            def Free(self):
                parent.freed = True

        return _Local()


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("SPMD_BACKEND", "SPMD_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def no_cupy(clean_env):
    clean_env.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    return clean_env


@pytest.fixture
def fake_mpi(monkeypatch):
    """A fake mpi4py.MPI so select_device never initialises real MPI here."""
    mpi = types.SimpleNamespace(COMM_TYPE_SHARED="COMM_TYPE_SHARED")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return mpi


def _install_cupy(monkeypatch, ndev):
    fake = _fake_cupy(ndev)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


# ------------------------------------------------------- get_array_module
def test_default_is_numpy_without_cupy(no_cupy):
    assert bk.get_array_module() is np
    assert bk.get_array_module(None) is np
    assert bk.get_array_module("auto") is np
    assert bk.gpu_available() is False


def test_a_failed_cupy_import_is_tried_once_per_process(monkeypatch):
    """Every run resolves its backend; a cupy that failed to import is not searched for again (each retry
    walks sys.path), and one placed in sys.modules afterwards is taken."""
    monkeypatch.setattr(devices, "_FAILED", [])
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    tries, real_import = [], __import__

    def counting_import(name, *args, **kwargs):
        if name == "cupy":
            tries.append(name)
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr("builtins.__import__", counting_import)
    for _ in range(3):
        assert bk.get_array_module("auto") is np
        with pytest.raises(RuntimeError, match="needs the cupy package .* No module named 'cupy'"):
            devices.import_cupy()
    assert tries == ["cupy"]
    fake = _install_cupy(monkeypatch, 2)
    assert devices.import_cupy() is fake


def test_explicit_numpy_ignores_env(clean_env):
    clean_env.setenv("SPMD_BACKEND", "cupy")
    assert bk.get_array_module("numpy") is np
    assert bk.get_array_module(" NumPy ") is np


@pytest.mark.parametrize("value", ["numpy", "NUMPY", " numpy ", "auto", ""])
def test_env_numpy_or_auto(no_cupy, value):
    no_cupy.setenv("SPMD_BACKEND", value)
    assert bk.get_array_module() is np


def test_env_numpy_wins_over_available_gpu(clean_env):
    _install_cupy(clean_env, 2)
    clean_env.setenv("SPMD_BACKEND", "numpy")
    assert bk.get_array_module() is np


def test_unknown_backend_is_value_error(clean_env):
    with pytest.raises(ValueError, match="unknown array backend 'torch'"):
        bk.get_array_module("torch")
    clean_env.setenv("SPMD_BACKEND", "jax")
    with pytest.raises(ValueError, match="SPMD_BACKEND"):
        bk.get_array_module()


def test_cupy_missing_gives_clear_error(no_cupy):
    with pytest.raises(RuntimeError) as info:
        bk.get_array_module("cupy")
    msg = str(info.value)
    assert "backend 'cupy' needs the cupy package" in msg
    assert "pip install spmd_runtime[gpu]" in msg
    assert "ImportError" in msg


def test_cupy_from_env_missing_gives_clear_error(no_cupy):
    no_cupy.setenv("SPMD_BACKEND", "cupy")
    with pytest.raises(RuntimeError, match=r"needs the cupy package \(pip install spmd_runtime\[gpu\]\)"):
        bk.get_array_module()


@pytest.mark.parametrize("ndev", [0, None], ids=["zero-gpus", "cuda-error"])
def test_cupy_without_gpu(clean_env, ndev):
    _install_cupy(clean_env, ndev)
    assert bk.get_array_module() is np  # auto falls back quietly
    assert bk.gpu_available() is False
    with pytest.raises(RuntimeError, match="needs a visible CUDA GPU"):
        bk.get_array_module("cupy")


def test_zero_gpus_error_mentions_cuda_visible_devices(clean_env):
    _install_cupy(clean_env, 0)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=''"):
        bk.get_array_module("cupy")


def test_auto_picks_cupy_with_gpu(clean_env):
    fake = _install_cupy(clean_env, 2)
    assert bk.get_array_module() is fake
    assert bk.get_array_module("cupy") is fake
    assert bk.backend_name(fake) == "cupy"
    assert bk.backend_name(np) == "numpy"
    assert bk.gpu_available() is True


# ---------------------------------------------------------- select_device
def test_select_device_uses_node_local_rank(clean_env, fake_mpi):
    fake = _install_cupy(clean_env, 2)
    comm = _FakeComm(local_rank=3)
    assert bk.select_device(comm) == 1  # 3 % 2
    assert comm.split_args == ("COMM_TYPE_SHARED", 103)
    assert comm.freed
    assert fake.used == [1]


def test_select_device_argument_and_env(clean_env, fake_mpi):
    fake = _install_cupy(clean_env, 4)
    comm = _FakeComm(local_rank=0)
    assert bk.select_device(comm, device=2) == 2
    clean_env.setenv("SPMD_DEVICE", "3")
    assert bk.select_device(comm) == 3
    assert bk.select_device(comm, device=1) == 1  # argument beats env
    assert comm.split_args is None  # no split when the device is given
    assert fake.used == [2, 3, 1]


def test_select_device_out_of_range(clean_env, fake_mpi):
    _install_cupy(clean_env, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        bk.select_device(_FakeComm(0), device=2)
    clean_env.setenv("SPMD_DEVICE", "7")
    with pytest.raises(RuntimeError, match="SPMD_DEVICE=7 is out of range"):
        bk.select_device(_FakeComm(0))
    clean_env.setenv("SPMD_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="SPMD_DEVICE must be an integer"):
        bk.select_device(_FakeComm(0))


def test_select_device_without_gpu(no_cupy, fake_mpi):
    comm = _FakeComm(local_rank=1)
    assert bk.select_device(comm) is None  # host run: nothing to pick
    with pytest.raises(RuntimeError, match="asks for a GPU.*needs the cupy package"):
        bk.select_device(comm, device=0)
    no_cupy.setenv("SPMD_DEVICE", "0")
    with pytest.raises(RuntimeError, match="SPMD_DEVICE=0 asks for a GPU"):
        bk.select_device(comm)


def test_select_device_env_local_rank_fallback(clean_env, fake_mpi):
    _install_cupy(clean_env, 2)
    clean_env.setenv("MPI_LOCALRANKID", "5")
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMI_LOCAL_RANK"):
        clean_env.delenv(var, raising=False)
    assert bk.select_device(object()) == 1  # no Split_type: env local rank 5 % 2


# ---------------------------------------------------------- host helpers
def test_to_host_and_to_device_numpy(no_cupy):
    a = np.arange(6).reshape(2, 3)
    assert bk.to_host(a) is a
    assert isinstance(bk.to_host([1, 2]), np.ndarray)
    assert bk.to_device(a, np) is a
    assert not bk.is_device_array(a)
    assert bk.array_module_of(a) is np


def test_the_registry_names_each_backend_and_finds_an_array_modules(clean_env):
    assert bk.BACKENDS == ("numpy", "cupy") and backends.backend("numpy").array_module() is np
    assert all(isinstance(b, backends.ArrayBackend) for b in backends.REGISTRY.values())
    assert backends.backend_of(np).name == "numpy" and backends.backend_of(_fake_cupy(1)).name == "cupy"
    with pytest.raises(ValueError, match=r"one of \('numpy', 'cupy'\); got 'tpu'"):
        backends.backend("tpu")


def test_a_device_array_is_one_whose_type_exports_the_cuda_interface():
    assert devices.is_device_array(HostDeviceArray(np.zeros(3)))
    assert not devices.is_device_array(np.zeros(3)) and not devices.is_device_array(None)


def test_scatter_add_accumulates_repeated_rows_with_ufunc_at():
    target = np.zeros((3, 2))
    devices.scatter_add(np, target, np.array([0, 2, 0]), np.ones((3, 2)))
    np.testing.assert_array_equal(target, [[2, 2], [0, 0], [1, 1]])


def test_to_device_cupy_uses_xp_asarray(clean_env):
    fake = _install_cupy(clean_env, 1)
    tag, arr = bk.to_device([1, 2, 3], fake)
    assert tag == "on-device"
    np.testing.assert_array_equal(arr, [1, 2, 3])


def test_backend_module_does_not_import_cupy_or_mpi():
    """Importing the backend must stay cheap and optional-dependency free: the device floor (where cupy is
    imported, lazily) imports neither cupy nor MPI, and the backends import no cupy."""
    import subprocess

    # Load the floor file on its own so that whatever the package __init__ imports
    # does not count against it.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('devices_alone', {devices.__file__!r}); "
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); "
        "print(sorted(m for m in ('cupy', 'mpi4py.MPI') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys, spmd_runtime.exec.backend, spmd_runtime.exec.backends; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------- real cupy
class TestRealCupy:
    """Runs only where cupy is installed and a GPU is visible."""

    @pytest.fixture(autouse=True)
    def _cupy(self, clean_env):
        cp = pytest.importorskip("cupy", reason="cupy is not installed (pip install spmd_runtime[gpu])")
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # pragma: no cover - depends on the machine
            pytest.skip(f"cupy is installed but CUDA reports no GPU: {type(e).__name__}: {e}")
        if n < 1:  # pragma: no cover
            pytest.skip("cupy is installed but no GPU is visible")
        self.cp = cp

    def test_auto_selects_cupy(self):
        assert bk.get_array_module() is self.cp
        assert bk.get_array_module("cupy") is self.cp

    def test_roundtrip(self):
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        d = bk.to_device(a, self.cp)
        assert bk.is_device_array(d)
        assert bk.array_module_of(d) is self.cp
        np.testing.assert_array_equal(bk.to_host(d * 2), a * 2)

    def test_select_device_explicit(self):
        assert bk.select_device(None, device=0) == 0
        assert self.cp.cuda.Device().id == 0
