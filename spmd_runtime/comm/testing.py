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

from spmd_runtime.collective_kinds import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, COLLECTIVE_PERMUTE,
                                           REDUCE_SCATTER)

_NUMPY_REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


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


def carried_values(n: int, shape, dtype, seed=0) -> list:
    """One array per rank of values ``dtype`` holds exactly, and so do sums over 4 ranks of them (any carried
    dtype, dtypes.COLLECTIVE_DTYPES): bools, integers 0..3, complex numbers with both parts set."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, r])
        if dtype == np.bool_:
            out.append(rng.integers(0, 2, shape) > 0)
        elif dtype.kind == "c":
            out.append((rng.integers(0, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype))
        else:
            out.append(rng.integers(0, 4, shape).astype(dtype))
    return out


def kind_cases(mesh, axes, dtype) -> list:
    """(kind, attrs, reference(xs, rank)) for every kind a bound collective has, reducing with each op ``dtype``
    reduces with (complex numbers: sum and prod), over ``axes`` (a permute: the ring over the world)."""
    ops = ("sum", "prod") if np.dtype(dtype).kind == "c" else ("sum", "max", "min", "prod")
    ring, root = [(r, (r + 1) % mesh.size) for r in range(mesh.size)], mesh.axis_size(axes) - 1
    out = [(ALL_REDUCE.name, {"axes": axes, "op": op}, lambda xs, r, op=op: reference_all_reduce(mesh, xs, r, axes, op))
           for op in ops]
    out += [(REDUCE_SCATTER.name, {"axes": axes, "dim": 0, "op": op},
             lambda xs, r, op=op: reference_reduce_scatter(mesh, xs, r, axes, 0, op)) for op in ops]
    return out + [
        (ALL_GATHER.name, {"axes": axes, "dim": 1}, lambda xs, r: reference_all_gather(mesh, xs, r, axes, 1)),
        (ALL_TO_ALL.name, {"axes": axes, "split_dim": 0, "concat_dim": 1},
         lambda xs, r: reference_all_to_all(mesh, xs, r, axes, 0, 1)),
        (COLLECTIVE_PERMUTE.name, {"pairs": ring}, lambda xs, r: reference_permute(xs, r, ring)),
        (BROADCAST.name, {"axes": axes, "root": root}, lambda xs, r: reference_broadcast(mesh, xs, r, axes, root))]


def ring_exchange(rank: int, n: int, rows: int = 2) -> dict:
    """An all_to_allv round plan for (rows, 3) operands: this rank's x lands in out[:, :3], its left neighbour's
    in out[:, 3:] (``collectives.all_to_allv(mc, x, **ring_exchange(rank, n, rows))``)."""
    right, left = (rank + 1) % n, (rank - 1) % n
    return {"sends": [(rank, (slice(None),)), (right, (slice(None),))],
            "recvs": [(rank, (slice(None), slice(0, 3))), (left, (slice(None), slice(3, 6)))], "out_shape": (rows, 6)}


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
