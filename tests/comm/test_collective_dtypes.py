"""Every collective kind on every dtype the collectives carry (``dtypes.COLLECTIVE_DTYPES``: bool, the integers,
the floats, complex), blocking and nonblocking, on simulated ranks against NumPy on all ranks' data; and the
refusals: a complex max/min and a dtype no collective carries raise "not supported: ..." at bind, before any
MPI call, at every group size; the simulated world refuses what MPI refuses."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime.comm import MeshCommunicator, collectives, run_simulated
from spmd_runtime.comm import testing as ref
from spmd_runtime.dtypes import COLLECTIVE_DTYPES, dtype as named_dtype
from spmd_runtime.mesh import Mesh
from test_collectives_simulated import RecordingComm

MESHES = [Mesh((1,), ("x",)), Mesh((2,), ("x",)), Mesh((3,), ("x",)), Mesh((2, 2), ("x", "y"))]
DTYPES = [pytest.param(name, id=name) for name in COLLECTIVE_DTYPES]


def assert_same(got, expected, what):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, expected.dtype)
    np.testing.assert_array_equal(got, expected, err_msg=str(what))


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_kind_carries_every_dtype_like_numpy(mesh, dtype, nonblocking):
    axes = mesh.axis_names
    k = mesh.axis_size(axes)
    shape = (2 * k, 3)
    xs = ref.carried_values(mesh.size, shape, dtype)
    table = ref.kind_cases(mesh, axes, dtype)

    def body(comm):
        mc, outs = MeshCommunicator(mesh, comm), []
        for kind, attrs, _ in table:
            f = collectives.bind(mc, kind, np, shape, dtype, nonblocking=nonblocking, **attrs)
            got = f(xs[mc.rank])
            outs.append((got.wait() if nonblocking else got).copy())
        return outs

    for rank, outs in enumerate(run_simulated(mesh.size, body)):
        for (kind, attrs, reference), got in zip(table, outs):
            assert_same(got, reference(xs, rank), (kind, attrs, rank))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_exchange_carries_every_dtype(n, dtype):
    mesh = Mesh((n,), ("x",))
    xs = ref.carried_values(n, (2, 3), dtype)

    def body(comm):
        mc = MeshCommunicator(mesh, comm)
        return collectives.all_to_allv(mc, xs[mc.rank], **ref.ring_exchange(mc.rank, n))

    for rank, got in enumerate(run_simulated(n, body)):
        assert_same(got, np.concatenate([xs[rank], xs[(rank - 1) % n]], axis=1), rank)


def _refusals(mesh, kind, attrs, dtype, nonblocking=False):
    """Each rank's (error message or None, MPI calls made) for binding ``kind`` on ``dtype``."""
    def body(comm):
        log = []
        mc = MeshCommunicator(mesh, RecordingComm(comm, log))
        try:
            collectives.bind(mc, kind, np, (4, 2), dtype, nonblocking=nonblocking, **attrs)
        except TypeError as e:
            return str(e), log
        return None, log
    return run_simulated(mesh.size, body)


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_a_complex_max_or_min_is_refused_at_bind_on_every_rank_before_any_mpi_call(mesh, dtype, kind, op,
                                                                                    nonblocking):
    attrs = {"axes": mesh.axis_names, "op": op, **({"dim": 0} if kind == "reduce_scatter" else {})}
    for message, calls in _refusals(mesh, kind, attrs, dtype, nonblocking):
        assert message is not None and message.startswith(f"not supported: {kind} of {dtype} with op '{op}' "
                                                          "(NumPy orders complex numbers lexicographically"), message
        assert calls == [], f"MPI was called before the refusal: {calls}"


UNCARRIED = [np.dtype(object), np.dtype(">f8"), np.dtype("U3"), np.dtype("datetime64[s]"),
             np.dtype([("a", "f4"), ("b", "i4")])] + ([np.dtype(np.longdouble)]
                                                       if np.dtype(np.longdouble).itemsize > 8 else [])


