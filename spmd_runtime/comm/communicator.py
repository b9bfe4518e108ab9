"""MPI communicators over mesh axes.

``MeshCommunicator`` owns one sub-communicator per tuple of mesh axes, split
from the world communicator the first time it is used and cached afterwards.
Its sub-communicator rank is the rank's shard number over those axes
(``mesh.index_along``), so MPI's rank-ordered collectives produce shards in
mesh order.

The public buffer methods are thin one-line wrappers over the mpi4py buffer
(uppercase) primitives, in the spirit of ``mpi4py.util.pkl5``: buffers must be
contiguous arrays of one dtype (or device arrays for a CUDA-aware MPI) and are
never pickled. Array-level semantics (layouts, k == 1, GPU staging) live in
``collectives.py``.

``world()`` is the world communicator as the runtime uses it: its first use installs the job guard.

Sub-communicators are created lazily by a collective ``Split`` on the world
communicator, so every rank must request the same axes in the same order,
which SPMD programs do by construction.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from spmd_runtime.comm import jobguard, watchdog
from spmd_runtime.comm.agreement import AgreedError, agree  # noqa: F401  (AgreedError: re-exported, its old home)
from spmd_runtime.comm.gpu import Transport
from spmd_runtime.dtypes import collective_refusal

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# MPI defines SUM, MAX and MIN on none of its logical types (MPICH: "Invalid MPI_Op" on C_BOOL); NumPy's add and
# maximum of bools are a logical or, its minimum (and multiply) a logical and: what LOR and LAND compute
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}
_BOOL = np.dtype(np.bool_)


def _nan_propagating(ufunc):
    """An MPI op computing ``ufunc`` (np.maximum / np.minimum): NaN wins, as in NumPy's max / min. MPI's MAX / MIN
    compare, so a NaN is kept or dropped by the reduction order, which differs between ranks: ranks got different
    maxima (NaN on some, a number on others)."""
    def combine(invec, inoutvec, datatype):
        dtype = to_numpy_dtype(datatype)
        ufunc(np.frombuffer(invec, dtype), np.frombuffer(inoutvec, dtype), out=np.frombuffer(inoutvec, dtype))
    return MPI.Op.Create(combine, commute=True)


_FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
NAN_PROPAGATING = {"max": _nan_propagating(np.maximum), "min": _nan_propagating(np.minimum)}


def mpi_op(op: str, dtype=None, kind: str = "a reduction"):
    """The MPI op that reduces ``dtype`` buffers as NumPy's ``op`` ('sum' | 'max' | 'min' | 'prod') does (None: the op by
    name alone). A dtype the collective ``kind`` cannot reduce (dtypes.collective_refusal: complex max/min, a
    dtype no collective carries) raises TypeError "not supported: ...", before any MPI call."""
    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {sorted(_OPS)}; got {op!r}")
    if dtype is None:
        return _OPS[op]
    refusal = collective_refusal(kind, dtype, op)
    if refusal is not None:
        raise TypeError(refusal)
    if np.dtype(dtype) in _FLOAT_TYPES and op in NAN_PROPAGATING:
        return NAN_PROPAGATING[op]
    return _BOOL_OPS[op] if np.dtype(dtype) == _BOOL else _OPS[op]


def world(comm=None):
    """``comm``, or the world communicator when None: how the runtime reaches MPI, so that its first use of MPI
    installs the job guard (jobguard.py), as ``sr.distributed.initialize()`` does. Installing is collective
    over the world: an MPI communicator of only some ranks of the job leaves it to a later use of the world;
    a simulated communicator (threads of one process) needs no guard."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm) and not jobguard.decided() and _spans_the_job(comm):
        jobguard.install()
    return comm


def _spans_the_job(comm) -> bool:
    """Whether every rank of the world is a member of ``comm`` (a local check)."""
    return comm is MPI.COMM_WORLD or (not comm.Is_inter() and MPI.Comm.Compare(comm, MPI.COMM_WORLD) != MPI.UNEQUAL)


def _waits(name):
    """Watchdog description of a wrapper blocked in MPI: the primitive and its mesh axes (and whom it waits for)."""
    return watchdog.collective(lambda frame: f"MPI {name} over mesh axes {frame.f_locals.get('axes')}", _group)


def _group(frame):
    """The communicator a MeshCommunicator wrapper waits on: its axes' sub-communicator (the world until split)."""
    mc, axes = frame.f_locals["self"], frame.f_locals.get("axes")
    return mc._subs.get((axes,) if isinstance(axes, str) else tuple(axes)) or mc.comm


def _peer(rank: int | None) -> int:
    # MPI_PROC_NULL turns a send or receive into a no-op, so a rank without a
    # partner can still take part in one uniform Sendrecv.
    return MPI.PROC_NULL if rank is None else rank


