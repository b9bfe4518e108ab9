"""Array-level collectives over mesh axes, the ones the SPMD interpreter emits.

Every function takes a ``MeshCommunicator`` ``mc``, the local array ``x``
(NumPy, CuPy, or anything with the array module API that ``mc.transport``
resolves) and the mesh axes the collective runs over. With ``k =
mesh.axis_size(axes)`` ranks per group, shard ``i`` belongs to the rank whose
``index_along(axes)`` is ``i``, which is also its sub-communicator rank.

MPI collectives split buffers along their first axis, so each function moves
the collective's dim to axis 0 in a contiguous buffer (free when it already is
there), calls one MPI primitive with a preallocated receive buffer, and moves
the dim back. With k == 1 the result is computed locally, without MPI.

``bind`` makes every decision once for a collective of known shape and dtype
(group size, sub-communicator, MPI op, layout moves, host or device path) and
returns ``f(x) -> result`` whose per-call work is the MPI call itself: the
interpreter binds each collective instruction once per program, so a step pays
what raw mpi4py pays. ``reuse=True`` keeps the receive (and staging send)
buffers across calls, so a result is overwritten by the next call: only for
values that do not outlive one program run. ``in_place=True`` (all_reduce on
host buffers) reduces into the dying operand with ``MPI.IN_PLACE``. The
functions below are ``bind(...)(x)`` with fresh buffers.

``bind(..., nonblocking=True)`` returns ``start(x) -> Pending`` instead: the same
layouts and buffers, but the MPI call is the nonblocking one (``Iallreduce``,
``Iallgather``, ``Ireduce_scatter_block`` (on device buffers; a host reduce-scatter runs blocking at the start,
see ``bind``), ``Ialltoall``, ``Irecv`` + ``Isend`` for a permute, ``Ibcast``) and ``Pending.wait()`` gives the result (the scheduled programs'
``*_start`` / ``*_done`` pairs, ``partition/schedule.py``). A host binding whose
receive buffer is kept (or that reduces in place) keeps its ``Pending`` too and
posts from one Python frame: one call in flight per binding, as in a program. Device arrays overlap too:
the start waits for the kernels that made the operand (one stream synchronisation) and posts the call on the
device buffers (CUDA-aware MPI) or on pinned host copies of its own (``Transport.start``), whose result
reaches the device at the wait; the GPU runs the kernels queued after the start meanwhile. 16-bit floats
overlap when moved; their reductions run blocking at the start (several collectives, low_precision.py).

``bind(..., operand=a)`` names the array every call's operand will be (the interpreter's planned buffer
of the operand, exec/buffers.py): a host binding with kept buffers then sets up an MPI-4 persistent request
(``Allreduce_init``, ``Allgather_init``, ``Reduce_scatter_block_init``, ``Alltoall_init``; ``Send_init`` and
``Recv_init`` for a permute) once, and every call is ``Start`` (+ ``Wait``): MPI's argument checks and
schedule setup are paid once per program, not per step (8 B over 2 ranks: 4.0 vs 4.9 us per all-reduce on
MPICH 5.0.2; blocking reductions only up to ``PERSISTENT_REDUCTION_MAX``). An operand that arrives in
another array is copied into ``a`` first. Persistent collectives match only persistent ones, so every rank
must bind the same way: the ranks bind the same program with the same plan. ``release(f)`` frees a
binding's requests (the interpreter's ``free``). ``$SPMD_PERSISTENT=0`` (or an MPI without the ``_init``
calls) keeps the plain calls.

Wire bytes (per rank, ring algorithms, S = local bytes) are in each docstring;
they are the denominators of the cost model and of the bus-bandwidth figures.
16-bit floats travel as 16 bits and are reduced in float32 (``low_precision.py``). The dtypes carried are
``dtypes.COLLECTIVE_DTYPES`` (bool, integers, floats, complex); bools reduce with MPI's LOR / LAND as NumPy's
add, maximum and minimum of bools do (``communicator.mpi_op``). Any other dtype, and a complex max or min, is
refused at bind with TypeError "not supported: <kind> of <dtype> (...)", before any MPI call, on every rank alike.
"""
from __future__ import annotations

import os
import weakref
from functools import partial

import numpy as np
from mpi4py import MPI

from spmd_runtime.collective_kinds import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALLV, BROADCAST,
                                           COLLECTIVE_PERMUTE, FLOAT32, KINDS, REDUCE_SCATTER)
