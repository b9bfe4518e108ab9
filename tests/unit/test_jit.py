"""sr.jit (cache per signature, pytrees, DArrays in and out) and the DArray constructors, in the simulated world."""
import threading

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

from simulated import errors_on_every_rank

MESH = sr.Mesh((2, 2), ("data", "model"))


def layer(params, x):
    h = snp.maximum(x @ params["w"] + params["b"], 0.0)
    return {"h": h, "norm": (h * h).sum()}


def reference(params, x):
    h = np.maximum(x @ params["w"] + params["b"], 0)
    return {"h": h, "norm": (h * h).sum()}


def make(rng, n=7, d=6, k=5):
    return ({"w": rng.standard_normal((d, k)).astype("float32"), "b": rng.standard_normal(k).astype("float32")},
            rng.standard_normal((n, d)).astype("float32"))


def test_jit_cache_hits_and_misses():
    rng = np.random.default_rng(0)
    params, x = make(rng)

    def body(comm):
        f = sr.jit(layer, mesh=MESH, comm=comm)
        outs = [f(params, x), f(params, x)]  # miss, hit
        info = [f.cache_info()]
        f(params, x[:5])  # new shape: miss
        f(params, sr.device_put(x, sr.P("data"), MESH, comm=comm))  # new sharding: miss
        f(params, sr.device_put(x, sr.P("data"), MESH, comm=comm))  # same sharding: hit
        f({**params, "extra": params["b"]}, x)  # new tree structure: miss
        f(params, x.astype("float64"))  # new dtype: miss
        info.append(f.cache_info())
        return [np.asarray(o["h"]) for o in outs], info

    for hs, info in run_simulated(MESH.size, body):
        assert info == [{"hits": 1, "misses": 1, "size": 1}, {"hits": 2, "misses": 5, "size": 5}]
        for h in hs:
            np.testing.assert_allclose(h, reference(params, x)["h"], rtol=1e-5)


def test_the_x64_switch_keys_the_cache():
    # int32's sum is int32 without x64 and int64 with it, and the mean float32 / float64: a program traced
    # with the switch off must not serve a call made with it on (nor the other way round)
    f = sr.jit(lambda x: (snp.sum(x), snp.mean(x)), mesh=sr.Mesh((1,), ("data",)))
    x = np.arange(6, dtype="int32")
    got = []
    try:
        for x64 in (False, True, False):
            sr.config.update("enable_x64", x64)
            got.append(tuple(np.asarray(o).dtype.name for o in f(x)))
    finally:
        sr.config.update("enable_x64", False)
    assert got == [("int32", "float32"), ("int64", "float64"), ("int32", "float32")], got
    assert f.cache_info() == {"hits": 1, "misses": 2, "size": 2}


def test_jit_returns_darrays_in_the_output_structure_and_lower_gives_the_program():
    rng = np.random.default_rng(1)
    params, x = make(rng)
    f = sr.jit(layer, mesh=MESH, in_specs=({"w": sr.P(None, "model"), "b": sr.P("model")}, sr.P("data")),
               out_specs={"h": sr.P("data", "model"), "norm": sr.P()})
    program = f.lower(params, x)
    assert [i.name for i in program.inputs] == ["params.b", "params.w", "x"]
    assert program.outputs[0].sharding == sr.Sharding((("data",), ("model",)))
    assert f.lower(params, x) is program and f.cache_info()["misses"] == 1

    def body(comm):
        out = sr.jit(f.fn, mesh=MESH, in_specs=f.in_specs, out_specs=f.out_specs, comm=comm)(params, x)
        return out, np.asarray(out["h"]), np.asarray(out["norm"])

    want = reference(params, x)
    for rank, (out, h, norm) in enumerate(run_simulated(MESH.size, body)):
        assert isinstance(out["h"], sr.DArray) and out["h"].shape == (7, 5)
        assert out["h"].local.shape == (4 if MESH.coords(rank)["data"] == 0 else 3,
                                        3 if MESH.coords(rank)["model"] == 0 else 2)
        np.testing.assert_allclose(h, want["h"], rtol=1e-5)
        np.testing.assert_allclose(norm, want["norm"], rtol=1e-4)


def test_static_argnums_and_context_mesh():
    def scale(x, k):
        return x * float(k)

    def body(comm):
        with MESH:
            f = sr.jit(scale, static_argnums=1, comm=comm)
            a, b = f(np.ones(4, "float32"), 2), f(np.ones(4, "float32"), 3)
            return np.asarray(a), np.asarray(b), f.cache_info()["misses"], f.lower(np.ones(4, "float32"), 2)

    for a, b, misses, program in run_simulated(MESH.size, body):
        np.testing.assert_array_equal(a, 2.0)
        np.testing.assert_array_equal(b, 3.0)
        assert misses == 2 and [i.name for i in program.inputs] == ["x"]


