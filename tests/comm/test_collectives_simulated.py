"""Collectives on in-process simulated ranks, checked against NumPy on all ranks' data."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from spmd_runtime.comm import (
    MeshCommunicator,
    SimulatedAbort,
    Transport,
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    collectives,
    cuda_aware_mpi,
    reduce_scatter,
    run_simulated,
)
from spmd_runtime.comm import testing as ref
from spmd_runtime.comm.testing import HostDeviceArray, HostDeviceModule, HostDeviceOps
from spmd_runtime.mesh import Mesh
from mesh_cases import axes_choices

MESHES = [Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    Mesh(shape, ("x", "y")) for shape in ((2, 2), (2, 3), (2, 4), (4, 2))
] + [Mesh((2, 3), ("x", "y"), devices=(5, 3, 1, 4, 2, 0))]
CASES = [pytest.param(m, axes, id=f"{m}-{'.'.join(axes) or 'none'}") for m in MESHES for axes in axes_choices(m)]
DTYPES = [np.float32, np.float64, np.int64]
COLLECTIVE_CALLS = {"Allreduce", "Allgather", "Reduce_scatter_block", "Alltoall", "Sendrecv", "Send", "Recv"}


def local_arrays(mesh, shape, dtype, seed=0):
    # Small integers: float sums are exact in any order, so results compare exactly.
    return [np.random.default_rng([seed, r]).integers(-50, 50, shape).astype(dtype) for r in range(mesh.size)]


def on_mesh(mesh, body, *, comm_wrapper=None, transport_for=None):
    """Run ``body(mc)`` on every simulated rank of ``mesh``; per-rank results."""

    def rank_main(comm):
        comm = comm if comm_wrapper is None else comm_wrapper(comm)
        transport = None if transport_for is None else transport_for(comm.Get_rank())
        return body(MeshCommunicator(mesh, comm, transport=transport))

    return run_simulated(mesh.size, rank_main)


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)


class RecordingComm:
    """Delegates to a comm, logging every uppercase MPI call (and wrapping Split results)."""

    def __init__(self, comm, log: list):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not (callable(attr) and name[0].isupper() and not name.startswith("Get_")):
            return attr

        def call(*args, **kwargs):
            self._log.append(name)
            out = attr(*args, **kwargs)
            return RecordingComm(out, self._log) if name == "Split" else out

        return call


# -- array semantics against NumPy on the global data ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh, axes", CASES)
def test_all_reduce_matches_numpy(mesh, axes, dtype):
    xs = local_arrays(mesh, (3, 5), dtype)
    ops = ("sum", "max", "min", "prod")
    results = on_mesh(mesh, lambda mc: [all_reduce(mc, xs[mc.rank], axes, op) for op in ops])
    for rank in range(mesh.size):
        for op, got in zip(ops, results[rank]):
            assert_same(got, ref.reference_all_reduce(mesh, xs, rank, axes, op))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh, axes", CASES)
def test_all_gather_matches_numpy(mesh, axes, dtype):
    xs = local_arrays(mesh, (2, 3, 4), dtype)
    dims = (0, 1, 2, -1)
    results = on_mesh(mesh, lambda mc: [all_gather(mc, xs[mc.rank], axes, d) for d in dims])
    for rank in range(mesh.size):
        for dim, got in zip(dims, results[rank]):
            assert_same(got, ref.reference_all_gather(mesh, xs, rank, axes, dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh, axes", CASES)
def test_reduce_scatter_matches_numpy(mesh, axes, dtype):
    k = mesh.axis_size(axes)
    xs = local_arrays(mesh, (2 * k, 3 * k, k), dtype)
    cases = [(d, op) for d in (0, 1, 2, -2) for op in ("sum", "max")]
    results = on_mesh(mesh, lambda mc: [reduce_scatter(mc, xs[mc.rank], axes, d, op) for d, op in cases])
    for rank in range(mesh.size):
        for (dim, op), got in zip(cases, results[rank]):
            assert_same(got, ref.reference_reduce_scatter(mesh, xs, rank, axes, dim, op))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh, axes", CASES)
def test_all_to_all_matches_numpy(mesh, axes, dtype):
    k = mesh.axis_size(axes)
    xs = local_arrays(mesh, (2 * k, k, 3 * k), dtype)
    dim_pairs = [(s, c) for s in (0, 1, 2) for c in (0, 1, 2)] + [(-1, -3)]
    results = on_mesh(mesh, lambda mc: [all_to_all(mc, xs[mc.rank], axes, s, c) for s, c in dim_pairs])
    for rank in range(mesh.size):
        for (split, concat), got in zip(dim_pairs, results[rank]):
            assert_same(got, ref.reference_all_to_all(mesh, xs, rank, axes, split, concat))


def test_all_to_all_reshards_concat_dim_to_split_dim():
    # Global (8, 12) sharded on dim 0 over x (4 shards) becomes sharded on dim 1.
    mesh, glob = Mesh((4,), ("x",)), np.arange(96.0).reshape(8, 12)
    results = on_mesh(mesh, lambda mc: all_to_all(mc, np.split(glob, 4, 0)[mc.rank], ("x",), 1, 0))
    for rank in range(4):
        assert_same(results[rank], np.split(glob, 4, 1)[mesh.index_along(rank, ("x",))].copy())


@pytest.mark.parametrize("mesh, axes", [c for c in CASES if len(c.values[1]) > 0])
def test_non_contiguous_inputs(mesh, axes):
    k = mesh.axis_size(axes)
    xs = [a.T for a in local_arrays(mesh, (3 * k, 2 * k), np.float64)]  # Fortran-ordered views

    def body(mc):
        x = xs[mc.rank]
        return [all_reduce(mc, x, axes, "sum"), all_gather(mc, x, axes, 1), reduce_scatter(mc, x, axes, 1, "sum"),
                all_to_all(mc, x, axes, 0, 1)]

    for rank, (red, gat, rs, a2a) in enumerate(on_mesh(mesh, body)):
        assert_same(red, ref.reference_all_reduce(mesh, xs, rank, axes, "sum"))
        assert_same(gat, ref.reference_all_gather(mesh, xs, rank, axes, 1))
        assert_same(rs, ref.reference_reduce_scatter(mesh, xs, rank, axes, 1, "sum"))
        assert_same(a2a, ref.reference_all_to_all(mesh, xs, rank, axes, 0, 1))


@pytest.mark.parametrize("mesh", [m for m in MESHES if len(m.shape) == 2], ids=str)
def test_zero_dim_arrays_keep_their_shape(mesh):
    xs = [np.array(float(r + 1)) for r in range(mesh.size)]
    pairs = [(r, (r + 1) % mesh.size) for r in range(mesh.size)]
    results = on_mesh(mesh, lambda mc: [all_reduce(mc, xs[mc.rank], a, "max") for a in axes_choices(mesh)]
                      + [collective_permute(mc, xs[mc.rank], pairs)])
    for rank in range(mesh.size):
        expected = [ref.reference_all_reduce(mesh, xs, rank, a, "max") for a in axes_choices(mesh)]
        for got, want in zip(results[rank], expected + [ref.reference_permute(xs, rank, pairs)]):
            assert got.shape == () and got == want


# -- collective_permute -----------------------------------------------------------------------


def permute_cases(mesh):
    n = mesh.size
    cases = {"ring": [(r, (r + 1) % n) for r in range(n)], "none": [], "self": [(0, 0)]}
    if n > 1:
        cases["one_pair"] = [(n - 1, 0)]  # every other rank receives nothing: zeros
        cases["reverse_half"] = [(r, n - 1 - r) for r in range(n // 2)]
    for axes in axes_choices(mesh)[1:]:
        shift = [(g[i], g[(i + 1) % len(g)]) for g in mesh.groups(axes) for i in range(len(g))]
        cases["shift_" + ".".join(axes)] = shift
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_collective_permute_matches_pairs(mesh, dtype):
    xs = local_arrays(mesh, (3, 4), dtype)
    cases = permute_cases(mesh)
    results = on_mesh(mesh, lambda mc: {name: collective_permute(mc, xs[mc.rank], p) for name, p in cases.items()})
    for rank in range(mesh.size):
        for name, pairs in cases.items():
            assert_same(results[rank][name], ref.reference_permute(xs, rank, pairs))


def test_collective_permute_missing_source_gives_zeros():
    mesh = Mesh((4,), ("x",))
    xs = [np.full((2, 2), r + 1, np.int64) for r in range(4)]
    results = on_mesh(mesh, lambda mc: collective_permute(mc, xs[mc.rank], [(0, 2), (2, 3)]))
    assert [int(r[0, 0]) for r in results] == [0, 0, 1, 3]
    assert all(r.shape == (2, 2) and r.dtype == np.int64 for r in results)


@pytest.mark.parametrize("pairs", [[(0, 1), (2, 1)], [(0, 1), (0, 2)], [(0, 4)], [(-1, 0)]], ids=str)
def test_collective_permute_rejects_bad_pairs(pairs):
    rule = r"unique sources and unique destinations, all ranks in \[0, 4\); got pairs "
    with pytest.raises(ValueError, match=rule + re.escape(str(pairs))):
        on_mesh(Mesh((4,), ("x",)), lambda mc: collective_permute(mc, np.zeros(2), pairs))


# -- communicator behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_sub_communicators_follow_mesh_groups_and_are_split_once(mesh):
    logs = [[] for _ in range(mesh.size)]
    choices = [a for a in axes_choices(mesh) if mesh.axis_size(a) > 1]
    x = np.ones(mesh.size * 2)

    def body(mc):
        for _ in range(3):
            for axes in choices:
                all_reduce(mc, x, axes, "sum")
                reduce_scatter(mc, x, axes, 0, "max")
        subs = {axes: mc.sub(axes) for axes in choices}
        assert all(mc.sub(axes) is sub for axes, sub in subs.items())
        return {axes: (s.Get_rank(), s.Get_size(), s.allgather(mc.rank)) for axes, s in subs.items()}

    results = on_mesh(mesh, body, comm_wrapper=lambda c: RecordingComm(c, logs[c.Get_rank()]))
    for rank in range(mesh.size):
        assert logs[rank].count("Split") == len(choices)
        for axes in choices:
            members = ref.group_members(mesh, rank, axes)
            assert results[rank][axes] == (members.index(rank), len(members), members)


def test_group_of_size_one_makes_no_mpi_call_and_returns_a_copy():
    mesh, logs = Mesh((2, 1), ("x", "y")), [[], []]
    x = np.arange(6.0).reshape(2, 3)

    def body(mc):
        outs = [all_reduce(mc, x, ("y",), "sum"), all_gather(mc, x, ("y",), 1), reduce_scatter(mc, x, (), 0, "sum"),
                all_to_all(mc, x, ("y",), 0, 1)]
        return outs

    for rank, outs in enumerate(on_mesh(mesh, body, comm_wrapper=lambda c: RecordingComm(c, logs[c.Get_rank()]))):
        assert logs[rank] == []
        for out in outs:
            assert_same(out, x)
            assert not np.shares_memory(out, x)


def test_free_releases_sub_communicators_and_they_are_remade_on_demand():
    mesh, logs = Mesh((2, 2), ("x", "y")), [[] for _ in range(4)]

    def body(mc):
        all_reduce(mc, np.ones(2), ("x",), "sum")
        all_reduce(mc, np.ones(2), ("y", "x"), "sum")
        mc.free()
        return all_reduce(mc, np.ones(2), ("x",), "sum")

    results = on_mesh(mesh, body, comm_wrapper=lambda c: RecordingComm(c, logs[c.Get_rank()]))
    for rank in range(4):
        assert logs[rank].count("Free") == 2 and logs[rank].count("Split") == 3
        assert_same(results[rank], np.full(2, 2.0))


def test_agree_raises_on_every_rank_naming_the_failing_ranks():
    mesh = Mesh((4,), ("x",))

    def body(mc):
        mc.agree(None)  # nobody failed: returns quietly
        try:
            mc.agree(f"boom on {mc.rank}" if mc.rank in (1, 3) else None)
        except RuntimeError as err:
            return str(err)
        return None

    messages = on_mesh(mesh, body)
    for message in messages:
        assert message is not None and "rank(s) [1, 3]" in message
        assert "rank 1: boom on 1" in message and "rank 3: boom on 3" in message and "rank 0" not in message


def test_constructor_and_argument_errors_state_the_rule():
    with pytest.raises(ValueError, match="one MPI process per mesh device; got 3 processes .* 4 devices"):
        run_simulated(3, lambda comm: MeshCommunicator(Mesh((2, 2), ("x", "y")), comm))
    mesh = Mesh((2,), ("x",))
    bad_calls = {
        "distinct axes": lambda mc: all_reduce(mc, np.ones(2), ("z",), "sum"),
        "must be one of": lambda mc: all_reduce(mc, np.ones(2), ("x",), "xor"),
        "divisible by the group size 2; got shape": lambda mc: reduce_scatter(mc, np.ones(3), ("x",), 0, "sum"),
        r"must be in \[-2, 2\)": lambda mc: all_gather(mc, np.ones((2, 2)), ("x",), 2),
    }
    for match, call in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            on_mesh(mesh, call)


# -- the simulation itself --------------------------------------------------------------------


def test_simulation_reraises_first_error_with_rank_and_unblocks_others():
    def body(comm):
        if comm.rank == 2:
            raise KeyError("rank two failed")
        comm.Barrier()  # the other ranks would wait forever without the abort

    start = time.perf_counter()
    with pytest.raises(KeyError, match="rank two failed") as info:
        run_simulated(4, body, timeout=30)
    assert time.perf_counter() - start < 5
    assert any("simulated rank 2 of 4" in note for note in info.value.__notes__)


def test_simulation_reports_mismatched_collectives_and_deadlocks():
    def mismatched(comm):
        return comm.Barrier() if comm.rank else comm.allgather(0)

    with pytest.raises(RuntimeError, match="same collective"):
        run_simulated(2, mismatched)
    with pytest.raises(TimeoutError, match="within 0.2s"):
        run_simulated(2, lambda comm: comm.rank and comm.Barrier(), timeout=0.2)
    with pytest.raises(SimulatedAbort, match="error code 7"):
        run_simulated(3, lambda comm: comm.Abort(7) if comm.rank == 1 else comm.Barrier())


def test_simulation_copies_data_between_ranks():
    def body(comm):
        send = np.full(2, float(comm.rank))
        recv = np.empty(4)
        comm.Allgather(send, recv)
        send[:] = -1  # must not reach the copy other ranks received
        comm.Barrier()
        return recv

    for recv in run_simulated(2, body):
        assert_same(recv, np.array([0.0, 0.0, 1.0, 1.0]))


def test_simulation_is_fast_enough_for_thousands_of_collectives():
    def body(comm):
        x, out = np.ones(4), np.empty(4)
        start = time.perf_counter()
        for _ in range(2000):
            comm.Allreduce(x, out)
        return time.perf_counter() - start

    assert max(run_simulated(4, body)) < 10.0  # ~0.3 s on a 2-core machine


# -- device arrays: CUDA-aware (direct) and staged through pinned host memory ------------------


def gpu_body(axes, xs):
    def body(mc):
        x = HostDeviceArray(xs[mc.rank])
        outs = []
        for _ in range(3):  # repeated calls must reuse the pinned buffers
            outs = [all_reduce(mc, x, axes, "sum"), all_gather(mc, x, axes, 1), reduce_scatter(mc, x, axes, 0, "max"),
                    all_to_all(mc, x, axes, 0, 1), collective_permute(mc, x, [(0, mc.mesh.size - 1)])]
        assert all(isinstance(o, HostDeviceArray) for o in outs)
        return [o.get() for o in outs]

    return body


def check_gpu_results(mesh, axes, xs, results):
    for rank, (red, gat, rs, a2a, perm) in enumerate(results):
        assert_same(red, ref.reference_all_reduce(mesh, xs, rank, axes, "sum"))
        assert_same(gat, ref.reference_all_gather(mesh, xs, rank, axes, 1))
        assert_same(rs, ref.reference_reduce_scatter(mesh, xs, rank, axes, 0, "max"))
        assert_same(a2a, ref.reference_all_to_all(mesh, xs, rank, axes, 0, 1))
        assert_same(perm, ref.reference_permute(xs, rank, [(0, mesh.size - 1)]))


def mpi_calls_follow_a_sync(events):
    synced = False
    for event in events:
        if event == "sync":
            synced = True
        elif event in COLLECTIVE_CALLS:
            if not synced:
                return False
            synced = False
    return True


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("mesh, axes", [(Mesh((4,), ("x",)), ("x",)), (Mesh((2, 3), ("x", "y")), ("y", "x")),
                                        (Mesh((2, 2), ("x", "y")), ("y",))], ids=str)
def test_device_arrays(mesh, axes, cuda_aware):
    k = mesh.axis_size(axes)
    xs = local_arrays(mesh, (2 * k, 3 * k), np.float32)
    events = [[] for _ in range(mesh.size)]
    results = on_mesh(
        mesh, gpu_body(axes, xs),
        comm_wrapper=lambda c: RecordingComm(c, events[c.Get_rank()]),
        transport_for=lambda r: Transport(cuda_aware=cuda_aware, device_ops=HostDeviceOps(events[r])),
    )
    check_gpu_results(mesh, axes, xs, results)
    for rank_events in events:
        assert mpi_calls_follow_a_sync(rank_events)
        assert sum(e in COLLECTIVE_CALLS for e in rank_events) >= 12
        if cuda_aware:
            assert not {"to_host", "to_device", "pin"} & set(rank_events)
        else:
            # Grown at most a few times during the first round, then reused.
            assert 1 <= rank_events.count("pin") <= 4 and "pin" not in rank_events[len(rank_events) // 2:]
            assert rank_events.count("to_device") >= 12


NONBLOCKING_CALLS = {"Iallreduce", "Iallgather", "Ireduce_scatter_block", "Ialltoall", "Isend", "Irecv"}


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("mesh, axes", [(Mesh((4,), ("x",)), ("x",)), (Mesh((2, 3), ("x", "y")), ("y", "x"))],
                         ids=str)
def test_nonblocking_device_collectives_post_at_the_start_and_land_at_the_wait(mesh, axes, cuda_aware):
    """Bound nonblocking collectives on device arrays (the scheduled start/done pairs on GPUs): the start
    synchronises the stream once and posts MPI's nonblocking call, on the device buffers (CUDA-aware) or on
    pinned host copies of the binding's own; a staged result reaches the device at the wait. Two calls of one
    kind in flight at once stay apart, and every result is right, twice over (buffers reused)."""
    n, k = mesh.size, mesh.axis_size(axes)
    shape = (2 * k, 3 * k)
    data = [local_arrays(mesh, shape, np.float32, seed) for seed in (0, 1)]
    kinds = [("all_reduce", {"axes": axes, "op": "sum"}, lambda r, v: ref.reference_all_reduce(mesh, v, r, axes, "sum")),
             ("all_gather", {"axes": axes, "dim": 1}, lambda r, v: ref.reference_all_gather(mesh, v, r, axes, 1)),
             ("reduce_scatter", {"axes": axes, "dim": 0, "op": "max"},
              lambda r, v: ref.reference_reduce_scatter(mesh, v, r, axes, 0, "max")),
             ("all_to_all", {"axes": axes, "split_dim": 0, "concat_dim": 1},
              lambda r, v: ref.reference_all_to_all(mesh, v, r, axes, 0, 1)),
             ("collective_permute", {"pairs": [(0, n - 1), (n - 1, 0)]},
              lambda r, v: ref.reference_permute(v, r, [(0, n - 1), (n - 1, 0)]))]
    events = [[] for _ in range(n)]

    def body(mc):
        log, out = events[mc.rank], []
        for kind, attrs, _ in kinds:
            first, second = (collectives.bind(mc, kind, HostDeviceModule, shape, np.float32, nonblocking=True,
                                              **attrs) for _ in range(2))
            for _ in range(2):
                mark = len(log)
                pending = [first(HostDeviceArray(data[0][mc.rank])), second(HostDeviceArray(data[1][mc.rank]))]
                at_start, mark = log[mark:], len(log)
                results = [p.wait() for p in pending]
                out.append((kind, [r.get() for r in results], at_start, log[mark:]))
        return out

    results = on_mesh(mesh, body, comm_wrapper=lambda c: RecordingComm(c, events[c.Get_rank()]),
                      transport_for=lambda r: Transport(cuda_aware=cuda_aware, device_ops=HostDeviceOps(events[r])))
    for rank, runs in enumerate(results):
        for (kind, got, at_start, at_wait), (_, _, reference) in zip(runs, [c for c in kinds for _ in range(2)]):
            for g, v in zip(got, data):
                assert_same(g, reference(rank, v))
            moves = kind != "collective_permute" or rank in (0, n - 1)
            posted = [e for e in at_start if e in NONBLOCKING_CALLS]
            assert not COLLECTIVE_CALLS & set(at_start), f"{kind}: a blocking MPI call at the start: {at_start}"
            assert bool(posted) == moves and at_start.count("sync") == (2 if moves else 0), (kind, at_start)
            assert not moves or at_start.index("sync") < at_start.index(posted[0]), f"{kind}: posted before a sync"
            assert "to_device" not in at_start, f"{kind}: the result was copied to the device before the wait"
            assert at_wait.count("to_device") == (2 if moves and not cuda_aware else 0), (kind, at_wait)
            assert ("to_host" in at_start) == (moves and not cuda_aware)


def test_pinned_buffers_are_reused_and_grow_only_when_needed():
    ops = HostDeviceOps()
    transport = Transport(cuda_aware=False, device_ops=ops)
    small = transport.pinned("send", (4,), np.float64)
    again = transport.pinned("send", (2, 2), np.float32)
    assert np.shares_memory(small, again) and ops.events.count("pin") == 1
    big = transport.pinned("send", (1000,), np.float64)
    recv = transport.pinned("recv", (4,), np.int64)
    assert big.shape == (1000,) and not np.shares_memory(big, recv) and ops.events.count("pin") == 3


def test_cuda_aware_env_override(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("yes", True), ("off", False)):
        monkeypatch.setenv("SPMD_CUDA_AWARE", value)
        assert cuda_aware_mpi() is expected
    monkeypatch.setenv("SPMD_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="SPMD_CUDA_AWARE must be one of .*got 'maybe'"):
        cuda_aware_mpi()
    monkeypatch.delenv("SPMD_CUDA_AWARE")
    assert isinstance(cuda_aware_mpi(), bool)  # the MPI library's own answer


def test_imports_without_cupy():
    code = "import sys; sys.modules['cupy'] = None; import spmd_runtime.comm, spmd_runtime.comm.testing; print('ok')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
