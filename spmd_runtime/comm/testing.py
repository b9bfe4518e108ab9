"""Test support for the communication layer, usable without a GPU or MPI launcher.

* NumPy reference semantics of every collective, computed from all ranks'
  local arrays (the "global data") and mesh coordinates only, independently of
  the communicator code under test.
* ``HostDeviceArray``: host memory posing as device memory. It exposes only
  ``__cuda_array_interface__`` (no buffer protocol), exactly what mpi4py and
  the collectives see of a CuPy array, so the CUDA-aware (direct) and staged
  paths run in CI. ``HostDeviceOps`` is the matching ``gpu.Transport``
  device_ops and records what it was asked to do.
"""
from __future__ import annotations

import numpy as np

_NUMPY_REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min}


# -- reference semantics ------------------------------------------------------------------------


def group_members(mesh, rank: int, axes) -> list[int]:
    """Ranks sharing ``rank``'s coordinates off ``axes``, in shard order (major axis first)."""
    here = mesh.coords(rank)
    others = [a for a in mesh.axis_names if a not in axes]
    members = [r for r in mesh.devices if all(mesh.coords(r)[a] == here[a] for a in others)]
    return sorted(members, key=lambda r: tuple(mesh.coords(r)[a] for a in axes))


def reference_all_reduce(mesh, xs, rank, axes, op):
    group = group_members(mesh, rank, axes)
    return _NUMPY_REDUCTIONS[op](np.stack([xs[r] for r in group]), axis=0).astype(xs[rank].dtype)


def reference_all_gather(mesh, xs, rank, axes, dim):
    return np.concatenate([xs[r] for r in group_members(mesh, rank, axes)], axis=dim)


def reference_reduce_scatter(mesh, xs, rank, axes, dim, op):
    group = group_members(mesh, rank, axes)
    return np.split(reference_all_reduce(mesh, xs, rank, axes, op), len(group), axis=dim)[group.index(rank)]


def reference_all_to_all(mesh, xs, rank, axes, split_dim, concat_dim):
    group = group_members(mesh, rank, axes)
    blocks = [np.split(xs[r], len(group), axis=split_dim)[group.index(rank)] for r in group]
    return np.concatenate(blocks, axis=concat_dim)


def reference_broadcast(mesh, xs, rank, axes, root=0):
    return xs[group_members(mesh, rank, axes)[root]].copy()


def reference_permute(xs, rank, pairs):
    sources = [s for s, d in pairs if d == rank]
    return xs[sources[0]].copy() if sources else np.zeros_like(xs[rank])


# -- host memory posing as device memory -------------------------------------------------------


class HostDeviceArray:
    """A NumPy array seen only through ``__cuda_array_interface__`` (plus shape/dtype and CuPy-like get/set)."""

    def __init__(self, host: np.ndarray):
        self._host = host

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    ndim = property(lambda self: self._host.ndim)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        host = self._host
        strides = None if host.flags.c_contiguous else host.strides
        return {"shape": host.shape, "typestr": host.dtype.str, "data": (host.ctypes.data, False),
                "strides": strides, "version": 3, "stream": None}

    def __repr__(self):
        return f"HostDeviceArray({self._host!r})"

    def copy(self) -> "HostDeviceArray":
        return HostDeviceArray(self._host.copy())

    def reshape(self, *shape) -> "HostDeviceArray":
        return HostDeviceArray(self._host.reshape(*shape))

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self._host.copy()
        np.copyto(out, self._host)
        return out

    def set(self, host: np.ndarray) -> None:
        np.copyto(self._host, host)


class HostDeviceModule:
    """The array-module functions the collectives call, for ``HostDeviceArray``."""

    @staticmethod
    def ascontiguousarray(a) -> HostDeviceArray:
        return HostDeviceArray(np.ascontiguousarray(a._host))

    @staticmethod
    def moveaxis(a, source, destination) -> HostDeviceArray:
        return HostDeviceArray(np.moveaxis(a._host, source, destination))

    @staticmethod
    def empty(shape, dtype) -> HostDeviceArray:
        return HostDeviceArray(np.empty(shape, dtype))

    @staticmethod
    def zeros(shape, dtype) -> HostDeviceArray:
        return HostDeviceArray(np.zeros(shape, dtype))


class HostDeviceOps:
    """``gpu.Transport`` device ops for ``HostDeviceArray``; appends each action to ``events``."""

    def __init__(self, events: list | None = None):
        self.events = [] if events is None else events

    def array_module(self, x):
        return HostDeviceModule

    def synchronize(self) -> None:
        self.events.append("sync")

    def copy_to_host(self, device_array, host_out: np.ndarray) -> None:
        self.events.append("to_host")
        device_array.get(out=host_out)

    def copy_to_device(self, host_array: np.ndarray, device_out) -> None:
        self.events.append("to_device")
        device_out.set(host_array)

    def empty_pinned(self, nbytes: int) -> np.ndarray:
        self.events.append("pin")
        return np.empty(nbytes, np.uint8)
