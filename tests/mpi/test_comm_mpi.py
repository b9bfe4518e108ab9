"""The communication layer under real MPI, for any world size.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi -p no:cacheprovider``.
Meshes come from the world size at collection time, so every rank collects the
same tests in the same order. Each rank computes every rank's local data
itself (seeded by rank) and checks its own results against NumPy on that
global data; assertions come after all collectives so a failure on one rank
cannot leave the others waiting.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.comm import (
    MeshCommunicator,
    collectives,
    Transport,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective_permute,
    reduce_scatter,
)
from spmd_runtime.comm import testing as ref
from spmd_runtime.comm.testing import HostDeviceArray, HostDeviceModule, HostDeviceOps
from mesh_cases import axes_choices, meshes_for

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
MESHES = meshes_for(WORLD.Get_size())
CASES = [pytest.param(m, axes, id=f"{m}-{'.'.join(axes) or 'none'}") for m in MESHES for axes in axes_choices(m)]
DTYPES = (np.float32, np.float64, np.int64)


def local_arrays(mesh, shape, dtype, seed=0):
    # Small integers: float sums are exact whatever order MPI reduces in.
    return [np.random.default_rng([seed, r]).integers(-50, 50, shape).astype(dtype) for r in range(mesh.size)]


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)


@pytest.fixture
def make_mc():
    """MeshCommunicators on COMM_WORLD, freed after the test."""
    made = []

    def make(mesh, **kwargs):
        made.append(MeshCommunicator(mesh, **kwargs))
        return made[-1]

    yield make
    for mc in made:
        mc.free()


def test_world_meshes_cover_the_world(world_meshes):
    assert [str(m) for m in world_meshes] == [str(m) for m in MESHES]
    assert all(m.size == WORLD.Get_size() for m in world_meshes)


@pytest.mark.parametrize("mesh, axes", CASES)
def test_collectives_match_numpy(mesh, axes, make_mc):
    mc, k, rank = make_mc(mesh), mesh.axis_size(axes), WORLD.Get_rank()
    checks = []  # (got, expected) pairs, asserted after every collective ran
    for dtype in DTYPES:
        xs = local_arrays(mesh, (2 * k, k, 3 * k), dtype)
        x = xs[rank]
        for op in ("sum", "max", "min"):
            checks.append((all_reduce(mc, x, axes, op), ref.reference_all_reduce(mesh, xs, rank, axes, op)))
        small = [np.sign(a) * (np.abs(a) % 3) for a in xs]  # |products| <= 2^8: exact in any order, as the sums
        checks.append((all_reduce(mc, small[rank], axes, "prod"),
                       ref.reference_all_reduce(mesh, small, rank, axes, "prod")))
        for dim in (0, 1, -1):
            checks.append((all_gather(mc, x, axes, dim), ref.reference_all_gather(mesh, xs, rank, axes, dim)))
            checks.append((reduce_scatter(mc, x, axes, dim, "sum"),
                           ref.reference_reduce_scatter(mesh, xs, rank, axes, dim, "sum")))
        for split, concat in ((0, 0), (0, 2), (2, 0), (1, 2), (-1, 1)):
            checks.append((all_to_all(mc, x, axes, split, concat),
                           ref.reference_all_to_all(mesh, xs, rank, axes, split, concat)))
    scalars = [np.array(float(r + 1)) for r in range(mesh.size)]  # 0-d arrays keep shape ()
    checks.append((all_reduce(mc, scalars[rank], axes, "max"), ref.reference_all_reduce(mesh, scalars, rank, axes, "max")))
    for got, expected in checks:
        assert got.shape == expected.shape
        assert_same(got, expected)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_sub_communicators_follow_mesh_groups(mesh, make_mc):
    mc, rank = make_mc(mesh), WORLD.Get_rank()
    for axes in axes_choices(mesh):
        sub = mc.sub(axes)
        members = ref.group_members(mesh, rank, axes)
        assert mc.sub(axes) is sub  # cached: a second Split would be a collective every rank must join
        assert (sub.Get_rank(), sub.Get_size(), sub.allgather(rank)) == (members.index(rank), len(members), members)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_collective_permute(mesh, make_mc):
    mc, rank, n = make_mc(mesh), WORLD.Get_rank(), mesh.size
    xs = local_arrays(mesh, (3, 4), np.float64)
    cases = [[(r, (r + 1) % n) for r in range(n)], [], [(0, 0)], [(n - 1, 0)], [(r, n - 1 - r) for r in range(n // 2)]]
    cases += [[(g[i], g[(i + 1) % len(g)]) for g in mesh.groups(axes) for i in range(len(g))]
              for axes in axes_choices(mesh)[1:]]
    results = [collective_permute(mc, xs[rank], pairs) for pairs in cases]
    for pairs, got in zip(cases, results):
        assert_same(got, ref.reference_permute(xs, rank, pairs))


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("mesh, axes", CASES)
def test_broadcast_equals_raw_mpi4py_bcast(mesh, axes, nonblocking, make_mc):
    """The broadcast kind (added through the kinds table) from every root of the group: the one-shot function
    and the bound call (kept buffers; nonblocking: Ibcast) equal raw mpi4py Bcast on the axes' sub-communicator."""
    mc, k, rank = make_mc(mesh), mesh.axis_size(axes), WORLD.Get_rank()
    sub = mc.sub(axes)
    checks = []
    for dtype in DTYPES:
        xs = local_arrays(mesh, (3, 4), dtype)
        bound = collectives.bind(mc, "broadcast", np, (3, 4), dtype, nonblocking=nonblocking, axes=axes)
        for root in range(k):
            raw = xs[rank].copy()
            sub.Bcast(raw, root=root)
            checks.append((broadcast(mc, xs[rank], axes, root), raw))
        got = bound(xs[rank])
        raw = xs[rank].copy()
        sub.Bcast(raw, root=0)
        checks.append(((got.wait() if nonblocking else got).copy(), raw))
    for got, expected in checks:
        assert_same(got, expected)


