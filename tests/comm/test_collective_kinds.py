"""The collective kinds table (spmd_runtime/collective_kinds.py): every kind has its binder, its records and its
16-bit rule where the layers look them up; and broadcast, the kind added through the table alone, on simulated
ranks against NumPy (blocking, nonblocking, bound once, 16-bit, device arrays)."""
from __future__ import annotations

import numpy as np
import pytest

from spmd_runtime import calibrate, cost
from spmd_runtime.collective_kinds import BY_DONE, BY_START, FLOAT32, KINDS
from spmd_runtime.comm import MeshCommunicator, Transport, broadcast, collectives, low_precision, run_simulated
from spmd_runtime.comm import testing as ref
from spmd_runtime.comm.testing import HostDeviceArray, HostDeviceModule, HostDeviceOps
from spmd_runtime.dtypes import LOW_PRECISION
from spmd_runtime.exec.rules.table import BIND
from spmd_runtime.mesh import Mesh
from spmd_runtime.ops.spmd import COLLECTIVES, DONES, STARTS
from mesh_cases import axes_choices

MESHES = [Mesh((n,), ("x",)) for n in (1, 2, 3, 4)] + [Mesh((2, 3), ("x", "y")),
                                                        Mesh((2, 2), ("x", "y"), devices=(3, 1, 0, 2))]
CASES = [pytest.param(m, axes, id=f"{m}-{'.'.join(axes) or 'none'}") for m in MESHES for axes in axes_choices(m)]


def on_mesh(mesh, body, transport_for=None):
    def rank_main(comm):
        transport = None if transport_for is None else transport_for(comm.Get_rank())
        return body(MeshCommunicator(mesh, comm, transport=transport))
    return run_simulated(mesh.size, rank_main)


def local_arrays(mesh, shape, dtype, seed=0):
    return [np.random.default_rng([seed, r]).integers(-50, 50, shape).astype(dtype) for r in range(mesh.size)]


def test_every_kind_but_the_exchange_has_a_binder():
    """collectives.bind looks its binder up by kind: a kind added to the table without one fails here."""
    bound = {kind for kind in KINDS.values() if not kind.exchange}
    missing = sorted(kind.name for kind in bound - set(collectives._BINDERS))
    assert set(collectives._BINDERS) == bound, f"kinds without a binder in comm/collectives.py: {missing}"


def test_the_16_bit_reductions_are_the_float32_kinds():
    assert set(low_precision._REDUCTIONS) == {kind for kind in KINDS.values() if kind.sixteen_bit == FLOAT32}


def test_every_kind_has_its_records_and_their_binders():
    """ops/spmd.py makes a record per kind, and a start and a done per kind with a pair; each has a binder."""
    assert [record.name for record in COLLECTIVES.values()] == list(KINDS)
    for kind, record in COLLECTIVES.items():
        assert record.collective and record.fresh and record.in_place == kind.in_place and record in BIND
        if kind.pair:
            start, done = STARTS[record], DONES[record]
            assert (start.name, done.name) == kind.pair and BY_START[start.name] is BY_DONE[done.name] is kind
            assert start.read_only and done.fresh and start in BIND and done in BIND
        else:
            assert record not in STARTS and record not in DONES
    assert len(STARTS) == len(DONES) == len(BY_START) == len(BY_DONE)


def test_the_table_gives_broadcast_its_cost_and_its_calibrate_entry():
    assert cost.wire_bytes("broadcast", 4, 100, 100) == 100.0 and cost.wire_bytes("broadcast", 1, 100, 100) == 0.0
    assert cost.collective_kind("broadcast_start") == "broadcast" and cost.collective_kind("broadcast_done") is None
    assert "broadcast" in calibrate.KINDS and "all_to_allv" not in calibrate.KINDS
    assert KINDS["broadcast"].result_shape((3, 4), 4, {"axes": ("x",)}) == (3, 4)
    assert repr(KINDS["broadcast"]) == ("CollectiveKind('broadcast', wire=S_in, 16-bit=bits, "
                                        "pair=broadcast_start/broadcast_done)")


@pytest.mark.parametrize("dtype", [np.float32, np.int64] + list(LOW_PRECISION), ids=str)
@pytest.mark.parametrize("mesh, axes", CASES)
def test_broadcast_matches_numpy(mesh, axes, dtype):
    """Every root of the group, the 16-bit floats moved as their bits."""
    k = mesh.axis_size(axes)
    xs = local_arrays(mesh, (3, 5), dtype)
    results = on_mesh(mesh, lambda mc: [broadcast(mc, xs[mc.rank], axes, root) for root in range(k)])
    for rank, outs in enumerate(results):
        for root, got in enumerate(outs):
            want = ref.reference_broadcast(mesh, xs, rank, axes, root)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
            assert not np.shares_memory(got, xs[rank])  # the root's result is a copy of its own


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_bound_broadcast_reuses_its_buffer_and_is_right_every_call(order, nonblocking):
    mesh, axes, root = Mesh((2, 3), ("x", "y")), ("y",), 2
    steps = [[np.asarray(x, order=order) for x in local_arrays(mesh, (4, 6), np.float32, s)] for s in range(3)]

    def body(mc):
        f = collectives.bind(mc, "broadcast", np, (4, 6), np.float32, nonblocking=nonblocking, axes=axes, root=root)
        outs = []
        for xs in steps:
            got = f(xs[mc.rank]).wait() if nonblocking else f(xs[mc.rank])
            outs.append((got.copy(), got.__array_interface__["data"][0]))
        return outs

    for rank, outs in enumerate(on_mesh(mesh, body)):
        for xs, (got, _) in zip(steps, outs):
            np.testing.assert_array_equal(got, ref.reference_broadcast(mesh, xs, rank, axes, root))
        assert len({address for _, address in outs}) == 1, "a bound broadcast allocated a new receive buffer"


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("cuda_aware", [True, False], ids=["direct", "staged"])
def test_broadcast_of_device_arrays(cuda_aware, nonblocking):
    mesh, axes = Mesh((2, 2), ("x", "y")), ("y", "x")
    xs = local_arrays(mesh, (4, 3), np.float32)

    def body(mc):
        f = collectives.bind(mc, "broadcast", HostDeviceModule, (4, 3), np.float32, nonblocking=nonblocking,
                             axes=axes, root=1)
        got = f(HostDeviceArray(xs[mc.rank]))
        got = got.wait() if nonblocking else got
        assert isinstance(got, HostDeviceArray)
        return got.get()

    results = on_mesh(mesh, body, lambda r: Transport(cuda_aware=cuda_aware, device_ops=HostDeviceOps()))
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got, ref.reference_broadcast(mesh, xs, rank, axes, 1))


@pytest.mark.parametrize("root", [-1, 3, 1.0, True])
def test_broadcast_rejects_a_root_outside_the_group(root):
    with pytest.raises(ValueError, match=r"broadcast root must be a rank of the group, in \[0, 3\); got "):
        on_mesh(Mesh((3,), ("x",)), lambda mc: broadcast(mc, np.zeros(2), ("x",), root))