from spmd_runtime.comm import low_precision, watchdog
from spmd_runtime.comm.communicator import mpi_op
from spmd_runtime.dtypes import collective_refusal, is_low_precision

PERSISTENT_ENV = "SPMD_PERSISTENT"
# MPICH runs a persistent collective with its nonblocking algorithms: a blocking reduce-scatter of 1 MiB took
# 1.7-1.9x the plain call with them (2 ranks, MPICH 5.0.2; all-reduces of 64 KiB-4 MiB were no slower), and a
# large message gains nothing from skipping per-call setup, so blocking reductions above this size keep the
# plain call. Moves (all-gather, all-to-all, permute) and nonblocking calls: no size measured was slower
# (scripts/bench_collectives.py, docs/BENCHMARKS.md).
PERSISTENT_REDUCTION_MAX = 64 << 10
# A nonblocking reduce-scatter on host buffers runs the BLOCKING call at its start (its done only hands over the
# result): MPICH's nonblocking algorithm took 4-9x the blocking call from 512 KiB to 1.5 MiB at 2 ranks (1.0
# from 2 MiB; 1.2-2x at 4 ranks; MPICH 5.0.2, quiet machine: docs/BENCHMARKS.md, issue 27), the
# sizes of a small model's gradient shards, and a host rank's nonblocking call progresses only inside its own MPI
# calls (no progress thread), so the start/done pair hid nothing there. Device buffers keep the nonblocking call.
_REDUCTIONS = ("Allreduce", "Reduce_scatter_block")


def persistent_enabled() -> bool:
    """Whether bindings may use persistent requests (``$SPMD_PERSISTENT``, default on). Every rank must agree:
    persistent collectives match only persistent ones (exec/runner.py checks it before each run)."""
    return os.environ.get(PERSISTENT_ENV, "1").strip() != "0"


def all_reduce(mc, x, axes, op: str = "sum"):
    """Elementwise ``op`` ('sum' | 'max' | 'min' | 'prod') of ``x`` over the group; same shape as ``x``.

    Wire bytes: 2 (k-1)/k * S.
    """
    return _bind_fresh(mc, ALL_REDUCE, x, axes=axes, op=op)(x)


def all_gather(mc, x, axes, dim: int):
    """The group's ``x`` concatenated along ``dim`` in shard order: ``shape[dim]`` grows k times.

    Wire bytes: (k-1)/k * S_out.
    """
    return _bind_fresh(mc, ALL_GATHER, x, axes=axes, dim=dim)(x)


def reduce_scatter(mc, x, axes, dim: int, op: str = "sum"):
    """Block ``index_along(axes)`` along ``dim`` of the group's elementwise ``op``: ``shape[dim]`` shrinks k times.

    Wire bytes: (k-1)/k * S_in.
    """
    return _bind_fresh(mc, REDUCE_SCATTER, x, axes=axes, dim=dim, op=op)(x)


def all_to_all(mc, x, axes, split_dim: int, concat_dim: int):
    """Split ``x`` into k blocks along ``split_dim``; block j goes to shard j; the received
    blocks are concatenated along ``concat_dim`` in source shard order.

    Resharding use: an array sharded on ``concat_dim`` over ``axes`` becomes sharded on ``split_dim``.
    Wire bytes: (k-1)/k * S.
    """
    return _bind_fresh(mc, ALL_TO_ALL, x, axes=axes, split_dim=split_dim, concat_dim=concat_dim)(x)


def collective_permute(mc, x, pairs):
    """Each (source, dest) pair of world ranks sends the source's ``x`` to dest.

    Returns what this rank receives, or zeros shaped like ``x`` when no pair
    targets it (XLA semantics). Sources and destinations must each be unique.
    One Sendrecv per rank (MPI_PROC_NULL for a missing partner) cannot deadlock.
    Wire bytes: S.
    """
    return _bind_fresh(mc, COLLECTIVE_PERMUTE, x, pairs=pairs)(x)


def broadcast(mc, x, axes, root: int = 0):
    """Every rank of the group gets the ``x`` of the group's rank ``root`` (its shard number along ``axes``);
    same shape as ``x``. One MPI Bcast on the axes' sub-communicator.

    Wire bytes: S (a pipelined broadcast forwards the whole buffer once per rank).
    """
    return _bind_fresh(mc, BROADCAST, x, axes=axes, root=root)(x)