def test_agree_raises_on_every_rank(make_mc):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    mc = make_mc(MESHES[0])
    mc.agree(None)
    failing = sorted({0, n - 1})
    with pytest.raises(RuntimeError, match=re.escape(f"rank(s) {failing}")) as info:
        mc.agree(f"bad input on {rank}" if rank in failing else None)
    # one failing rank: its message as is (the rank is in "rank(s) [0]"); several: each prefixed by its rank
    prefix = (lambda r: f"rank {r}: ") if len(failing) > 1 else (lambda r: "")
    assert all(f"{prefix(r)}bad input on {r}" in str(info.value) for r in failing)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_device_arrays(cuda_aware, make_mc):
    # HostDeviceArray exposes only __cuda_array_interface__, so in the direct
    # path mpi4py takes the CUDA array interface route with host memory.
    mesh, rank = MESHES[-1], WORLD.Get_rank()
    axes = mesh.axis_names[::-1]
    k = mesh.axis_size(axes)
    xs = local_arrays(mesh, (2 * k, 3 * k), np.float32)
    events = []
    mc = make_mc(mesh, transport=Transport(cuda_aware=cuda_aware, device_ops=HostDeviceOps(events)))
    x = HostDeviceArray(xs[rank])
    pairs = [(r, (r + 1) % mesh.size) for r in range(mesh.size)]
    got = [all_reduce(mc, x, axes, "sum"), all_gather(mc, x, axes, 1), reduce_scatter(mc, x, axes, 0, "max"),
           all_to_all(mc, x, axes, 0, 1), collective_permute(mc, x, pairs)]
    expected = [ref.reference_all_reduce(mesh, xs, rank, axes, "sum"),
                ref.reference_all_gather(mesh, xs, rank, axes, 1),
                ref.reference_reduce_scatter(mesh, xs, rank, axes, 0, "max"),
                ref.reference_all_to_all(mesh, xs, rank, axes, 0, 1), ref.reference_permute(xs, rank, pairs)]
    for g, e in zip(got, expected):
        assert isinstance(g, HostDeviceArray)
        assert_same(g.get(), e)
    moved = mesh.size > 1
    assert events.count("sync") == (5 if moved else 0)
    assert ("to_host" in events) == (moved and not cuda_aware)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_nonblocking_collectives_on_device_arrays(cuda_aware, make_mc):
    """Bound nonblocking collectives on (host-backed) device arrays under real MPI: the start posts MPI's
    nonblocking call, two bindings in flight at once, and every result is right after the waits."""
    mesh, rank = MESHES[-1], WORLD.Get_rank()
    axes = mesh.axis_names[::-1]
    k = mesh.axis_size(axes)
    shape = (2 * k, 3 * k)
    mc = make_mc(mesh, transport=Transport(cuda_aware=cuda_aware, device_ops=HostDeviceOps()))
    pairs = [(r, (r + 1) % mesh.size) for r in range(mesh.size)]
    cases = [("all_reduce", {"axes": axes, "op": "sum"}, lambda v: ref.reference_all_reduce(mesh, v, rank, axes, "sum")),
             ("all_gather", {"axes": axes, "dim": 1}, lambda v: ref.reference_all_gather(mesh, v, rank, axes, 1)),
             ("collective_permute", {"pairs": pairs}, lambda v: ref.reference_permute(v, rank, pairs))]
    checks = []
    for kind, attrs, reference in cases:
        bound = [collectives.bind(mc, kind, HostDeviceModule, shape, np.float32, nonblocking=True, **attrs)
                 for _ in range(2)]
        for step in range(2):
            xs = [local_arrays(mesh, shape, np.float32, seed=2 * step + j) for j in range(2)]
            pending = [f(HostDeviceArray(x[rank])) for f, x in zip(bound, xs)]
            checks += [(p.wait().get(), reference(x)) for p, x in zip(pending, xs)]
    for got, expected in checks:
        assert_same(got, expected)