class MeshCommunicator:
    """Collective communication over named mesh axes; device id = world rank.

    ``comm`` defaults to ``MPI.COMM_WORLD``; any object with the mpi4py
    ``Comm`` API subset used here works (e.g. ``simulated.SimulatedComm``).
    ``transport`` moves device arrays to MPI (see ``gpu.Transport``).
    """

    def __init__(self, mesh, comm=None, transport: Transport | None = None):
        comm = world(comm)
        if comm.Get_size() != mesh.size:
            raise ValueError(
                f"MeshCommunicator needs one MPI process per mesh device; got {comm.Get_size()} "
                f"processes for {mesh} with {mesh.size} devices"
            )
        self.mesh, self.comm, self.rank = mesh, comm, comm.Get_rank()
        self.transport = Transport() if transport is None else transport
        # Keyed by the axes tuple: the hot path is one dict lookup, validation happens on a miss.
        self._subs: dict[tuple[str, ...], object] = {}
        self._sizes: dict[tuple[str, ...], int] = {}

    def __repr__(self):
        return f"MeshCommunicator({self.mesh}, rank={self.rank})"

    def __enter__(self) -> "MeshCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def axis_size(self, axes: tuple[str, ...]) -> int:
        """Group size k over ``axes`` (validated and cached)."""
        try:
            return self._sizes[axes]
        except (KeyError, TypeError):  # first use, or a str / list spelling of the axes
            axes = self._check_axes(axes)
            return self._sizes.setdefault(axes, self.mesh.axis_size(axes))

    def index_along(self, axes: tuple[str, ...]) -> int:
        """This rank's shard number (and sub-communicator rank) over ``axes``."""
        return self.mesh.index_along(self.rank, self._check_axes(axes))

    @_waits("Comm_split")
    def sub(self, axes: tuple[str, ...]):
        """The sub-communicator over ``axes`` holding this rank, ranked by ``index_along``. Collective on first use."""
        try:
            return self._subs[axes]
        except (KeyError, TypeError):
            axes = self._check_axes(axes)
        if axes not in self._subs:
            color = self.mesh.group_color(self.rank, axes)
            self._subs[axes] = self.comm.Split(color=color, key=self.mesh.index_along(self.rank, axes))
        return self._subs[axes]

    def _check_axes(self, axes) -> tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in self.mesh.axis_names]
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(f"collective axes must be distinct axes of {self.mesh}; got {axes}")
        return axes

    # -- thin buffer primitives -------------------------------------------------------------

    @_waits("Allreduce")
    def Allreduce(self, axes, send, recv, op: str) -> None:
        """``recv`` = elementwise ``op`` ('sum' | 'max' | 'min' | 'prod') of ``send`` over the group along ``axes``."""
        self.sub(axes).Allreduce(send, recv, mpi_op(op, send.dtype, "Allreduce"))

    @_waits("Allgather")
    def Allgather(self, axes, send, recv) -> None:
        """``recv`` = the group's ``send`` buffers concatenated in sub-rank order (k times ``send``'s size)."""
        self.sub(axes).Allgather(send, recv)

    @_waits("Reduce_scatter_block")
    def Reduce_scatter_block(self, axes, send, recv, op: str) -> None:
        """``recv`` = block ``index_along(axes)`` of the group's elementwise ``op`` of ``send`` (k equal blocks)."""
        self.sub(axes).Reduce_scatter_block(send, recv, mpi_op(op, send.dtype, "Reduce_scatter_block"))

    @_waits("Alltoall")
    def Alltoall(self, axes, send, recv) -> None:
        """Block j of ``send`` goes to sub-rank j; block i of ``recv`` comes from sub-rank i (k equal blocks)."""
        self.sub(axes).Alltoall(send, recv)

    @watchdog.collective(lambda f: f"MPI Sendrecv (to {f.f_locals.get('dest')}, from {f.f_locals.get('source')})",
                         lambda f: [f.f_locals.get("dest"), f.f_locals.get("source")]
                         if isinstance(f.f_locals["self"].comm, MPI.Comm) else [])
    def Sendrecv(self, send, dest: int | None, recv, source: int | None) -> None:
        """Send ``send`` to world rank ``dest`` while receiving ``recv`` from ``source``; None = no partner."""
        self.comm.Sendrecv(send, _peer(dest), recvbuf=recv, source=_peer(source), recvtag=0)

    @watchdog.collective(lambda frame: "MPI Barrier on the world communicator")
    def Barrier(self) -> None:
        """Block until every rank of the world communicator arrives."""
        self.comm.Barrier()

    # -- control ----------------------------------------------------------------------------

    def agree(self, error: str | None) -> None:
        """Collective check that every rank is ready: raises AgreedError on EVERY rank if any rank passed an error.

        Call before a run so a rank that failed to prepare (bad input, compile
        error) does not leave the others blocked in their first collective.
        """
        agree(self.comm, error, "preparing the run")

    def free(self) -> None:
        """Release the cached sub-communicators (collective: every rank frees the same set)."""
        for axes in sorted(self._subs):
            self._subs.pop(axes).Free()