def bind(mc, kind, xp, shape, dtype, *, reuse: bool = True, in_place: bool = False, nonblocking: bool = False,
         operand=None, **attrs):
    """``f(x)`` running collective ``kind`` (a kind of ``collective_kinds.KINDS`` or its name) with ``attrs`` on
    ``xp`` arrays of ``shape``/``dtype``; see the module doc. ``nonblocking``: ``start(x) -> Pending`` instead.
    ``operand``: the array ``x`` will be at every call, for persistent requests (module doc).

    Collective on first use of a new axes tuple (the sub-communicator split), like every collective.
    """
    spec = KINDS.get(getattr(kind, "name", kind))
    if spec not in _BINDERS:
        raise ValueError(f"collective kind must be one of {sorted(k.name for k in _BINDERS)}; got {kind!r}")
    _refuse_dtype(spec.name, dtype, attrs.get("op"))
    what = f"{spec.name} over mesh axes {attrs.get('axes', 'of the permute pairs')}"
    if is_low_precision(dtype):  # 16-bit floats: moved as uint16, reduced in float32 (low_precision.py)
        if nonblocking and spec.sixteen_bit == FLOAT32:  # several collectives: blocking at the start
            run = bind(mc, kind, xp, shape, dtype, reuse=reuse, in_place=in_place, **attrs)
            return lambda x: Pending((), run(x), None, what)
        return low_precision.bind(bind, mc, spec, xp, tuple(shape), np.dtype(dtype), reuse=reuse,
                                  nonblocking=nonblocking, **attrs)
    if nonblocking and spec is REDUCE_SCATTER and xp is np:  # MPICH's nonblocking algorithm: blocking at the start
        run = bind(mc, kind, xp, shape, dtype, reuse=reuse, in_place=in_place, operand=operand, **attrs)

        def start_blocking(x):
            return Pending((), run(x), None, what)
        start_blocking.persistent_requests = getattr(run, "persistent_requests", [])  # what ``release`` frees
        return start_blocking
    plan = _Plan(mc, xp, tuple(shape), np.dtype(dtype), reuse, nonblocking, what, operand)
    run = _BINDERS[spec](plan, in_place=in_place, **attrs)
    return plan.starter(run) if nonblocking and not plan.starts_itself else run


class Pending:
    """An issued nonblocking collective: its MPI requests and the result they fill (read it after ``wait``).
    Holds the operand too: MPI reads the send buffer until the requests complete."""

    __slots__ = ("requests", "value", "operand", "what", "comm", "finish")

    def __init__(self, requests, value, operand, what: str, comm=None, finish=()):
        self.requests, self.value, self.operand, self.what = requests, value, operand, what
        self.comm = comm  # whose members the wait needs (the watchdog's peers); None: every rank
        self.finish = finish  # run once the requests are complete: a staged receive's copy to the device

    def __repr__(self):
        return f"Pending({self.what}, {len(self.requests)} request(s))"

    def test(self) -> bool:
        """One MPI_Test: drives MPI's progress engine (all in-flight operations, not just this one)."""
        return self.requests[0].Test() if self.requests else True

    @watchdog.collective(lambda frame: f"MPI Wait for the {frame.f_locals['self'].what}",
                         peers=lambda frame: frame.f_locals["self"].comm)
    def wait(self):
        for request in self.requests:
            request.Wait()
        for finish in self.finish:
            finish()
        value = self.value
        return value.result() if isinstance(value, _After) else value


class _After:
    """A result computed from a receive buffer once it is complete (a copying layout move)."""

    __slots__ = ("post", "recv")

    def __init__(self, post, recv):
        self.post, self.recv = post, recv

    def result(self):
        return self.post(self.recv)


def _refuse_dtype(kind: str, dtype, op=None) -> None:
    """Raise TypeError "not supported: ..." for a dtype the collective cannot carry or reduce with ``op``
    (dtypes.collective_refusal): at bind, before any MPI call and whatever the group size, so every rank
    binding the same program raises alike."""
    refusal = collective_refusal(kind, dtype, op)
    if refusal is not None:
        raise TypeError(refusal)


def _bind_fresh(mc, kind, x, **attrs):
    return bind(mc, kind, mc.transport.array_module(x), x.shape, x.dtype, reuse=False, **attrs)