def test_barrier_and_size_check():
    MeshCommunicator(MESHES[0]).Barrier()
    with pytest.raises(ValueError, match="one MPI process per mesh device"):
        MeshCommunicator(type(MESHES[0])((WORLD.Get_size() + 1,), ("x",)))


def _raw_permute(x, pairs, rank):
    """What this rank receives from one raw mpi4py Sendrecv (zeros when no pair targets it)."""
    dest = next((d for s, d in pairs if s == rank), MPI.PROC_NULL)
    source = next((s for s, d in pairs if d == rank), MPI.PROC_NULL)
    recv = np.zeros_like(x, order="C")
    WORLD.Sendrecv(None if dest == MPI.PROC_NULL else np.ascontiguousarray(x), dest, 0, recv, source, 0)
    return recv


def _raw_all_to_all(sub, x):
    recv = np.empty_like(x, order="C")
    sub.Alltoall(np.ascontiguousarray(x), recv)
    return recv


@pytest.mark.parametrize("mesh", sorted({MESHES[0], MESHES[-1]}, key=MESHES.index), ids=str)  # 1-d; 2-d reordered
@pytest.mark.parametrize("shape, order", [((4096,), "C"), ((128, 32), "C"), ((128, 32), "F")], ids=["1d", "2d", "2d-F"])
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_bound_permute_and_all_to_all_equal_raw_mpi4py_into_one_kept_buffer(mesh, shape, order, nonblocking, make_mc):
    """The bound host calls (one Sendrecv / Alltoall, or Irecv + Isend / Ialltoall, from one Python frame): every
    call's result equals the raw mpi4py call's, it is the same receive array every call, and a call allocates
    nothing of the message's size."""
    import tracemalloc

    mc, rank, n = make_mc(mesh), WORLD.Get_rank(), mesh.size
    if n == 1:
        pytest.skip("one rank: a permute or all_to_all is a local copy, no MPI call")
    shape = (shape[0] * n,) + shape[1:]
    axes = mesh.axis_names  # k == n: every rank's group is the world
    # The shift's ends send only (rank 0: fresh zeros) or receive only (rank n - 1).
    ring, shift = [(r, (r + 1) % n) for r in range(n)], [(r, r + 1) for r in range(n - 1)]
    cases = [("collective_permute", {"pairs": ring}, lambda x: _raw_permute(x, ring, rank)),
             ("collective_permute", {"pairs": shift}, lambda x: _raw_permute(x, shift, rank)),
             ("all_to_all", {"axes": axes, "split_dim": 0, "concat_dim": 0},
              lambda x: _raw_all_to_all(mc.sub(axes), x))]
    checks, message = [], int(np.prod(shape)) * 4
    for kind, attrs, raw in cases:
        bound = collectives.bind(mc, kind, np, shape, np.float32, nonblocking=nonblocking, **attrs)
        f = (lambda x: bound(x).wait()) if nonblocking else bound
        receives = kind == "all_to_all" or rank in {d for _, d in attrs["pairs"]}  # else fresh zeros, by contract
        f(np.zeros(shape, np.float32, order=order))  # warm-up: MPI's own first-call setup is not ours to count
        results = []
        for seed in range(3):
            x = np.asarray(local_arrays(mesh, shape, np.float32, seed)[rank], order=order)
            tracemalloc.start()
            start = tracemalloc.get_traced_memory()[0]
            got = f(x)
            grown = tracemalloc.get_traced_memory()[1] - start
            tracemalloc.stop()
            results.append(got)
            checks.append((kind, got.copy(), raw(x), grown if receives and order == "C" else 0))
        checks.append((kind, all(g is results[0] for g in results) or not receives, True, 0))
    for kind, got, expected, grown in checks:
        if expected is True:
            assert got, f"a bound host {kind} returned a new receive array"
            continue
        assert_same(got, expected)
        assert grown < message // 2, f"a bound host {kind} allocated {grown} bytes in a call (message {message})"


