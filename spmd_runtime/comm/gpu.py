"""GPU buffers on MPI: CUDA-awareness detection and pinned host staging.

A CUDA-aware MPI reads and writes device memory itself, so device arrays go to
MPI as they are. Any other MPI needs host memory: the data is staged through
pinned host buffers (fast DMA), which are kept and reused across calls because
pinning memory costs far more than a copy.

Whether an array lives on the device is decided by ``__cuda_array_interface__``
alone (``spmd_runtime.devices.is_device_array``, re-exported here), so tests without a GPU can exercise both paths with a host-backed object
exposing that attribute and a fake ``DeviceOps``. CuPy is imported only when a
device array is actually seen: nothing here needs it to import.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from functools import lru_cache

import numpy as np

from ..devices import import_cupy, is_device_array

CUDA_AWARE_ENV = "SPMD_CUDA_AWARE"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def cuda_aware_mpi() -> bool:
    """Whether MPI accepts device buffers: ``$SPMD_CUDA_AWARE`` (1/0) overrides the library's answer."""
    env = os.environ.get(CUDA_AWARE_ENV)
    if env is None:
        return _library_is_cuda_aware()
    if env.strip().lower() in _TRUE + _FALSE:
        return env.strip().lower() in _TRUE
    raise ValueError(f"{CUDA_AWARE_ENV} must be one of {_TRUE + _FALSE}; got {env!r}")


@lru_cache(maxsize=None)
def _library_is_cuda_aware() -> bool:
    """Ask the MPI library mpi4py is linked to; False when it cannot say."""
    answer = _query_cuda_support_symbol()
    if answer is None:
        answer = _ompi_info_says_cuda()
    return bool(answer)


def _query_cuda_support_symbol() -> bool | None:
    # MPICH >= 4 and Open MPI both export ``int MPIX_Query_cuda_support(void)``
    # (runtime answer, valid after MPI_Init). mpi4py does not wrap it, but a
    # dlsym on mpi4py's extension module also searches the libmpi it links.
    from mpi4py import MPI  # here, not at the top: importing it initialises MPI

    try:
        query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    except OSError:
        return None
    if query is None:
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return query() == 1


def _ompi_info_says_cuda() -> bool | None:
    # Open MPI builds whose mpi-ext CUDA extension was disabled still report
    # the build option through ompi_info.
    from mpi4py import MPI  # here, not at the top: importing it initialises MPI

    if not MPI.Get_library_version().startswith("Open MPI") or shutil.which("ompi_info") is None:
        return None
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return "mpi_built_with_cuda_support:value:true" in out


class CupyDeviceOps:
    """The device operations the staging path needs, done with CuPy."""

    def __init__(self):
        self.cupy = import_cupy()  # only reached once a device array is seen

    def array_module(self, x):
        return self.cupy.get_array_module(x)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def copy_to_host(self, device_array, host_out: np.ndarray) -> None:
        device_array.get(out=host_out)

    def copy_to_device(self, host_array: np.ndarray, device_out) -> None:
        device_out.set(host_array)

    def empty_pinned(self, nbytes: int) -> np.ndarray:
        memory = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)


class Transport:
    """Hands buffers to an MPI call, staging device arrays through pinned host memory when needed.

    ``cuda_aware=None`` asks ``cuda_aware_mpi()`` the first time a device array is
    seen; ``device_ops=None`` uses CuPy. One Transport per communicator: its
    pinned buffers are reused by every call but are not safe to share across threads.
    """

    def __init__(self, cuda_aware: bool | None = None, device_ops=None):
        self._cuda_aware, self._device_ops = cuda_aware, device_ops
        self._pinned: dict[str, np.ndarray] = {}

    @property
    def cuda_aware(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()
        return self._cuda_aware

    @property
    def device_ops(self):
        if self._device_ops is None:
            self._device_ops = CupyDeviceOps()
        return self._device_ops

    def array_module(self, x):
        return self.device_ops.array_module(x) if is_device_array(x) else np

    def run(self, mpi_call, send, recv) -> None:
        """``mpi_call(send_buffer, recv_buffer)`` on MPI-readable buffers; either may be None (no data)."""
        if not (is_device_array(send) or is_device_array(recv)):  # None is no device array either
            return mpi_call(send, recv)
        # Kernels producing `send` run asynchronously: MPI must not read before they finish.
        self.device_ops.synchronize()
        if self.cuda_aware:
            return mpi_call(send, recv)
        host_send = None if send is None else self._stage_to_host(send)
        host_recv = None if recv is None else self.pinned("recv", recv.shape, recv.dtype)
        mpi_call(host_send, host_recv)
        if recv is not None:
            self.device_ops.copy_to_device(host_recv, recv)

    def start(self, mpi_call, send, recv, staging: dict):
        """``run`` for a nonblocking ``mpi_call`` (it posts requests): returns what completes the result once
        they are done (a staged receive's copy to the device), or None. ``staging``: the caller's own pinned
        buffers (a dict it keeps), since calls in flight at once must not share them."""
        if not (is_device_array(send) or is_device_array(recv)):
            return mpi_call(send, recv)
        self.device_ops.synchronize()  # the kernels producing `send` must have run before MPI reads it
        if self.cuda_aware:
            return mpi_call(send, recv)
        host_send = None if send is None else self._stage_to_host(send, staging)
        host_recv = None if recv is None else self.pinned("recv", recv.shape, recv.dtype, staging)
        mpi_call(host_send, host_recv)
        if recv is None:
            return None
        copy_to_device = self.device_ops.copy_to_device
        return lambda: copy_to_device(host_recv, recv)

    def _stage_to_host(self, device_array, cache=None) -> np.ndarray:
        host = self.pinned("send", device_array.shape, device_array.dtype, cache)
        self.device_ops.copy_to_host(device_array, host)
        return host

    def pinned(self, role: str, shape, dtype, cache: dict | None = None) -> np.ndarray:
        """A pinned host array for ``role`` ('send' | 'recv'), reusing the cached buffer when big enough;
        ``cache``: a dict of the caller's own instead of this Transport's."""
        cache = self._pinned if cache is None else cache
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        cached = cache.get(role)
        if cached is None or cached.nbytes < nbytes:
            # Grow geometrically so a slowly growing message size does not re-pin every call.
            capacity = max(nbytes, 2 * (0 if cached is None else cached.nbytes), 64)
            cached = cache[role] = self.device_ops.empty_pinned(capacity)
        return cached[:nbytes].view(dtype).reshape(shape)