class _Plan:
    """What every binder needs: the array module, the shapes, and buffers made once (reuse) or per call."""

    def __init__(self, mc, xp, shape, dtype, reuse, nonblocking=False, what="", operand=None):
        self.mc, self.xp, self.shape, self.dtype, self.reuse = mc, xp, shape, dtype, reuse
        self.operand = operand  # the array every call's operand will be (persistent requests), or None
        self.host, self.nonblocking, self.issued, self.what = xp is np, nonblocking, [], what
        self.finishers: list = []  # what a nonblocking device call completes at the wait (``Transport.start``)
        self.comm = None  # the communicator the nonblocking calls went to (a Pending's peers)
        self.starts_itself = False  # the binder returned ``start(x) -> Pending`` itself (``_direct``)

    def method(self, comm, name: str):
        """``comm``'s MPI collective ``name``; nonblocking plans call its ``I`` variant and keep the request."""
        if not self.nonblocking:
            return getattr(comm, name)
        start, issued = getattr(comm, "I" + name[0].lower() + name[1:]), self.issued
        self.comm = comm
        return lambda *args: issued.append(start(*args))

    def sendrecv(self, comm):
        """``f(send, dest, recv, source)``: one Sendrecv, or (nonblocking) an Irecv and an Isend, tag 0."""
        if not self.nonblocking:
            sendrecv = comm.Sendrecv
            return lambda s, dest, r, source: sendrecv(s, dest, 0, r, source, 0)
        irecv, isend, issued, null = comm.Irecv, comm.Isend, self.issued, MPI.PROC_NULL
        self.comm = comm

        def post(s, dest, r, source):
            if source != null:
                issued.append(irecv(r, source, 0))
            if dest != null:
                issued.append(isend(s, dest, 0))
        return post

    def after(self, post):
        """``post`` for a layout move that reads the received data: deferred to the wait when nonblocking."""
        return (lambda recv: _After(post, recv)) if self.nonblocking else post

    def starter(self, run):
        """``start(x) -> Pending`` from a binder's ``run`` whose MPI calls left their requests in ``issued``."""
        issued, finishers, plan, what = self.issued, self.finishers, self, self.what

        def start(x):
            value = run(x)
            requests, finish = tuple(issued), tuple(finishers)
            issued.clear()
            finishers.clear()
            return Pending(requests, value, x, what, plan.comm, finish)
        return start

    def direct(self) -> bool:
        """Host buffers kept across calls: the binder may call MPI on them with nothing between (``_direct``)."""
        return self.host and self.reuse

    def persistent(self, comm, name: str):
        """``comm``'s MPI-4 ``<name>_init`` when this binding may use a persistent request, else None: host
        buffers (the binders call it only with a kept receive buffer or in place), the operand's array known
        (``bind(operand=...)``), C-ordered and of the bound layout."""
        operand = self.operand
        if (operand is None or not self.host or not persistent_enabled()
                or not isinstance(operand, np.ndarray) or not operand.flags.c_contiguous
                or operand.shape != self.shape or operand.dtype != self.dtype):
            return None
        if not self.nonblocking and name in _REDUCTIONS and operand.nbytes > PERSISTENT_REDUCTION_MAX:
            return None
        return getattr(comm, name + "_init", None)

    def buffer(self, shape):
        """A zero-argument maker of a receive buffer: the same one every call when reusing."""
        xp, dtype = self.xp, self.dtype
        if self.reuse:
            held = xp.empty(shape, dtype)
            return lambda: held
        return lambda: xp.empty(shape, dtype)

    def mpi(self, call):
        """``call(send, recv)`` on MPI-readable buffers: direct for host arrays, else through the Transport (a
        nonblocking call: ``Transport.start`` with staging buffers of this binding's own, its completion kept
        for the ``Pending``)."""
        if self.host:
            return call
        transport = self.mc.transport
        if not self.nonblocking:
            run = transport.run
            return lambda send, recv: run(call, send, recv)
        start, finishers, staging = transport.start, self.finishers, {}

        def post(send, recv):
            finish = start(call, send, recv, staging)
            if finish is not None:
                finishers.append(finish)
        return post

    def contiguous(self):
        """``x`` as a C-contiguous array of its shape (F-ordered buffers would pass MPI's buffer check)."""
        if not self.host:
            xp = self.xp
            return lambda x: _contiguous(xp, x)
        return _host_contiguous


def _bind_all_reduce(plan, in_place, axes, op="sum"):
    mop, k = mpi_op(op, plan.dtype, ALL_REDUCE.name), plan.mc.axis_size(axes)  # refused even where k == 1
    if k == 1:
        return _same if in_place else _copy
    if in_place and plan.host:  # into the operand: no receive buffer to keep
        return _direct(plan, plan.mc.sub(axes), "Allreduce", None, mop)
    if plan.direct():  # the interpreter's case
        return _direct(plan, plan.mc.sub(axes), "Allreduce", plan.buffer(plan.shape)(), mop)
    allreduce, contiguous = plan.method(plan.mc.sub(axes), "Allreduce"), plan.contiguous()
    call, recv_buffer = plan.mpi(lambda s, r: allreduce(s, r, mop)), plan.buffer(plan.shape)

    def run(x):
        recv = recv_buffer()
        call(contiguous(x), recv)
        return recv
    return run