ROUND_TRIP_MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 8)] + [
    sr.Mesh((2, 2), ("x", "y")), sr.Mesh((2, 4), ("x", "y")), sr.Mesh((3, 2), ("x", "y"), devices=(5, 4, 3, 2, 1, 0))]
CASES = [(mesh, spec) for mesh in ROUND_TRIP_MESHES for spec in
         [sr.P(mesh.axis_names[0]), sr.P(None, mesh.axis_names[-1]), sr.P(tuple(mesh.axis_names)), sr.P()]]


@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_darray_round_trips_on_uneven_shardings(mesh, spec):
    x = np.arange(7 * 5, dtype="float32").reshape(7, 5)  # 7 and 5 split unevenly over 2, 3, 4, 8 ranks

    def body(comm):
        a = sr.device_put(x, spec, mesh, comm=comm)
        b = sr.from_local(a.local.copy(), spec, mesh, comm=comm)
        c = sr.scatter_from_root(x if comm.Get_rank() == 0 else None, spec, mesh, comm=comm)
        return a, b, c, np.asarray(a), b.gather(), np.asarray(c)

    for rank, (a, b, c, *globals_) in enumerate(run_simulated(mesh.size, body)):
        assert a.shape == b.shape == c.shape == (7, 5)
        np.testing.assert_array_equal(a.local, x[a.block_slices(rank)])
        np.testing.assert_array_equal(c.local, a.local)
        for g in globals_:
            np.testing.assert_array_equal(g, x)


@pytest.mark.parametrize("ranks", [1, 2])
def test_repeated_calls_on_uneven_blocks_work_out_no_block_bounds_again(ranks, monkeypatch):
    """A jitted step fed its own outputs (DArrays, 7 rows over 2 ranks: uneven tails padded and trimmed) gives
    NumPy's results, and after the first call no rank works a block's bounds out again (runner.Layout)."""
    rng = np.random.default_rng(0)
    params, x = make(rng)
    mesh = sr.Mesh((ranks,), ("data",))
    counted = []  # the thread (simulated rank) of each call
    real = sr.Sharding.block_slices
    monkeypatch.setattr(sr.Sharding, "block_slices", lambda *a: counted.append(threading.get_ident()) or real(*a))

    def step(params, x):
        return {"w": params["w"] * 0.5, "b": params["b"] + 1.0}, snp.maximum(x @ params["w"] + params["b"], 0.0)

    def body(comm):
        f = sr.jit(step, mesh=mesh, comm=comm, in_specs=(None, sr.P("data")))
        xs = sr.device_put(x, sr.P("data"), mesh, comm=comm)
        p, h = f(*f(params, xs)[:1], xs)  # NumPy params, then DArrays: two programs
        before = counted.count(threading.get_ident())
        for _ in range(2):
            p, h = f(p, xs)
        return counted.count(threading.get_ident()) - before, np.asarray(h), p["w"].gather(), p["b"].gather()

    w, b = params["w"], params["b"]
    for _ in range(4):  # the two first calls and two more
        w, b = w * 0.5, b + 1.0
    want = np.maximum(x @ (w * 2) + (b - 1), 0)  # the last call reads the params of the one before
    for extra, h, got_w, got_b in run_simulated(ranks, body):
        assert extra == 0
        np.testing.assert_allclose(h, want, rtol=1e-5)
        np.testing.assert_allclose(got_w, w, rtol=1e-6)
        np.testing.assert_allclose(got_b, b, rtol=1e-6)


def test_partial_sum_darray_gathers_to_the_sum():
    def body(comm):
        r = comm.Get_rank()
        d = sr.from_local(np.full((2, 3), float(r), "float32"), sr.P(partial="model"), sr.Mesh((4,), ("model",)),
                          comm=comm)
        return np.asarray(d)
    for g in run_simulated(4, body):
        np.testing.assert_array_equal(g, np.full((2, 3), 6.0))


def test_jit_of_a_partial_sum_input_reduces_it():
    mesh = sr.Mesh((2,), ("x",))

    def body(comm):
        d = sr.from_local(np.full(3, comm.Get_rank() + 1.0, "float32"), sr.P(partial="x"), mesh, comm=comm)
        return np.asarray(sr.jit(lambda v: v * 2.0, mesh=mesh, out_specs=sr.P(), comm=comm)(d))
    for g in run_simulated(2, body):
        np.testing.assert_array_equal(g, np.full(3, 6.0))


# ---------------------------------------------------------------- errors on every rank
_errors = errors_on_every_rank


def test_jit_with_different_shapes_on_different_ranks_raises_everywhere():
    errs = _errors(2, lambda comm: sr.jit(lambda x: x * 2.0, mesh=sr.Mesh((2,), ("x",)), comm=comm)(
        np.ones(4 if comm.Get_rank() == 0 else 5, "float32")))
    for e in errs:
        assert "must be called with the same argument shapes" in e and "float32[4]" in e and "float32[5]" in e


