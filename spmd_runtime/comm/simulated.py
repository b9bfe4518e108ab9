"""In-process simulation of N MPI ranks, one thread each, for fast deterministic tests.

``run_simulated(n, fn, *args)`` runs ``fn(comm, *args)`` on n threads, each with
a ``SimulatedComm`` implementing the subset of mpi4py's ``Comm`` API that
``MeshCommunicator`` uses. Buffers are NumPy arrays (or objects exposing
``__cuda_array_interface__`` over host memory, as mpi4py would accept them);
data is copied between the simulated ranks, never shared.

Each collective is one lockstep step of its communicator's group: every member
deposits its contribution and waits on a ``threading.Barrier`` whose action
(run once, by the last arriving thread) computes all members' results, reading
the deposited buffers while their owners are still blocked. A single barrier
per step suffices: the next step's action cannot run before every member has
arrived again, i.e. after each has copied out its previous result.

Reductions combine contributions in rank order, so results are deterministic. Like MPI, a reduction refuses
an op its datatype does not define (MPICH: "Invalid MPI_Op": SUM, MAX, MIN on bools, MAX, MIN on complex
numbers, LOR, LAND on floats) and a buffer refuses a dtype MPI has no datatype for (bfloat16, objects), so a
path that only works in the simulation fails here too.
The first exception on any thread aborts every barrier and mailbox so no thread
is left hanging; ``run_simulated`` re-raises it, noting the rank it came from.
"""
from __future__ import annotations

import itertools
import pickle
import sys
import threading
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from spmd_runtime.comm.communicator import NAN_PROPAGATING  # float max / min: NumPy's, as here

# mpi4py Op objects are unhashable: look them up by equality. Per op: its ufunc, its name, and the NumPy dtype
# kinds of the MPI datatypes it is defined on (the MPI standard's table; float16 is MPICH's MPIX_C_FLOAT16).
_REDUCTIONS = ((MPI.SUM, np.add, "SUM", "iufc"), (MPI.MAX, np.maximum, "MAX", "iuf"),
               (MPI.MIN, np.minimum, "MIN", "iuf"), (MPI.PROD, np.multiply, "PROD", "iufc"), (MPI.LOR, np.logical_or, "LOR", "biu"),
               (MPI.LAND, np.logical_and, "LAND", "biu"),
               (NAN_PROPAGATING["max"], np.maximum, "MAX", "f"), (NAN_PROPAGATING["min"], np.minimum, "MIN", "f"))
# The typecodes mpi4py maps to an MPI datatype (MPI.Datatype.fromcode): a buffer of any other dtype fails.
_MPI_TYPECODES = frozenset("?bBhHiIlLqQefdgFDG")


# World rank of the simulated rank running on the current thread.
_this_rank = threading.local()


def is_lead_rank() -> bool:
    """Whether this is rank 0 of the job (of the simulated world on this thread, else of MPI's world):
    the one rank that prints what every rank would print alike. mpi4py is not imported here if the
    program has not already done so."""
    sim = getattr(_this_rank, "value", None)
    if sim is not None:
        return sim == 0
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_rank() == 0


class SimulatedAbort(RuntimeError):
    """Raised by ``SimulatedComm.Abort``: like MPI_Abort, it brings every rank down."""


class _Aborted(RuntimeError):
    """Raised on the other ranks once one rank failed; never the error reported."""


