"""sr.jit, DArrays and profiles under real MPI, for any world size.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_api_mpi.py -p no:cacheprovider``.
Assertions come after the collectives, so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.exec.backend import to_host

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()


@pytest.fixture
def shared_dir():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="spmd_api_") if RANK == 0 else None)
    yield path
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_darray_round_trips_on_uneven_shardings(world_meshes):
    x = np.arange(7 * 5 * 3, dtype="float32").reshape(7, 5, 3)
    for mesh in world_meshes:
        for spec in (sr.P(mesh.axis_names[0]), sr.P(None, mesh.axis_names[-1]), sr.P(None, None, mesh.axis_names),
                     sr.P()):
            a = sr.device_put(x, spec, mesh)
            b = sr.from_local(a.local.copy(), spec, mesh)
            c = sr.scatter_from_root(x if RANK == 0 else None, spec, mesh)
            got = [to_host(a.gather()), np.asarray(b), np.asarray(c)]
            assert b.shape == c.shape == x.shape, (mesh, spec)
            np.testing.assert_array_equal(a.local, x[a.block_slices()], err_msg=f"{mesh} {spec}")
            np.testing.assert_array_equal(c.local, a.local, err_msg=f"{mesh} {spec}")
            for g in got:
                np.testing.assert_array_equal(g, x, err_msg=f"{mesh} {spec}")


def test_chained_jit_pipeline_never_holds_a_full_input(shared_dir):
    """Each rank makes only its own rows; three jitted calls pass DArrays; no array the runtime allocates
    (every instruction's output, recorded by the profiler) is as large as the input."""
    mesh = sr.Mesh((N,), ("data",))
    rows, cols = 64 * N + (N > 1), 256  # uneven when N > 1
    global_bytes = rows * cols * 4
    x_spec = sr.P("data")
    from spmd_runtime.exec import block_slices
    my = block_slices((rows, cols), sr.parse_spec(x_spec, mesh, 2), mesh, RANK)[0]
    block = (np.arange(my.start, my.stop, dtype="float32")[:, None] * 1e-3
             + np.arange(cols, dtype="float32")[None, :] * 1e-4)
    w = np.linspace(-1, 1, cols * 8, dtype="float32").reshape(cols, 8)

    normalize = sr.jit(lambda x: snp.tanh(x) * 2.0, mesh=mesh, profile=shared_dir)
    project = sr.jit(lambda x, w: x @ w, mesh=mesh, in_specs=(x_spec, sr.P()), profile=shared_dir)
    total = sr.jit(lambda y: (y * y).sum(), mesh=mesh, profile=shared_dir)

    x = sr.from_local(block, x_spec, mesh)
    wd = sr.device_put(w, sr.P(), mesh)
    total(project(normalize(x), wd))  # compile (and warm up) outside the measured window
    tracemalloc.start()
    tracemalloc.reset_peak()
    y = normalize(x)
    z = project(y, wd)
    s = total(z)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    value = float(np.asarray(s))
    WORLD.Barrier()

    full = np.arange(rows, dtype="float32")[:, None] * 1e-3 + np.arange(cols, dtype="float32")[None, :] * 1e-4
    np.testing.assert_allclose(value, (((np.tanh(full) * 2) @ w) ** 2).sum(), rtol=1e-4)
    for d in (x, y, z):
        assert isinstance(d, sr.DArray) and d.sharding.dims[0] == ("data",)
        assert d.local.nbytes < d.nbytes or N == 1
    events = json.load(open(os.path.join(shared_dir, f"rank{RANK}.trace.json")))["traceEvents"]
    steps = [e for e in events if e.get("cat") in ("compute", "comm")]
    assert steps, "the profiler recorded the instructions"
    if N > 1:
        assert max(e["args"]["bytes"] for e in steps) < global_bytes
    if N >= 4:  # three live blocks of 1/N of the input, plus bookkeeping
        assert peak < global_bytes, (peak, global_bytes)


def test_profile_has_one_span_per_instruction_per_rank(shared_dir):
    mesh = sr.Mesh((N,), ("x",))
    f = sr.jit(lambda a, b: snp.exp(a @ b).sum(axis=0), mesh=mesh, in_specs=(sr.P(None, "x"), sr.P("x")),
               profile=shared_dir)
    a, b = np.ones((4, 2 * N), "float32"), np.ones((2 * N, 3), "float32")
    program = f.lower(a, b)
    f(a, b)
    f(a, b)
    WORLD.Barrier()
    traces = sr.profile.load_traces(shared_dir) if RANK == 0 else None
    mine = json.load(open(os.path.join(shared_dir, f"rank{RANK}.trace.json")))
    runs = [e for e in mine["traceEvents"] if e.get("cat") == "run"]
    steps = [e for e in mine["traceEvents"] if e.get("cat") in ("compute", "comm")]
    n_instr = sum(1 for i in program.instrs if i.op != "parameter")
    assert len(runs) == 2 and len(steps) == 2 * n_instr
    assert [e["name"] for e in steps[:n_instr]] == [i.op for i in program.instrs if i.op != "parameter"]
    comm = [e for e in steps if e["cat"] == "comm"]
    assert all(e["args"]["group"] == ["x"] and e["args"]["group_size"] == N for e in comm)
    assert len(comm) == 2 * len(program.comm_summary())
    if RANK == 0:
        assert sorted(traces) == list(range(N))


def test_jit_with_different_shapes_on_different_ranks_raises_on_every_rank():
    if N == 1:
        pytest.skip("needs two ranks")
    f = sr.jit(lambda x: x * 2.0, mesh=sr.Mesh((N,), ("x",)))
    with pytest.raises(ValueError, match=r"same argument shapes.*float32\[5\].*float32\[4\]|"
                                         r"same argument shapes.*float32\[4\].*float32\[5\]"):
        f(np.ones(5 if RANK == N - 1 else 4, "float32"))
    assert WORLD.allreduce(1) == N  # nobody is stuck in a collective


def test_partial_sums_stay_pending_between_jitted_calls_and_complete_once():
    """A @ B with the contraction split over every rank comes back as pending sums (no collective); scaled
    and summed with itself in a function that declares it partial, still none; declared final, one
    all-reduce (replicated) or one reduce-scatter (rows split). Values against NumPy on every rank."""
    mesh = sr.Mesh((N,), ("x",))
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4 * N, 3 * N)), rng.standard_normal((3 * N, 5))
    pending = sr.P(partial="x")
    with mesh:
        matmul = sr.jit(lambda a, b: a @ b, in_specs=(sr.P(None, "x"), sr.P("x")), out_specs=pending)
        c = matmul(a, b)
        linear = sr.jit(lambda c: c * 3.0 + c, in_specs=(pending,), out_specs=pending)
        d = linear(c)
        completed = {spec: sr.jit(lambda d: d * 1.0, in_specs=(spec,)) for spec in (sr.P(), sr.P("x"))}
        finals = {spec: f(d) for spec, f in completed.items()}
        kinds = [matmul.lower(a, b).collectives(), linear.lower(c).collectives()] + \
            [f.lower(d).collectives() for f in completed.values()]
        values = [np.asarray(x) for x in (c, d, *finals.values())]
    assert c.sharding.partial == d.sharding.partial == ("x",)
    assert kinds == [[], [], ["all_reduce"] if N > 1 else [], ["reduce_scatter"] if N > 1 else []]
    for got, want in zip(values, [a @ b, 4 * a @ b, 4 * a @ b, 4 * a @ b]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