def test_jit_with_a_different_tree_on_one_rank_raises_everywhere():
    def call(comm):
        args = {"a": np.ones(2, "float32")} if comm.Get_rank() == 0 else {"b": np.ones(2, "float32")}
        sr.jit(lambda d: [v * 2.0 for v in d.values()], mesh=sr.Mesh((2,), ("x",)), comm=comm)(args)
    for e in _errors(2, call):
        assert "same argument shapes, dtypes, shardings and structure" in e and "'a'" in e and "'b'" in e


def test_trace_failure_on_one_rank_raises_everywhere():
    def fn(x):
        if x.shape[0] == 3:
            raise ValueError("cannot handle 3 rows")
        return x * 1.0

    for e in _errors(2, lambda comm: sr.jit(fn, mesh=sr.Mesh((2,), ("x",)), comm=comm)(
            np.ones(3 if comm.Get_rank() else 4, "float32"))):
        assert "errors on rank(s) [1]" in e and "cannot handle 3 rows" in e


def test_darray_on_another_mesh_raises_everywhere():
    def call(comm):
        d = sr.device_put(np.ones(4, "float32"), sr.P("y"), sr.Mesh((2,), ("y",)), comm=comm)
        sr.jit(lambda a: a * 2.0, mesh=sr.Mesh((2,), ("x",)), comm=comm)(d)
    for e in _errors(2, call):
        assert "a DArray argument must live on the jit mesh Mesh(x=2); got args.0 on Mesh(y=2)" in e


def test_spec_naming_a_missing_axis_raises_everywhere():
    def call(comm):
        with sr.Mesh((2,), ("x",)):
            sr.jit(lambda a: sr.mesh_split(a, sr.P("model")) * 2.0, comm=comm)(np.ones(4, "float32"))
    for e in _errors(2, call):
        assert "mesh axis must be one of ('x',); got 'model'" in e


def test_in_specs_structure_must_match_the_arguments():
    f = sr.jit(lambda d: d["a"] * 1.0, mesh=MESH, in_specs=({"b": sr.P()},))
    with pytest.raises(ValueError, match="in_specs must match the arguments' structure"):
        f.lower({"a": np.ones(2, "float32")})


def test_in_specs_structure_differing_from_one_ranks_arguments_raises_everywhere():
    def call(comm):
        args = {"b": np.ones(2, "float32")} if comm.Get_rank() == 1 else {"a": np.ones(2, "float32")}
        sr.jit(lambda d: [v * 1.0 for v in d.values()], mesh=MESH, in_specs=({"a": sr.P()},), comm=comm)(args)
    for e in _errors(4, call):
        assert e is not None and "errors on rank(s) [1]" in e and "in_specs must match the arguments' structure" in e


def test_from_local_with_wrong_block_raises_everywhere():
    def call(comm):
        sr.from_local(np.ones((3 if comm.Get_rank() == 1 else 4, 2), "float32"), sr.P("x"), sr.Mesh((2,), ("x",)),
                      shape=(8, 2), comm=comm)
    for e in _errors(2, call):
        assert "rank 1's block of a [8, 2] array laid out as [x, R] on Mesh(x=2) must have shape [4, 2]" in e


def test_scatter_from_root_with_bad_root_data_raises_everywhere():
    def call(comm):
        sr.scatter_from_root(np.ones((3,)) if comm.Get_rank() == 0 else None, sr.P("x", None),
                             sr.Mesh((2,), ("x",)), comm=comm)
    for e in _errors(2, call):
        assert "scatter_from_root: the root rank 0 could not lay out its array" in e and "ndim 1" in e


def test_a_darray_split_only_over_axes_of_size_one_is_taken_as_its_declared_layout():
    """Laid out "split" over a 1-rank axis, an argument holds the same blocks as replicated: an in_spec of P() takes
    it as it is (the ResNet fsdp step's running statistics on a 1-rank data axis); a split over a 2-rank axis is
    still refused."""
    x = np.arange(8, dtype="float32")
    one, two = sr.Mesh((1, 2), ("data", "model")), sr.Mesh((2, 1), ("data", "model"))
    assert sr.Sharding((("data",),)).on_split_axes(one) == sr.Sharding(((),))
    assert sr.Sharding((("data", "model"),)).on_split_axes(two) == sr.Sharding((("data",),))
    assert sr.Sharding(((),), ("model",)).on_split_axes(two) == sr.Sharding(((),))

    def body(comm, mesh):
        f = sr.jit(lambda a: a * 2.0, mesh=mesh, comm=comm, in_specs=(sr.P(),))
        try:
            return np.asarray(f(sr.device_put(x, sr.P("data"), mesh, comm=comm)))
        except ValueError as e:
            return str(e)

    for got in run_simulated(2, body, one):
        np.testing.assert_array_equal(got, 2 * x)
    for got in run_simulated(2, body, two):
        assert "in_specs must match the layout of a DArray argument" in got