def run_simulated(n: int, fn, *args, timeout: float = 60.0) -> list:
    """Run ``fn(comm, *args)`` on ``n`` simulated ranks; return the per-rank results in rank order.

    A collective that waits longer than ``timeout`` seconds (a deadlock: some
    rank never joined) fails with TimeoutError.
    """
    if n < 1:
        raise ValueError(f"run_simulated needs at least one rank; got n={n}")
    world = _World(timeout)
    group = world.new_group(range(n))
    results: list = [None] * n

    def body(rank: int) -> None:
        _this_rank.value = rank
        try:
            results[rank] = fn(SimulatedComm(group, rank), *args)
        except BaseException as exc:  # noqa: BLE001 - every failure must abort the other ranks
            world.fail(rank, exc)

    threads = [threading.Thread(target=body, args=(r,), name=f"simulated-rank-{r}") for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if world.failure is not None:
        rank, exc = world.failure
        exc.add_note(f"(raised on simulated rank {rank} of {n})")
        raise exc
    return results


class _World:
    """State shared by all simulated ranks of one run: barriers, mailboxes, failure."""

    def __init__(self, timeout: float):
        self.timeout, self.failure, self.aborted = timeout, None, False
        self._lock = threading.Lock()
        self._barriers: list[threading.Barrier] = []
        self._group_ids = itertools.count()
        self.mail = threading.Condition()
        # Messages match receives in posting order, as in MPI: the n-th send on (group, source, dest, tag) goes
        # to the n-th receive posted there, however the receives' waits are ordered (nonblocking receives).
        self.messages: dict[tuple, np.ndarray] = {}
        self.sent: dict[tuple, int] = defaultdict(int)
        self.posted: dict[tuple, int] = defaultdict(int)

    def new_group(self, members) -> "_Group":
        return _Group(self, tuple(members), next(self._group_ids))

    def new_barrier(self, parties: int, action) -> threading.Barrier:
        barrier = threading.Barrier(parties, action=action, timeout=self.timeout)
        with self._lock:
            self._barriers.append(barrier)
            if self.aborted:
                barrier.abort()
        return barrier

    def fail(self, rank: int, exc: BaseException, abort_barriers: bool = True) -> None:
        """Record the first real failure and wake every waiting rank."""
        with self._lock:
            if self.failure is None or isinstance(self.failure[1], _Aborted):
                self.failure = (rank, exc)
            self.aborted = True
            barriers = list(self._barriers) if abort_barriers else []
        for barrier in barriers:
            barrier.abort()
        with self.mail:
            self.mail.notify_all()


class _Group:
    """The ranks of one communicator and their lockstep exchange point."""

    def __init__(self, world: _World, members: tuple[int, ...], group_id: int):
        self.world, self.members, self.id = world, members, group_id
        self._slots: list = [None] * len(members)
        self._results: list = []
        self._barrier = world.new_barrier(len(members), self._combine)

    def exchange(self, rank: int, kind, payload, combine):
        """Deposit ``payload``; once all members arrived, ``combine(payloads)`` gives each its result."""
        self._slots[rank] = (kind, payload, combine)
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise self._broken(kind) from None
        return self._results[rank]

    def _combine(self) -> None:
        # Runs in the last thread to arrive. Record a failure before the barrier
        # breaks, so the waiting ranks see it as an abort, not as a timeout.
        try:
            kinds = [slot[0] for slot in self._slots]
            if any(kind != kinds[0] for kind in kinds):
                raise RuntimeError(f"every rank of a communicator must call the same collective; got {kinds}")
            self._results = self._slots[0][2]([slot[1] for slot in self._slots])
        except BaseException as exc:
            self.world.fail(_this_rank.value, exc, abort_barriers=False)
            raise

    def _broken(self, kind) -> Exception:
        if self.world.aborted:
            return _Aborted(f"{kind} aborted because another simulated rank failed")
        return TimeoutError(
            f"simulated {kind} must be joined by all {len(self.members)} ranks of its communicator "
            f"(world ranks {self.members}) within {self.world.timeout}s; got a timeout (deadlock?)"
        )


class SimulatedComm:
    """One simulated rank's view of a communicator (the mpi4py ``Comm`` subset used by this project)."""

    def __init__(self, group: _Group, rank: int):
        self._group, self._rank, self._freed = group, rank, False

    def __repr__(self):
        return f"SimulatedComm(rank={self._rank}, size={self.size}, world_ranks={self._group.members})"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._group.members)

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self.size

    def Free(self) -> None:
        self._freed = True

    def Abort(self, errorcode: int = 1):
        raise SimulatedAbort(f"MPI_Abort called on rank {self._rank} with error code {errorcode}")

    def _step(self, kind, payload, combine):
        if self._freed:
            raise RuntimeError(f"a communicator must not be used after Free(); got {kind} on {self!r}")
        return self._group.exchange(self._rank, kind, payload, combine)

    # -- collectives on buffers ---------------------------------------------------------------

    def Barrier(self) -> None:
        self._step("Barrier", None, lambda payloads: [None] * len(payloads))

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        recv = _buffer(recvbuf)
        send = recv.copy() if sendbuf is MPI.IN_PLACE else _buffer(sendbuf)
        _check_sizes("Allreduce", send, recv, send.size)
        ufunc, name = _reduction(op, send.dtype, "Allreduce")
        total = self._step(("Allreduce", name), send, lambda ps: [_reduce(ufunc, ps, "Allreduce")] * len(ps))
        recv.reshape(-1)[...] = total.reshape(-1)

    def Allgather(self, sendbuf, recvbuf) -> None:
        send, recv = _buffer(sendbuf), _buffer(recvbuf)
        _check_sizes("Allgather", send, recv, send.size * self.size)
        gathered = self._step("Allgather", send, lambda ps: [_concat(ps, "Allgather")] * len(ps))
        recv.reshape(-1)[...] = gathered

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        send, recv = _buffer(sendbuf), _buffer(recvbuf)
        _check_sizes("Reduce_scatter_block", send, recv, send.size // self.size, divisor=self.size)
        ufunc, name = _reduction(op, send.dtype, "Reduce_scatter_block")

        def combine(payloads):
            return list(_reduce(ufunc, payloads, "Reduce_scatter_block").reshape(len(payloads), -1))

        recv.reshape(-1)[...] = self._step(("Reduce_scatter_block", name), send, combine)

    def Alltoall(self, sendbuf, recvbuf) -> None:
        send, recv = _buffer(sendbuf), _buffer(recvbuf)
        _check_sizes("Alltoall", send, recv, send.size, divisor=self.size)

        def combine(payloads):
            blocks = [p.reshape(len(payloads), -1) for p in _same_shape(payloads, "Alltoall")]
            return [np.concatenate([b[dest] for b in blocks]) for dest in range(len(payloads))]

        recv.reshape(-1)[...] = self._step("Alltoall", send, combine)

    def Bcast(self, buf, root: int = 0) -> None:
        array = _buffer(buf)
        # copied once while the root waits: it may write its buffer again before the others have read it
        sent = self._step(("Bcast", root), array, lambda ps: [_same_shape(ps, "Bcast")[root].copy()] * len(ps))
        if self._rank != root:
            array.reshape(-1)[...] = sent.reshape(-1)

    # -- nonblocking collectives: run in lockstep at the start (every rank starts them in the same order) ------

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        return _completed(self.Allreduce(sendbuf, recvbuf, op))

    def Iallgather(self, sendbuf, recvbuf):
        return _completed(self.Allgather(sendbuf, recvbuf))

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        return _completed(self.Reduce_scatter_block(sendbuf, recvbuf, op))

    def Ialltoall(self, sendbuf, recvbuf):
        return _completed(self.Alltoall(sendbuf, recvbuf))

    def Ibcast(self, buf, root: int = 0):
        return _completed(self.Bcast(buf, root))

    def Isend(self, buf, dest: int, tag: int = 0):
        return _completed(self.Send(buf, dest, tag))

    def Irecv(self, buf, source: int, tag: int = 0):
        """Matched now (posting order), taken at ``Wait`` (sends are buffered, so nothing blocks before it)."""
        if source == MPI.PROC_NULL:
            return _completed()
        ticket = self._post(source, tag)
        return _Request(lambda: self._receive(buf, ticket))

    # -- point to point (buffered sends: Sendrecv cannot deadlock) ------------------------------

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        if dest == MPI.PROC_NULL:
            return
        message = _buffer(buf).copy()
        world, key = self._group.world, (self._group.id, self._rank, self._check_peer(dest), tag)
        with world.mail:
            world.messages[key, world.sent[key]] = message
            world.sent[key] += 1
            world.mail.notify_all()

    def Recv(self, buf, source: int, tag: int = 0, status=None) -> None:
        if source == MPI.PROC_NULL:
            return
        self._receive(buf, self._post(source, tag))

    def _post(self, source: int, tag: int) -> tuple:
        """A ticket: (channel, the number of receives posted on it before this one)."""
        world, key = self._group.world, (self._group.id, self._check_peer(source), self._rank, tag)
        with world.mail:
            world.posted[key] += 1
            return key, world.posted[key] - 1

    def _receive(self, buf, ticket) -> None:
        recv = _buffer(buf)
        message = self._wait_for_message(ticket)
        if message.nbytes > recv.nbytes or message.dtype != recv.dtype:
            raise ValueError(
                f"Recv needs a buffer of the message's dtype and at least its size; got a {message.dtype} "
                f"message of {message.size} items for a {recv.dtype} buffer of {recv.size}"
            )
        recv.reshape(-1)[: message.size] = message.reshape(-1)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        self.Send(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, 0 if recvtag == MPI.ANY_TAG else recvtag)

    def _check_peer(self, peer: int) -> int:
        if not 0 <= peer < self.size:
            raise ValueError(f"simulated peers must be ranks in [0, {self.size}) (no wildcards); got {peer}")
        return peer

    def _wait_for_message(self, ticket) -> np.ndarray:
        world = self._group.world
        with world.mail:
            ready = world.mail.wait_for(lambda: ticket in world.messages or world.aborted, timeout=world.timeout)
            if ticket in world.messages:
                return world.messages.pop(ticket)
        if ready:
            raise _Aborted(f"Recv aborted because another simulated rank failed")
        raise TimeoutError(f"simulated Recv must get its message within {world.timeout}s; got none for {ticket}")

    # -- small Python objects ----------------------------------------------------------------

    def allgather(self, obj) -> list:
        # Pickle round trip: each rank gets its own copies, and unpicklable objects fail as under MPI.
        blobs = self._step("allgather", pickle.dumps(obj), lambda ps: [ps] * len(ps))
        return [pickle.loads(blob) for blob in blobs]

    def bcast(self, obj, root: int = 0):
        blob = pickle.dumps(obj) if self._rank == root else None
        return pickle.loads(self._step(("bcast", root), blob, lambda ps: [ps[root]] * len(ps)))

    def Split(self, color: int = 0, key: int = 0):
        """A new communicator per color, ranked by (key, old rank); None for MPI.UNDEFINED."""
        group = self._group

        def combine(payloads):
            by_color: dict[int, list] = {}
            for rank, (c, k) in enumerate(payloads):
                if c != MPI.UNDEFINED:
                    by_color.setdefault(c, []).append((k, rank))
            out: list = [None] * len(payloads)
            for c in sorted(by_color):
                members = sorted(by_color[c])
                new = group.world.new_group(group.members[r] for _, r in members)
                for new_rank, (_, r) in enumerate(members):
                    out[r] = SimulatedComm(new, new_rank)
            return out

        return self._step("Split", (int(color), int(key)), combine)


class _Request:
    """A simulated MPI request: ``Wait`` finishes the operation once; ``Test`` reports whether it has."""

    def __init__(self, finish=None):
        self._finish = finish

    def Wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def Test(self) -> bool:
        return self._finish is None


def _completed(_=None) -> _Request:
    return _Request()


def _buffer(buf) -> np.ndarray:
    """A NumPy view of an MPI buffer: an array, or host memory behind ``__cuda_array_interface__``."""
    if buf is None:
        return np.empty(0, np.uint8)
    if not isinstance(buf, np.ndarray) and hasattr(buf, "__cuda_array_interface__"):
        buf = _HostView(buf.__cuda_array_interface__)
    array = np.asarray(buf)
    if array.dtype.char not in _MPI_TYPECODES:
        raise ValueError(f"MPI buffers must have a dtype MPI has a datatype for ({''.join(sorted(_MPI_TYPECODES))}); "
                         f"got {array.dtype}")
    if not array.flags.c_contiguous:
        raise BufferError(f"MPI buffers must be C-contiguous; got shape {array.shape} strides {array.strides}")
    return array


class _HostView:
    """Exposes ``__cuda_array_interface__`` host memory through ``__array_interface__`` (no copy)."""

    def __init__(self, cai: dict):
        self.__array_interface__ = {
            "shape": tuple(cai["shape"]), "typestr": cai["typestr"], "data": tuple(cai["data"]),
            "strides": cai.get("strides"), "version": 3,
        }


def _reduction(op, dtype, kind: str):
    """(ufunc, name) of MPI op ``op`` on ``dtype`` buffers; refused as MPI refuses an op its datatype lacks."""
    for mpi_op, ufunc, name, kinds in _REDUCTIONS:
        if op == mpi_op:
            if dtype.kind not in kinds:
                raise ValueError(f"simulated {kind}: MPI.{name} is not defined on {dtype} buffers (as MPI's "
                                 f"Invalid MPI_Op); got op MPI.{name} on {dtype}")
            return ufunc, name
    raise ValueError(f"simulated reductions must be one of {', '.join('MPI.' + r[2] for r in _REDUCTIONS)}; "
                     f"got {op!r}")


def _check_sizes(kind: str, send, recv, recv_size: int, divisor: int = 1) -> None:
    if send.dtype != recv.dtype or recv.size != recv_size or send.size % divisor:
        raise ValueError(
            f"{kind} needs send and receive buffers of one dtype, the receive buffer holding {recv_size} items "
            f"and the send size divisible by {divisor}; got send {send.dtype}[{send.size}], "
            f"receive {recv.dtype}[{recv.size}]"
        )


def _same_shape(payloads, kind: str):
    sizes = [(p.dtype, p.size) for p in payloads]
    if any(s != sizes[0] for s in sizes):
        raise ValueError(f"{kind} needs the same buffer dtype and size on every rank; got {sizes}")
    return payloads


def _reduce(ufunc, payloads, kind: str) -> np.ndarray:
    flat = [p.reshape(-1) for p in _same_shape(payloads, kind)]
    total = flat[0].copy()
    for p in flat[1:]:
        ufunc(total, p, out=total)
    return total


def _concat(payloads, kind: str) -> np.ndarray:
    return np.concatenate([p.reshape(-1) for p in _same_shape(payloads, kind)])


__all__ = ["run_simulated", "SimulatedComm", "SimulatedAbort"]