@pytest.mark.parametrize("dtype", UNCARRIED, ids=str)
@pytest.mark.parametrize("kind, attrs", [
    ("all_reduce", {"op": "sum"}), ("reduce_scatter", {"dim": 0}), ("all_gather", {"dim": 0}),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0}), ("broadcast", {}), ("collective_permute", None)],
    ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("mesh", [MESHES[0], MESHES[2]], ids=str)
def test_a_dtype_no_collective_carries_is_refused_at_bind_naming_kind_and_dtype(mesh, kind, attrs, dtype):
    attrs = {"pairs": [(0, 0)]} if attrs is None else {"axes": mesh.axis_names, **attrs}
    name = dtype.name if dtype.isnative else f"{dtype.str} (non-native byte order)"
    for message, calls in _refusals(mesh, kind, attrs, dtype):
        assert message is not None and message.startswith(f"not supported: {kind} of {name} (the collectives "
                                                          "carry bool, int8"), message
        assert calls == []


def test_the_exchange_refuses_an_uncarried_dtype_before_its_rounds():
    mesh = Mesh((2,), ("x",))

    def body(comm):
        log = []
        mc = MeshCommunicator(mesh, RecordingComm(comm, log))
        with pytest.raises(TypeError, match=r"not supported: all_to_allv of object \(the collectives carry"):
            collectives.all_to_allv(mc, np.empty((2, 3), object), **ref.ring_exchange(mc.rank, 2))
        return log
    assert run_simulated(2, body) == [[], []]


@pytest.mark.parametrize("op, dtype", [(MPI.SUM, "bool"), (MPI.MAX, "bool"), (MPI.MIN, "bool"),
                                       (MPI.MAX, "complex64"), (MPI.MIN, "complex128"), (MPI.LOR, "float32"),
                                       (MPI.LAND, "complex64")])
def test_the_simulated_world_refuses_an_op_its_datatype_lacks_as_mpi_does(op, dtype):
    """MPICH answers these with "Invalid MPI_Op" (tests/mpi/test_comm_mpi.py checks it does): so must the
    simulation, or a path would pass its simulated tests and fail under MPI."""
    def body(comm):
        x = np.zeros(4, dtype)
        with pytest.raises(ValueError, match="is not defined on"):
            comm.Allreduce(x, np.empty_like(x), op)
        with pytest.raises(ValueError, match="is not defined on"):
            comm.Reduce_scatter_block(x, np.empty(2, dtype), op)
    run_simulated(2, body)


def test_the_simulated_world_computes_lor_and_land_as_mpi():
    xs = [np.array([True, False, False, True]), np.array([True, True, False, False])]
    ints = [np.array([2, 0, 0, -1], np.int8), np.array([0, 0, 3, -1], np.int8)]

    def body(comm):
        r, out = comm.Get_rank(), []
        for x, op in [(xs, MPI.LOR), (xs, MPI.LAND), (ints, MPI.LOR), (ints, MPI.LAND)]:
            recv = np.empty_like(x[r])
            comm.Allreduce(x[r], recv, op)
            out.append(recv)
        return out
    for got in run_simulated(2, body):
        assert_same(got[0], xs[0] | xs[1], "LOR")
        assert_same(got[1], xs[0] & xs[1], "LAND")
        assert_same(got[2], np.array([1, 0, 1, 1], np.int8), "LOR int8")  # MPI's logical ops give 0/1
        assert_same(got[3], np.array([0, 0, 0, 1], np.int8), "LAND int8")


def test_the_simulated_world_refuses_a_buffer_mpi_has_no_datatype_for():
    """bfloat16 is no MPI buffer (mpi4py: "cannot include dtype 'E' in a buffer"): the collectives move it as
    uint16 (low_precision.py); a raw call on it fails in the simulation as under MPI."""
    bf16 = named_dtype("bfloat16")

    def body(comm):
        x = np.zeros(4, bf16)
        with pytest.raises(ValueError, match="must have a dtype MPI has a datatype for"):
            comm.Allgather(x, np.empty(8, bf16))
        peer = 1 - comm.Get_rank()
        with pytest.raises(ValueError, match="must have a dtype MPI has a datatype for"):
            comm.Sendrecv(x, peer, 0, np.empty_like(x), peer, 0)
    run_simulated(2, body)
