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
from spmd_runtime.comm.simulated import SimulatedComm  # noqa: F401  (the API under test below)
from spmd_runtime.dtypes import COLLECTIVE_DTYPES, dtype as named_dtype
from spmd_runtime.mesh import Mesh

MESHES = [Mesh((1,), ("x",)), Mesh((2,), ("x",)), Mesh((3,), ("x",)), Mesh((2, 2), ("x", "y"))]
DTYPES = [pytest.param(name, id=name) for name in COLLECTIVE_DTYPES]


def local_values(mesh, shape, dtype, seed=0):
    """Small values every dtype holds exactly (sums of 4 ranks too): bools, 0..3, complex with both parts set."""
    dtype = named_dtype(dtype)
    out = []
    for r in range(mesh.size):
        rng = np.random.default_rng([seed, r])
        if dtype == np.bool_:
            out.append(rng.integers(0, 2, shape) > 0)
        elif dtype.kind == "c":
            out.append((rng.integers(0, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype))
        else:
            out.append(rng.integers(0, 4, shape).astype(dtype))
    return out


def cases(mesh, axes, dtype):
    """(kind, attrs, reference(xs, rank)) for every kind of a bound collective, the ops this dtype reduces with."""
    ops = ("sum",) if named_dtype(dtype).kind == "c" else ("sum", "max", "min")
    n = mesh.size
    ring = [(r, (r + 1) % n) for r in range(n)]
    out = [("all_reduce", {"axes": axes, "op": op},
            lambda xs, r, op=op: ref.reference_all_reduce(mesh, xs, r, axes, op)) for op in ops]
    out += [("reduce_scatter", {"axes": axes, "dim": 0, "op": op},
             lambda xs, r, op=op: ref.reference_reduce_scatter(mesh, xs, r, axes, 0, op)) for op in ops]
    out += [("all_gather", {"axes": axes, "dim": 1}, lambda xs, r: ref.reference_all_gather(mesh, xs, r, axes, 1)),
            ("all_to_all", {"axes": axes, "split_dim": 0, "concat_dim": 1},
             lambda xs, r: ref.reference_all_to_all(mesh, xs, r, axes, 0, 1)),
            ("collective_permute", {"pairs": ring}, lambda xs, r: ref.reference_permute(xs, r, ring)),
            ("broadcast", {"axes": axes, "root": mesh.axis_size(axes) - 1},
             lambda xs, r: ref.reference_broadcast(mesh, xs, r, axes, mesh.axis_size(axes) - 1))]
    return out


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
    xs = local_values(mesh, shape, dtype)
    table = cases(mesh, axes, dtype)

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


def _exchange(rank, n):
    """An all_to_allv round plan: this rank's x lands in out[:, :3], its left neighbour's in out[:, 3:]."""
    right, left = (rank + 1) % n, (rank - 1) % n
    sends = [(rank, (slice(None),)), (right, (slice(None),))]
    recvs = [(rank, (slice(None), slice(0, 3))), (left, (slice(None), slice(3, 6)))]
    return sends, recvs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_exchange_carries_every_dtype(n, dtype):
    mesh = Mesh((n,), ("x",))
    xs = local_values(mesh, (2, 3), dtype)

    def body(comm):
        mc = MeshCommunicator(mesh, comm)
        sends, recvs = _exchange(mc.rank, n)
        return collectives.all_to_allv(mc, xs[mc.rank], sends=sends, recvs=recvs, out_shape=(2, 6))

    for rank, got in enumerate(run_simulated(n, body)):
        assert_same(got, np.concatenate([xs[rank], xs[(rank - 1) % n]], axis=1), rank)


class CallLog:
    """A simulated comm that logs every uppercase MPI call (Split results logged too)."""

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not (callable(attr) and name[0].isupper() and not name.startswith("Get_")):
            return attr

        def call(*args, **kwargs):
            self._log.append(name)
            out = attr(*args, **kwargs)
            return CallLog(out, self._log) if name == "Split" else out
        return call


def _refusals(mesh, kind, attrs, dtype, nonblocking=False):
    """Each rank's (error message or None, MPI calls made) for binding ``kind`` on ``dtype``."""
    def body(comm):
        log = []
        mc = MeshCommunicator(mesh, CallLog(comm, log))
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
        mc = MeshCommunicator(mesh, CallLog(comm, log))
        sends, recvs = _exchange(mc.rank, 2)
        with pytest.raises(TypeError, match=r"not supported: all_to_allv of object \(the collectives carry"):
            collectives.all_to_allv(mc, np.empty((2, 3), object), sends=sends, recvs=recvs, out_shape=(2, 6))
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
