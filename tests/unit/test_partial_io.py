"""Partial-sum inputs and outputs (DTensor's ``Partial``; ``P(..., partial="x")``), in the simulated world.

A jitted (or partitioned) function whose output is declared partial returns a DArray of pending sums with no
collective; ``np.asarray`` / ``.gather()`` / ``sr.run`` complete them. Passed on to a function that declares the
input partial it is used without a collective (linear ops keep the sum pending); declared final, the planner
completes it with one all-reduce or reduce-scatter. A case table: (mesh, function, specs) -> the exact
collectives of each program and the values against NumPy.
"""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import P
from spmd_runtime.comm import run_simulated

from simulated import errors_on_every_rank

RNG = np.random.default_rng(0)
A, B = RNG.standard_normal((8, 12)), RNG.standard_normal((12, 6))
AB = A @ B

# mesh, the specs of A and B for a contraction split on "x", the partial out spec (rows kept on "y"), and the
# final layouts a consumer may declare: completed in place, and completed with the rows split over "x" too
MESHES = {
    "2": (sr.Mesh((2,), ("x",)), (P(None, "x"), P("x")), P(partial="x"), (P(), P("x"))),
    "4": (sr.Mesh((4,), ("x",)), (P(None, "x"), P("x")), P(partial="x"), (P(), P("x"))),
    "3-uneven": (sr.Mesh((3,), ("x",)), (P(None, "x"), P("x")), P(partial="x"), (P(), P("x"))),
    "2x2": (sr.Mesh((2, 2), ("y", "x")), (P("y", "x"), P("x")), P("y", partial="x"), (P("y"), P(("y", "x")))),
    "2x4": (sr.Mesh((2, 4), ("y", "x")), (P("y", "x"), P("x")), P("y", partial="x"), (P("y"), P(("y", "x")))),
}


def collectives(program):
    return [(c["kind"], c["axes"]) for c in program.comm_summary()]


def pending_product(mesh, specs, out, comm):
    """A @ B left as a pending sum over "x", and the program that made it."""
    f = sr.jit(lambda a, b: a @ b, mesh=mesh, in_specs=specs, out_specs=out, comm=comm)
    return f(A, B), f.lower(A, B)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_partial_output_keeps_its_pending_sums_and_gathers_to_the_value(name):
    mesh, specs, out, _ = MESHES[name]

    def body(comm):
        d, program = pending_product(mesh, specs, out, comm)
        return d.sharding, d.local, d.block_slices(), collectives(program), np.asarray(d)
    results = run_simulated(mesh.size, body)
    total = np.zeros_like(AB)
    for sharding, local, where, colls, gathered in results:
        assert colls == [] and sharding.partial == ("x",)  # no reduction ran
        total[where] += local
        np.testing.assert_allclose(gathered, AB, rtol=1e-12)
    np.testing.assert_allclose(total, AB, rtol=1e-12)  # the blocks (rows split on "y") sum over "x" to A @ B
    assert not np.allclose(results[0][1], AB[results[0][2]])  # one rank's block is a summand, not the value


