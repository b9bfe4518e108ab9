"""Collectives bound once (``collectives.bind``): same results as the one-shot functions, receive buffers
kept across calls, ``MPI.IN_PLACE`` reduction into the operand, and strided/F-ordered operands."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.comm import MeshCommunicator, collectives, run_simulated, watchdog
from spmd_runtime.comm import testing as ref
from spmd_runtime.mesh import Mesh

MESH = Mesh((2, 3), ("x", "y"))
KINDS = [  # (kind, attrs, reference(mesh, xs, rank))
    ("all_reduce", {"axes": ("y",), "op": "sum"}, lambda m, xs, r: ref.reference_all_reduce(m, xs, r, ("y",), "sum")),
    ("all_gather", {"axes": ("y",), "dim": 1}, lambda m, xs, r: ref.reference_all_gather(m, xs, r, ("y",), 1)),
    ("reduce_scatter", {"axes": ("x", "y"), "dim": 1, "op": "max"},
     lambda m, xs, r: ref.reference_reduce_scatter(m, xs, r, ("x", "y"), 1, "max")),
    ("all_to_all", {"axes": ("y",), "split_dim": 1, "concat_dim": 0},
     lambda m, xs, r: ref.reference_all_to_all(m, xs, r, ("y",), 1, 0)),
    ("all_to_all", {"axes": ("x",), "split_dim": 0, "concat_dim": 0},
     lambda m, xs, r: ref.reference_all_to_all(m, xs, r, ("x",), 0, 0)),
    ("collective_permute", {"pairs": ((0, 1), (1, 2), (2, 0), (3, 5))},
     lambda m, xs, r: ref.reference_permute(xs, r, ((0, 1), (1, 2), (2, 0), (3, 5)))),
]


def step_arrays(step, order="C"):
    return [np.asarray(np.random.default_rng([step, r]).integers(-50, 50, (4, 6)), np.float32, order=order)
            for r in range(MESH.size)]


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("kind, attrs, reference", KINDS, ids=[f"{k[0]}-{i}" for i, k in enumerate(KINDS)])
def test_bound_collective_reuses_its_buffer_and_is_right_every_call(kind, attrs, reference, order, nonblocking):
    steps = [step_arrays(s, order) for s in range(3)]

    def body(mc):
        f = collectives.bind(mc, kind, np, (4, 6), np.float32, nonblocking=nonblocking, **attrs)
        outs = []
        for xs in steps:
            got = f(xs[mc.rank]).wait() if nonblocking else f(xs[mc.rank])
            outs.append((got.copy(), got.__array_interface__["data"][0]))
        return outs

    for rank, outs in enumerate(run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm)))):
        for xs, (got, _) in zip(steps, outs):
            np.testing.assert_array_equal(got, reference(MESH, xs, rank))
        receives = kind != "collective_permute" or rank in {d for _, d in attrs["pairs"]}  # else fresh zeros
        if receives:
            assert len({address for _, address in outs}) == 1, "a bound collective allocated a new receive buffer"


def test_unreused_binding_returns_fresh_buffers():
    def body(mc):
        f = collectives.bind(mc, "all_reduce", np, (4, 6), np.float32, axes=("x",), reuse=False)
        x = np.ones((4, 6), np.float32)
        return f(x), f(x)

    for a, b in run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm))):
        assert not np.shares_memory(a, b)
        np.testing.assert_array_equal(a, np.full((4, 6), 2.0))


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_in_place_all_reduce_writes_into_the_operand(order, nonblocking):
    xs = step_arrays(0, order)

    def body(mc):
        f = collectives.bind(mc, "all_reduce", np, (4, 6), np.float32, axes=("x", "y"), in_place=True,
                             nonblocking=nonblocking)
        x = xs[mc.rank].copy(order=order)
        out = f(x).wait() if nonblocking else f(x)
        return out, np.shares_memory(out, x)

    for rank, (out, shared) in enumerate(run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm)))):
        np.testing.assert_array_equal(out, ref.reference_all_reduce(MESH, xs, rank, ("x", "y"), "sum"))
        assert shared == (order == "C")  # an F-ordered operand is copied to C order once, then reduced in place


def test_bind_rejects_an_unknown_kind_naming_the_choices():
    def body(mc):
        with pytest.raises(ValueError, match=r"collective kind must be one of .*all_reduce.*; got 'all_sum'"):
            collectives.bind(mc, "all_sum", np, (2,), np.float32, axes=("x",))
        with pytest.raises(ValueError, match="reduction op must be one of"):
            collectives.bind(mc, "all_reduce", np, (2,), np.float32, axes=("x",), op="xor")

    run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm)))


def test_a_nonblocking_wait_waits_for_the_members_of_its_communicator_only():
    """The watchdog asks only the ranks a wait needs: an early exit of a rank outside the group is no reason to
    abort (a rank is probed only while it is among the wait's peers)."""
    def body(mc):
        start = collectives.bind(mc, "all_reduce", np, (4, 6), np.float32, axes=("x",), nonblocking=True)
        pending = start(np.ones((4, 6), np.float32))
        np.testing.assert_array_equal(pending.wait(), np.full((4, 6), 2.0))
        return pending.comm

    for comm in run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm))):
        assert comm is not None and hasattr(comm, "Iallreduce")
    frame = SimpleNamespace(f_code=collectives.Pending.wait.__code__,
                            f_locals={"self": collectives.Pending((), None, None, "a test", MPI.COMM_SELF)})
    assert watchdog.waited_for(frame) == [MPI.COMM_WORLD.Get_rank()]


@pytest.mark.parametrize("kind, attrs, posts", [
    ("reduce_scatter", {"axes": ("x", "y"), "dim": 0, "op": "sum"}, False),
    ("all_reduce", {"axes": ("x", "y"), "op": "sum"}, True)], ids=["reduce_scatter", "all_reduce"])
def test_a_host_reduce_scatter_started_nonblocking_is_done_at_its_start(kind, attrs, posts):
    """On host buffers a nonblocking reduce-scatter runs MPI's blocking call at the start (MPICH's nonblocking
    algorithm is several times slower at a small model's shard sizes and overlaps nothing on a host): the
    Pending holds no request and its result is right before the wait; other kinds still post their I-call."""
    def body(mc):
        start = collectives.bind(mc, kind, np, (12, 2), np.float32, nonblocking=True, **attrs)
        pending = start(np.full((12, 2), mc.rank + 1, np.float32))
        early = np.array(pending.value, copy=True) if not pending.requests else None
        return bool(pending.requests), early, pending.wait()

    total = sum(range(1, MESH.size + 1))
    for requests, early, result in run_simulated(MESH.size, lambda comm: body(MeshCommunicator(MESH, comm))):
        assert requests is posts
        np.testing.assert_array_equal(result, np.full((2, 2) if not posts else (12, 2), total, np.float32))
        if not posts:
            np.testing.assert_array_equal(early, result)