@pytest.mark.mpi
def test_the_world_runtime_pins_each_rank_of_a_node_to_its_own_cores():
    """Pinned apart when the node has a core per rank (comm/affinity.py); left floating when oversubscribed."""
    import os
    from spmd_runtime.comm.affinity import BIND_ENV, local_rank_and_size
    from spmd_runtime.exec.runner import Runtime
    Runtime.world()
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cores = node.allgather(sorted(os.sched_getaffinity(0)))
    size, online = node.Get_size(), os.cpu_count()
    node.Free()
    if os.environ.get(BIND_ENV, "core") == "none" or local_rank_and_size() is None:
        pytest.skip("binding off, or a launcher that names no local rank")
    if 1 < size <= online:
        flat = [c for cs in cores for c in cs]
        assert len(flat) == len(set(flat)) and all(len(cs) == online // size for cs in cores), cores
    else:
        assert all(len(cs) == online for cs in cores), cores  # alone, or oversubscribed: the whole node


@pytest.mark.mpi
def test_a_runtime_over_an_explicit_mpi_communicator_prepares_the_process_once(monkeypatch):
    """``ts.step(..., comm=MPI.COMM_WORLD)`` (bench_train) pins the rank and keeps the heap as ``comm=None`` does."""
    from spmd_runtime.exec import runner
    calls = []
    monkeypatch.setattr(runner, "bind_to_cores", lambda: calls.append("bind"))
    monkeypatch.setattr(runner, "keep_freed_memory", lambda: calls.append("heap"))
    monkeypatch.setattr(runner.Runtime, "_process_ready", False)
    monkeypatch.setattr(runner.Runtime, "_others", [])
    first = runner.Runtime.of(MPI.COMM_WORLD)
    dup = MPI.COMM_WORLD.Dup()
    try:
        second = runner.Runtime.of(dup)
        assert first is not second and second.size == MPI.COMM_WORLD.Get_size()
    finally:
        dup.Free()
    assert calls == ["bind", "heap"]


def _persistent_cases(mesh, rank, shape):
    """(kind, attrs, in_place, raw(x)) on the whole mesh: one of each MPI call the persistent path sets up."""
    n, axes = mesh.size, mesh.axis_names
    ring = [(r, (r + 1) % n) for r in range(n)]
    shift = [(r, r + 1) for r in range(n - 1)]  # the ends: send only, receive only
    sub = WORLD  # k == n: every rank's group is the world

    def gathered(x):
        recv = np.empty((n * shape[0],) + shape[1:], x.dtype)
        sub.Allgather(x, recv)
        return recv

    def scattered(x):
        recv = np.empty((shape[0] // n,) + shape[1:], x.dtype)
        sub.Reduce_scatter_block(x, recv, MPI.SUM)
        return recv
    def reduced(op):
        def call(x):
            recv = np.empty_like(x)
            sub.Allreduce(x, recv, op)
            return recv
        return call
    return [("all_reduce", {"axes": axes, "op": "sum"}, False, reduced(MPI.SUM)),
            ("all_reduce", {"axes": axes, "op": "max"}, True, reduced(MPI.MAX)),
            ("all_gather", {"axes": axes, "dim": 0}, False, gathered),
            ("reduce_scatter", {"axes": axes, "dim": 0, "op": "sum"}, False, scattered),
            ("all_to_all", {"axes": axes, "split_dim": 0, "concat_dim": 0}, False, lambda x: _raw_all_to_all(sub, x)),
            ("collective_permute", {"pairs": ring}, False, lambda x: _raw_permute(x, ring, rank)),
            ("collective_permute", {"pairs": shift}, False, lambda x: _raw_permute(x, shift, rank))]


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_persistent_bindings_equal_raw_mpi4py_for_the_operand_and_for_other_arrays(nonblocking, make_mc):
    """``bind(operand=a)``: one persistent request per binding (MPI-4 ``*_init``), started every call; the result
    equals the raw call's whether ``x`` is ``a`` (the interpreter's planned buffer) or another array (copied into
    ``a`` first), the receive array is the same every call, and ``release`` frees its requests."""
    mesh = MESHES[0]
    mc, rank, n = make_mc(mesh), WORLD.Get_rank(), mesh.size
    if n == 1:
        pytest.skip("one rank: every collective is a local copy, no MPI call")
    shape = (4 * n, 3)
    checks, freed = [], []
    for kind, attrs, in_place, raw in _persistent_cases(mesh, rank, shape):
        planned = np.empty(shape, np.float64)
        bound = collectives.bind(mc, kind, np, shape, np.float64, nonblocking=nonblocking, in_place=in_place,
                                 operand=planned, **attrs)
        f = (lambda x, bound=bound: bound(x).wait()) if nonblocking else bound
        results = []
        for seed, into_planned in [(0, True), (1, False), (2, True)]:
            x = local_arrays(mesh, shape, np.float64, seed)[rank]
            expected = raw(x.copy())
            if into_planned:
                planned[...] = x
                x = planned
            got = f(x)
            results.append(got)
            checks.append((kind, seed, got.copy(), expected))
        receives = kind != "collective_permute" or rank in {d for _, d in attrs["pairs"]}
        if nonblocking:
            pending = bound(planned)
            pending.wait()
            requests = pending.requests
        checks.append((kind, "persistent", bool(getattr(bound, "persistent_requests", ())) or not receives,
                       True))
        checks.append((kind, "one receive array", all(r is results[0] for r in results) or not receives, True))
        if nonblocking and receives:
            collectives.release(bound)
            freed.append((kind, all(not r for r in requests)))
    for kind, what, got, expected in checks:
        if expected is True:
            assert got, f"{kind}: {what}"
        else:
            assert_same(got, expected)
    for kind, ok in freed:
        assert ok, f"{kind}: release left a persistent request unfreed"


# -- every carried dtype (dtypes.COLLECTIVE_DTYPES) through every kind, and the refusals, under real MPI --------

@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "persistent", "persistent-nonblocking"])
def test_every_carried_dtype_through_every_kind_equals_numpy(mode, make_mc):
    """bool (reduced with MPI LOR / LAND), the integers, the floats (16-bit ones as uint16) and complex (summed
    with MPI SUM on C_FLOAT_COMPLEX / C_DOUBLE_COMPLEX): the one-shot, nonblocking and persistent bindings
    (``operand=``, MPI-4 ``*_init``) equal NumPy on the global data; the exchange (all_to_allv) too."""
    from spmd_runtime.dtypes import COLLECTIVE_DTYPES
    mesh, rank = MESHES[0], WORLD.Get_rank()
    mc, n, shape = make_mc(mesh), mesh.size, (2 * mesh.size, 3)
    nonblocking, persistent = "nonblocking" in mode, mode.startswith("persistent")
    checks = []
    for dtype in COLLECTIVE_DTYPES:
        xs = ref.carried_values(n, shape, dtype)
        for kind, attrs, reference in ref.kind_cases(mesh, mesh.axis_names, dtype):
            operand = np.empty(shape, dtype) if persistent else None
            f = collectives.bind(mc, kind, np, shape, dtype, nonblocking=nonblocking, operand=operand, **attrs)
            x = xs[rank]
            if persistent:
                operand[...] = x
                x = operand
            got = f(x)
            checks.append(((kind, dtype, attrs.get("op")), (got.wait() if nonblocking else got).copy(),
                           reference(xs, rank)))
            collectives.release(f)
        if n > 1:  # the exchange: this rank's x, then its left neighbour's
            got = collectives.all_to_allv(mc, xs[rank], **ref.ring_exchange(rank, n, shape[0]))
            checks.append((("all_to_allv", dtype, None), got, np.concatenate([xs[rank], xs[rank - 1]], axis=1)))
    for what, got, expected in checks:
        assert got.dtype == expected.dtype, what
        np.testing.assert_array_equal(got, expected, err_msg=str(what))


def test_bools_reduce_as_raw_mpi4py_lor_and_land(make_mc):
    """A bool sum / max is raw MPI LOR, a min raw MPI LAND (MPI defines SUM, MAX, MIN on no logical type)."""
    mesh, rank = MESHES[0], WORLD.Get_rank()
    mc, axes = make_mc(mesh), MESHES[0].axis_names
    x = ref.carried_values(mesh.size, (4, 3), "bool", seed=3)[rank]
    checks = []
    for op, raw_op in (("sum", MPI.LOR), ("max", MPI.LOR), ("min", MPI.LAND)):
        raw = np.empty_like(x)
        mc.sub(axes).Allreduce(x, raw, raw_op)
        checks.append((all_reduce(mc, x, axes, op), raw))
    for got, raw in checks:
        assert_same(got, raw)


def test_mpi_refuses_what_the_simulated_world_refuses():
    """MPICH's "Invalid MPI_Op" for SUM / MAX on C_BOOL and MAX on complex (what comm/simulated.py mirrors);
    a raw call, every rank alike (the error is raised locally, before any message)."""
    errors = []
    for dtype, op in (("bool", MPI.SUM), ("bool", MPI.MAX), ("complex64", MPI.MAX), ("complex128", MPI.MIN)):
        x = np.zeros(4, dtype)
        try:
            WORLD.Allreduce(x, np.empty_like(x), op)
            errors.append(None)
        except MPI.Exception as e:
            errors.append(e.Get_error_class())
    assert errors == [MPI.ERR_OP] * 4, errors


@pytest.mark.parametrize("kind, attrs", [("all_reduce", {"op": "max"}), ("reduce_scatter", {"op": "min", "dim": 0})])
def test_a_complex_max_is_refused_at_bind_on_every_rank(kind, attrs, make_mc):
    mesh = MESHES[0]
    mc = make_mc(mesh)
    with pytest.raises(TypeError, match=rf"not supported: {kind} of complex64 with op '{attrs['op']}'"):
        collectives.bind(mc, kind, np, (2 * mesh.size, 2), np.complex64, axes=mesh.axis_names, **attrs)
    WORLD.Barrier()  # every rank refused alike: none is left in a collective


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_max_min_all_reduce_propagates_nan_on_every_rank_as_numpy(op, dtype):
    """MPI's MAX / MIN compare, so a NaN survives or not by the reduction order, which differs between ranks
    (the Array API suite's max of an array with NaNs split over 4 ranks: NaN on some ranks, a number on others)."""
    from spmd_runtime.comm.communicator import mpi_op
    comm, r = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    send = np.array([np.nan if r == comm.Get_size() - 1 else r, r, -r, np.inf if r == 0 else 0.5], dtype)
    recv = np.empty_like(send)
    comm.Allreduce(send, recv, mpi_op(op, send.dtype))
    want = getattr(np, op)(np.array(comm.allgather(send)), axis=0)
    np.testing.assert_array_equal(recv, want)
    assert np.isnan(recv[0])