# (function of the pending product, its in spec, out spec) -> its collectives, the value
CHAINS = {
    "declared partial, linear ops": (lambda c: (c * 3.0 - c) / 2.0 + c, "partial", "partial", [], 2 * AB),
    "declared final, in place": (lambda c: c, "final", None, [("all_reduce", ("x",))], AB),
    "declared final, split": (lambda c: c, "split", None, [("reduce_scatter", ("x",))], AB),
    "undeclared, non-linear op": (lambda c: snp.exp(c), None, None, [("all_reduce", ("x",))], np.exp(AB)),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("name", ["2", "4", "2x2"])
def test_a_partial_darray_passed_on_is_used_as_declared(name, chain):
    mesh, specs, out, (final, split) = MESHES[name]
    fn, in_spec, out_spec, want_colls, want = CHAINS[chain]
    in_spec, out_spec = ({"partial": out, "final": final, "split": split, None: None}[s] for s in (in_spec, out_spec))

    def body(comm):
        d, _ = pending_product(mesh, specs, out, comm)
        g = sr.jit(fn, mesh=mesh, in_specs=None if in_spec is None else (in_spec,), out_specs=out_spec, comm=comm)
        result = g(d)
        return collectives(g.lower(d)), result.sharding, np.asarray(result)
    for colls, sharding, value in run_simulated(mesh.size, body):
        assert colls == want_colls
        assert bool(sharding.partial) == (out_spec is not None and bool(out_spec.partial))
        np.testing.assert_allclose(value, want, rtol=1e-12)


@pytest.mark.parametrize("name", ["2", "2x2"])
def test_three_step_api_partial_outputs_and_inputs(name):
    mesh, specs, out, _ = MESHES[name]
    product = sr.partition(sr.trace(lambda a, b: a @ b, A, B), mesh, in_specs=list(specs), out_specs=[out])
    assert collectives(product) == [] and product.outputs[0].sharding.partial == ("x",)
    scale = sr.partition(sr.trace(lambda c: c * 2.0, AB), mesh, in_specs=[out], out_specs=[out])
    assert collectives(scale) == [] and scale.inputs[0].sharding.partial == ("x",)

    def body(comm):
        whole = sr.run(product, A, B, comm=comm)[0]  # sr.run completes the pending sums
        summands = sr.run_local(product, *(sr.exec.runner.shard(x, s.sharding, mesh, comm.Get_rank())
                                           for x, s in zip((A, B), product.inputs)), comm=comm)[0]
        doubled = sr.run(scale, AB, comm=comm)[0]  # a global value given for a partial input: one summand holds it
        return whole, summands, doubled
    results = run_simulated(mesh.size, body)
    for whole, summands, doubled in results:
        np.testing.assert_allclose(whole, AB, rtol=1e-12)
        np.testing.assert_allclose(doubled, 2 * AB, rtol=1e-12)
    x_ranks = [r for r in range(mesh.size) if all(mesh.coords(r)[a] == 0 for a in mesh.axis_names if a != "x")]
    rows = product.outputs[0].sharding.block_slices(AB.shape, mesh, x_ranks[0])
    np.testing.assert_allclose(sum(results[r][1] for r in x_ranks), AB[rows], rtol=1e-12)


def test_the_jit_cache_keys_on_pending_sums():
    mesh, specs, out, (final, _) = MESHES["2"]

    def body(comm):
        d, _ = pending_product(mesh, specs, out, comm)
        f = sr.jit(lambda c: c * 2.0, mesh=mesh, comm=comm)
        f(d)  # miss
        f(sr.device_put(d, final))  # the same shape, completed: another program (miss)
        values = [np.asarray(f(d)), np.asarray(f(sr.device_put(d, final)))]  # hits
        return f.cache_info(), values
    for info, values in run_simulated(2, body):
        assert info == {"hits": 2, "misses": 2, "size": 2}
        for v in values:
            np.testing.assert_allclose(v, 2 * AB, rtol=1e-12)


# ---------------------------------------------------------------- mismatches: errors on every rank
_errors = errors_on_every_rank


def test_an_output_declared_partial_that_is_no_pending_sum_raises_everywhere():
    mesh = sr.Mesh((2,), ("x",))
    errs = _errors(2, lambda comm: sr.jit(lambda c: snp.exp(c), mesh=mesh, out_specs=P(partial="x"), comm=comm)(AB))
    for e in errs:
        assert e is not None and "errors on rank(s) [0, 1]" in e
        assert "resharding can keep pending (partial) reductions as they are or complete them, not create them" in e
        assert "got [R, R] -> [R, R] Psum(x)" in e


def test_a_partial_spec_using_an_axis_twice_raises_everywhere():
    mesh, specs, out, _ = MESHES["2x2"]

    def call(comm):
        d, _ = pending_product(mesh, specs, out, comm)
        sr.jit(lambda c: c * 1.0, mesh=mesh, in_specs=(P("y", partial="y"),), comm=comm)(d)
    for e in _errors(4, call):
        assert e is not None and "a mesh axis may shard a tensor at most once" in e


def test_a_partial_darray_declared_partial_over_the_wrong_axis_raises_everywhere():
    mesh = sr.Mesh((2, 2), ("y", "x"))

    def call(comm):
        d, _ = pending_product(mesh, (P(None, "x"), P("x")), P(partial="x"), comm)
        sr.jit(lambda c: c * 1.0, mesh=mesh, in_specs=(P(partial="y"),), comm=comm)(d)
    for e in _errors(4, call):
        assert e is not None and "errors on rank(s) [0, 1, 2, 3]" in e
        assert "in_specs must match the layout of a DArray argument" in e and "laid out as [R, R] Psum(x)" in e


def test_device_put_refuses_a_partial_spec_for_a_global_value_everywhere():
    for e in _errors(2, lambda comm: sr.device_put(AB, P(partial="x"), sr.Mesh((2,), ("x",)), comm=comm)):
        assert e is not None and "device_put lays out a global value, which is not a partial sum" in e


def test_p_compares_only_with_tuples():
    assert P() == () and P("x") == ("x",) and P("x") != P("x", partial="y")
    assert P() != "final" and P() != None and not (P() == "final")  # noqa: E711