def _bind_all_gather(plan, in_place, axes, dim):
    shape, xp, k = plan.shape, plan.xp, plan.mc.axis_size(axes)
    dim = _normalize_dim(dim, len(shape), f"{ALL_GATHER.name} dim")
    if k == 1:
        return _copy
    front = _front_shape(shape, dim)
    recv_buffer = plan.buffer((k * front[0],) + front[1:])
    if dim == 0 and plan.direct():
        return _direct(plan, plan.mc.sub(axes), "Allgather", recv_buffer())
    call, to_front = plan.mpi(plan.method(plan.mc.sub(axes), "Allgather")), _to_front_fn(plan, dim, front)

    def run(x):
        recv = recv_buffer()
        call(to_front(x), recv)
        return recv if dim == 0 else xp.moveaxis(recv, 0, dim)
    return run


def _bind_reduce_scatter(plan, in_place, axes, dim, op="sum"):
    shape, xp, k = plan.shape, plan.xp, plan.mc.axis_size(axes)
    dim = _normalize_dim(dim, len(shape), f"{REDUCE_SCATTER.name} dim")
    _check_divisible(shape, dim, k, REDUCE_SCATTER.name)
    mop = mpi_op(op, plan.dtype, REDUCE_SCATTER.name)
    if k == 1:
        return _copy
    front = _front_shape(shape, dim)
    recv_buffer = plan.buffer((front[0] // k,) + front[1:])
    if dim == 0 and plan.direct():
        return _direct(plan, plan.mc.sub(axes), "Reduce_scatter_block", recv_buffer(), mop)
    reduce_scatter_block = plan.method(plan.mc.sub(axes), "Reduce_scatter_block")
    to_front = _to_front_fn(plan, dim, front)
    call = plan.mpi(lambda s, r: reduce_scatter_block(s, r, mop))

    def run(x):
        recv = recv_buffer()
        call(to_front(x), recv)
        return recv if dim == 0 else xp.moveaxis(recv, 0, dim)
    return run


def _bind_all_to_all(plan, in_place, axes, split_dim, concat_dim):
    shape, xp, k = plan.shape, plan.xp, plan.mc.axis_size(axes)
    split_dim = _normalize_dim(split_dim, len(shape), f"{ALL_TO_ALL.name} split_dim")
    concat_dim = _normalize_dim(concat_dim, len(shape), f"{ALL_TO_ALL.name} concat_dim")
    _check_divisible(shape, split_dim, k, ALL_TO_ALL.name)
    if k == 1:
        return _copy
    # (..., k, n/k, ...) with the block index in front: send[j] is block j, contiguous (x itself at split_dim 0).
    blocked = shape[:split_dim] + (k, shape[split_dim] // k) + shape[split_dim + 1:]
    send_shape = _front_shape(blocked, split_dim)
    block = send_shape[1:]
    merged = block[:concat_dim] + (k * block[concat_dim],) + block[concat_dim + 1:]
    if split_dim == 0 and concat_dim == 0 and plan.direct():
        return _direct(plan, plan.mc.sub(axes), "Alltoall", plan.buffer(merged)())
    call = plan.mpi(plan.method(plan.mc.sub(axes), "Alltoall"))
    if split_dim == 0:
        to_send = plan.contiguous()
    else:
        blocks_to_front = _to_front_fn(plan, split_dim, send_shape)
        to_send = lambda x: blocks_to_front(x.reshape(blocked))
    # recv[i] came from shard i: merge the source index into concat_dim, major (at 0: the buffer's own layout).
    if concat_dim == 0:
        recv_buffer, merge = plan.buffer(merged), _same
    else:
        recv_buffer = plan.buffer(send_shape)
        merge = plan.after(lambda recv: xp.moveaxis(recv, 0, concat_dim).reshape(merged))

    def run(x):
        recv = recv_buffer()
        call(to_send(x), recv)
        return merge(recv)
    return run


def _bind_collective_permute(plan, in_place, pairs):
    mc, xp, shape, dtype = plan.mc, plan.xp, plan.shape, plan.dtype
    dest, source = _permute_partners(pairs, mc.rank, mc.mesh.size)
    if source == mc.rank:
        return _copy
    if source is None and dest is None:
        return lambda x: xp.zeros(shape, dtype)
    to_peer, from_peer = _peer(dest), _peer(source)
    if plan.direct() and source is not None:
        return _permute_direct(plan, mc.comm, to_peer, from_peer, plan.buffer(shape)())
    sendrecv, contiguous = plan.sendrecv(mc.comm), plan.contiguous()
    if source is None:  # nothing arrives: fresh zeros (a reused buffer could have been written in place)
        call = plan.mpi(lambda s, r: sendrecv(s, to_peer, None, from_peer))
        return lambda x: (call(contiguous(x), None), xp.zeros(shape, dtype))[1]
    call, recv_buffer = plan.mpi(lambda s, r: sendrecv(s, to_peer, r, from_peer)), plan.buffer(shape)
    if dest is None:
        def receive_only(x):
            recv = recv_buffer()
            call(None, recv)
            return recv
        return receive_only

    def run(x):
        recv = recv_buffer()
        call(contiguous(x), recv)  # fully overwritten: no memset
        return recv
    return run


def _bind_broadcast(plan, in_place, axes, root=0):
    """The group's rank ``root`` sends a copy of its ``x`` (the result is a buffer of its own) and every other
    rank receives it: one MPI ``Bcast`` (nonblocking: ``Ibcast``) on the axes' sub-communicator."""
    k = plan.mc.axis_size(axes)
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < k:
        raise ValueError(f"{BROADCAST.name} root must be a rank of the group, in [0, {k}); got {root!r}")
    if k == 1:
        return _copy
    root, buffer = int(root), plan.buffer(plan.shape)
    bcast = plan.method(plan.mc.sub(axes), "Bcast")
    if plan.mc.index_along(axes) != root:
        receive_into = plan.mpi(lambda s, r: bcast(r, root))

        def receive(x):
            recv = buffer()
            receive_into(None, recv)
            return recv
        return receive
    send_from = plan.mpi(lambda s, r: bcast(s, root))
    own_copy = partial(_copy_into, buffer) if plan.host else _copy

    def send(x):
        out = own_copy(x)
        send_from(out, None)
        return out
    return send


def _copy_into(buffer, x):
    out = buffer()
    np.copyto(out, x)
    return out


def _direct(plan, comm, name: str, recv, op=None):
    """A host collective whose receive buffer ``recv`` is kept across calls (the interpreter's case): one Python
    frame per call around MPI ``name(send, recv[, op])`` on ``comm``, what raw mpi4py pays (the op is passed
    positionally: a ``*args`` call costs more than the contiguity check); nonblocking: ``start(x) -> Pending``
    around its ``I`` variant, the handle kept like ``recv`` (one call in flight per binding). ``recv`` None:
    reduced into the operand (``MPI.IN_PLACE``)."""
    init = plan.persistent(comm, name)
    if init is not None:
        return _persistent(plan, comm, init, recv, op)
    contiguous, in_place = _host_contiguous, MPI.IN_PLACE
    if not plan.nonblocking:
        call = getattr(comm, name)

        def run_in_place(x):
            x = x if x.flags.c_contiguous else contiguous(x)  # strided: copied once, then reduced in place
            call(in_place, x, op)
            return x

        def run_reduce(x):
            call(x if x.flags.c_contiguous else contiguous(x), recv, op)
            return recv

        def run_move(x):
            call(x if x.flags.c_contiguous else contiguous(x), recv)
            return recv
        return run_in_place if recv is None else run_move if op is None else run_reduce
    plan.starts_itself, start = True, getattr(comm, "I" + name[0].lower() + name[1:])
    pending = Pending((), recv, None, plan.what, comm)

    def start_in_place(x):
        pending.value = pending.operand = x = x if x.flags.c_contiguous else contiguous(x)
        pending.requests = (start(in_place, x, op),)
        return pending

    def start_reduce(x):
        pending.operand = send = x if x.flags.c_contiguous else contiguous(x)  # MPI reads it until the wait
        pending.requests = (start(send, recv, op),)
        return pending

    def start_move(x):
        pending.operand = send = x if x.flags.c_contiguous else contiguous(x)
        pending.requests = (start(send, recv),)
        return pending
    return start_in_place if recv is None else start_move if op is None else start_reduce


def _persistent(plan, comm, init, recv, op=None):
    """``_direct`` over one persistent request made here by ``init`` on the operand's array and ``recv`` (None:
    reduced in place into the operand): a call is ``Start`` + ``Wait``, or ``Start`` and a kept ``Pending``."""
    operand = plan.operand
    args = (MPI.IN_PLACE, operand) if recv is None else (operand, recv)
    request = init(*args) if op is None else init(*args, op)
    return _started(plan, comm, (request,), operand, operand if recv is None else recv)


def _started(plan, comm, requests, operand, value):
    """A binding that starts the persistent ``requests`` (set up on ``operand``) each call and gives ``value``;
    an ``x`` in another array is copied into ``operand`` first (its planned buffer: the operand's own while it
    lives). ``release`` frees the requests, or the binding's collection does."""
    copyto, requests = np.copyto, list(requests)
    if len(requests) == 1:  # bound methods, no Python frame between us and MPI
        start, wait = requests[0].Start, requests[0].Wait
    else:
        start, wait = partial(MPI.Prequest.Startall, requests), partial(MPI.Request.Waitall, requests)
    if not plan.nonblocking:
        def run_persistent(x):
            if x is not operand:
                copyto(operand, x)
            start()
            wait()
            return value
        bound = run_persistent
    else:
        plan.starts_itself = True
        pending = Pending(tuple(requests), value, operand, plan.what, comm)

        def start_persistent(x):
            if x is not operand:
                copyto(operand, x)
            start()
            return pending
        bound = start_persistent
    bound.persistent_requests = requests  # what it starts: ``release`` frees them
    weakref.finalize(bound, _free_requests, requests)  # a binding dropped unreleased frees them when collected
    return bound


def release(bound) -> None:
    """Free the MPI-4 persistent requests a bound collective holds, now (a local call; the binding must not be
    called again). The interpreter releases its bindings when its runtime drops it; other bindings free theirs
    when garbage-collected."""
    _free_requests(getattr(bound, "persistent_requests", ()))


def _free_requests(requests) -> None:
    """Free persistent requests not freed yet, unless MPI has already finalized (it freed them then)."""
    if MPI.Is_finalized():
        return
    for request in requests:
        if request:
            request.Free()


def _permute_direct(plan, comm, to_peer, from_peer, recv):
    """``_direct`` for a permute that receives into the kept ``recv``: one Sendrecv (or an Irecv and an Isend)
    from one Python frame; no send when ``to_peer`` is MPI_PROC_NULL."""
    if plan.persistent(comm, "Send") is not None:  # Send_init + Recv_init on the operand and ``recv``
        operand = plan.operand
        requests = [comm.Recv_init(recv, from_peer, 0)]
        if to_peer != MPI.PROC_NULL:
            requests.append(comm.Send_init(operand, to_peer, 0))
        return _started(plan, comm, requests, operand, recv)
    contiguous = _host_contiguous
    if not plan.nonblocking:
        sendrecv = comm.Sendrecv

        def run_direct(x):
            sendrecv(x if x.flags.c_contiguous else contiguous(x), to_peer, 0, recv, from_peer, 0)
            return recv  # fully overwritten: no memset

        def receive_direct(x):
            sendrecv(None, to_peer, 0, recv, from_peer, 0)
            return recv
        return receive_direct if to_peer == MPI.PROC_NULL else run_direct
    plan.starts_itself, irecv, isend = True, comm.Irecv, comm.Isend
    pending = Pending((), recv, None, plan.what, comm)  # kept, like `recv`: one call in flight per binding

    def start_direct(x):
        pending.operand = send = x if x.flags.c_contiguous else contiguous(x)
        pending.requests = (irecv(recv, from_peer, 0), isend(send, to_peer, 0))
        return pending

    def start_receive(x):
        pending.requests = (irecv(recv, from_peer, 0),)
        return pending
    return start_receive if to_peer == MPI.PROC_NULL else start_direct


# Their closures call MPI (the binders' own closures are marked by exec/runner.py): the watchdog names them.
for _maker in (_direct, _permute_direct, _started):
    watchdog.collective_closures(_maker, lambda frame: "an MPI collective")


# Every kind of the table but the exchange (all_to_allv, below) has its binder here (tests/comm checks it).
_BINDERS = {ALL_REDUCE: _bind_all_reduce, ALL_GATHER: _bind_all_gather, REDUCE_SCATTER: _bind_reduce_scatter,
            ALL_TO_ALL: _bind_all_to_all, COLLECTIVE_PERMUTE: _bind_collective_permute, BROADCAST: _bind_broadcast}
for _binder in _BINDERS.values():  # bound collectives call MPI from closures made at bind time
    watchdog.collective_closures(_binder, lambda frame: "an MPI collective")


def _peer(rank):
    # MPI_PROC_NULL turns a send or receive into a no-op, so a rank without a partner still takes part.
    return MPI.PROC_NULL if rank is None else rank


def _same(x):
    return x


def _copy(x):
    return x.copy()


def all_to_allv(mc, x, *into, sends, recvs, out_shape, fill=0):
    """A block exchange: round s sends ``x[slices]`` of ``sends[s]`` to its peer and writes what arrives from the
    peer of ``recvs[s]`` into its slices of an ``out_shape`` array of ``fill``, or of a copy of ``into[0]`` when
    given (the operands of a concatenation land one after another), None slices: nothing that round.
    Round 0 is this rank itself (a local copy). Both sides of a round know the piece, so a rank skips a partner
    that has nothing for it; one Sendrecv per round cannot deadlock.
    Wire bytes: the sum of the pieces sent to other ranks. 16-bit floats travel as uint16 (MPI has no bfloat16
    datatype); a dtype no collective carries is refused before any round (one lookup per call: the exchange is
    not bound once, exec/rules/spmd.py resolves only its table).
    """
    _refuse_dtype(ALL_TO_ALLV.name, x.dtype)
    xp, dtype = mc.transport.array_module(x), x.dtype
    wire = low_precision.WIRE if is_low_precision(dtype) else dtype
    out = into[0].copy() if into else xp.full(tuple(out_shape), fill, dtype)
    (_, mine), (_, here) = sends[0], recvs[0]
    if mine is not None:
        out[here] = x[mine]
    for (dest, send_sl), (source, recv_sl) in zip(sends[1:], recvs[1:]):
        if send_sl is None and recv_sl is None:
            continue
        send = None if send_sl is None else xp.ascontiguousarray(x[send_sl]).view(wire)
        recv = None if recv_sl is None else xp.empty(out[recv_sl].shape, wire)
        mc.transport.run(lambda s, r: mc.Sendrecv(s, None if s is None else dest, r, None if r is None else source),
                         send, recv)
        if recv is not None:
            out[recv_sl] = recv.view(dtype)
    return out


def _permute_partners(pairs, rank: int, world_size: int) -> tuple[int | None, int | None]:
    """(where this rank sends, where it receives from), None when it has no partner. One pass: it runs every call."""
    dest = source = None
    sources, dests = set(), set()
    for s, d in pairs:
        if s in sources or d in dests or not (0 <= s < world_size and 0 <= d < world_size):
            raise ValueError(
                f"{COLLECTIVE_PERMUTE.name} pairs must have unique sources and unique destinations, all ranks in "
                f"[0, {world_size}); got pairs {list(pairs)}"
            )
        sources.add(s)
        dests.add(d)
        dest = d if s == rank else dest
        source = s if d == rank else source
    return dest, source


def _contiguous(xp, x):
    # ascontiguousarray returns ndim >= 1: a 0-d array would come back with shape (1,).
    c = xp.ascontiguousarray(x)
    return c if c.shape == x.shape else c.reshape(x.shape)


def _host_contiguous(x):
    if x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(x).reshape(x.shape)  # 0-d arrays are contiguous: never reshaped from (1,)


def _front_shape(shape, dim: int) -> tuple:
    return (shape[dim],) + shape[:dim] + shape[dim + 1:]


def _to_front_fn(plan, dim: int, front):
    """``x -> x`` with ``dim`` moved to axis 0, C-contiguous: free at dim 0, else one copy into a send buffer
    (kept across calls when reusing; np.moveaxis's argument checks are paid here, not per call)."""
    if dim == 0:
        return plan.contiguous()
    xp = plan.xp
    if not plan.host:
        return lambda x: xp.ascontiguousarray(xp.moveaxis(x, dim, 0))
    send_buffer, perm = plan.buffer(front), (dim,) + tuple(d for d in range(len(front)) if d != dim)

    def to_front(x):
        send = send_buffer()
        xp.copyto(send, x.transpose(perm))
        return send
    return to_front


def _normalize_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what} must be in [-{ndim}, {ndim}) for a rank-{ndim} array; got {dim}")
    return dim % ndim


def _check_divisible(shape, dim: int, k: int, what: str) -> None:
    if shape[dim] % k:
        raise ValueError(
            f"{what} needs the size of dim {dim} divisible by the group size {k}; got shape {tuple(shape)}"
        )


__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute", "broadcast", "all_to_allv",
           "Pending", "release"]
