"""Loops as ops with a body: scan / fori_loop / while_loop / cond / remat, partitioned ONCE, against the
reference evaluator on 1-d and 2-d simulated meshes of 1, 2, 3, 4 and 8 ranks (uneven dims included)."""
import re
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from loop_cases import CASES, build_case
from simulated import run_everywhere
from test_autodiff import numeric_grads

MESHES = [sr.Mesh((1,), ("x",)), sr.Mesh((2,), ("x",)), sr.Mesh((3,), ("x",)), sr.Mesh((2, 2), ("x", "y")),
          sr.Mesh((4,), ("x",)), sr.Mesh((2, 4), ("x", "y")), sr.Mesh((8,), ("x",))]


def assert_matches(program, args, expected, rtol=1e-9):
    for rank, outs in enumerate(run_everywhere(program, *args)):
        assert len(outs) == len(expected)
        for k, (got, want) in enumerate(zip(outs, expected)):
            assert got.shape == want.shape and got.dtype == want.dtype, f"rank {rank} output {k}"
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-11, err_msg=f"rank {rank} output {k}")


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_loop_matches_reference(case, mesh):
    graph, program, args, expected = build_case(case, mesh)
    assert_matches(program, args, expected)


# ---------------------------------------------------------------- the reference itself
@pytest.mark.parametrize("policy", ["everything_saveable", "cheap_recomputed", "nothing_saveable", "dots_saveable",
                                    sr.checkpoint_policies.save_only_these_names("pre")], ids=str)
def test_scan_gradient_matches_finite_differences(policy):
    rng = np.random.default_rng(0)
    h, ws, b = rng.standard_normal((3, 4)), 0.5 * rng.standard_normal((3, 4, 4)), rng.standard_normal(4)

    def loss(h, ws, b):
        body = sr.remat(lambda c, w: (snp.tanh(sr.checkpoint_name(c @ w, "pre") + b), snp.sum(c)), policy)
        c, ys = sr.scan(body, h, ws)
        return snp.sum(c * c) + snp.sum(ys * ys)

    grads = sr.evaluate(sr.trace(sr.grad(loss, (0, 1, 2)), h, ws, b), h, ws, b)
    _, numeric = numeric_grads(loss, [h, ws, b], (0, 1, 2))  # central differences of the forward scan
    for g, n in zip(grads, numeric):
        np.testing.assert_allclose(g, n, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- what the forward scan stacks for the backward
def gelu_block(c, w):
    h = c @ w
    return 0.5 * h * (1.0 + snp.tanh(0.8 * (h + 0.04 * h * h * h))) + c, None


def softmax_block(c, w):
    s = c @ w
    e = snp.exp(s - snp.max(s, axis=-1, keepdims=True))
    return e / snp.sum(e, axis=-1, keepdims=True), None  # the sum's broadcast is read by the backward


SAVED_TABLE = [  # (body, ops the default policy stacks for the backward, in order)
    (gelu_block, ["einsum", "tanh"]),  # h and tanh(...); 0.5 * h, 1 + t, h * h ... recomputed
    # the (rows,) sum, not its (rows, cols) broadcast; the max's bool mask stays (smaller than its operands)
    (softmax_block, ["exp", "reduce", "div", "eq", "reduce"]),
]


def saved_residuals(body, policy):
    spec = [sr.TensorSpec((4, 6), "float64"), sr.TensorSpec((3, 6, 6), "float64")]
    step = sr.remat(body, policy) if policy else body  # None: the scan's default policy
    graph = sr.trace(sr.grad(lambda h, ws: snp.sum(sr.scan(step, h, ws)[0] ** 2), (0, 1)), *spec)
    scan = next(n for n in graph.nodes if n.op == "scan")
    body_graph = scan.attrs["body"]
    saved = [body_graph.nodes[o] for o in body_graph.outputs[1:]]  # after the carry
    saved = [n for n in saved if n.op != "parameter"]  # the iteration's carry, which the backward reads too
    return graph, [n.op for n in saved], sum(int(np.prod(n.shape)) for n in saved)


@pytest.mark.parametrize("body, ops", SAVED_TABLE, ids=[t[0].__name__ for t in SAVED_TABLE])
def test_the_default_policy_stacks_what_is_costly_to_recompute_and_recomputes_the_rest(body, ops):
    """A cheap residual (pointwise without transcendental or division, a broadcast, a reshape) is replaced
    by its operands when storing them costs no more: the forward scan stacks fewer bytes, the gradient is the
    same to the bit."""
    graph, saved_ops, saved_elements = saved_residuals(body, "cheap_recomputed")
    _, all_ops, all_elements = saved_residuals(body, "everything_saveable")
    assert sorted(saved_ops) == sorted(ops) and saved_elements < all_elements, (saved_ops, all_ops)
    assert saved_residuals(body, None)[1] == saved_ops  # the scan's default policy
    rng = np.random.default_rng(7)
    args = [rng.standard_normal((4, 6)), 0.3 * rng.standard_normal((3, 6, 6))]
    everything = saved_residuals(body, "everything_saveable")[0]
    for got, want in zip(sr.evaluate(graph, *args), sr.evaluate(everything, *args)):
        np.testing.assert_array_equal(got, want)


def named_block(c, w):
    h = sr.checkpoint_name(c @ w, "proj")
    return snp.tanh(h) * h + c, None


def backward_einsums(graph) -> int:
    return sum(n.op == "einsum" for n in [s for s in graph.nodes if s.op == "scan"][-1].attrs["body"].nodes)


def test_save_only_these_names_stacks_the_named_values_and_recomputes_the_rest():
    """JAX's ``checkpoint_name`` + ``checkpoint_policies.save_only_these_names``: the named product is stacked,
    so the backward body does not recompute it (one einsum fewer than "nothing_saveable"); a name the policy
    does not list saves nothing; the gradient is the same to the bit as saving everything."""
    policies = sr.checkpoint_policies
    graph, ops, elements = saved_residuals(named_block, policies.save_only_these_names("proj"))
    assert ops == ["checkpoint_name"] and elements == 4 * 6
    nothing = saved_residuals(named_block, policies.nothing_saveable)[0]
    assert backward_einsums(graph) == backward_einsums(nothing) - 1
    assert saved_residuals(named_block, policies.save_only_these_names("other"))[1:] == ([], 0)
    rng = np.random.default_rng(5)
    args = [rng.standard_normal((4, 6)), 0.3 * rng.standard_normal((3, 6, 6))]
    everything = saved_residuals(named_block, "everything_saveable")[0]
    for got, want in zip(sr.evaluate(graph, *args), sr.evaluate(everything, *args)):
        np.testing.assert_array_equal(got, want)


def test_checkpoint_name_is_no_instruction_and_bad_names_and_policies_are_refused():
    def f(x):
        return snp.sum(sr.checkpoint_name(snp.sin(x), "s") * 2.0)
    x = np.linspace(0.0, 1.0, 12).reshape(4, 3)
    graph = sr.trace(sr.value_and_grad(f), x)
    for mesh in (sr.Mesh((1,), ("x",)), sr.Mesh((3,), ("x",)), sr.Mesh((2, 2), ("x", "y"))):
        program = sr.partition(graph, mesh, in_specs=[("x", None)])
        assert "checkpoint_name" not in {i.op for i in program.instrs}
        assert_matches(program, [x], sr.evaluate(graph, x))
    with pytest.raises(ValueError, match="checkpoint_name takes a non-empty string name; got ''"):
        sr.trace(lambda x: sr.checkpoint_name(x, ""), x)
    with pytest.raises(ValueError, match=r"save_only_these_names takes one or more non-empty names; got \(\)"):
        sr.checkpoint_policies.save_only_these_names()
    with pytest.raises(ValueError, match="a remat policy is one of .* or checkpoint_policies.save_only_these_names"
                                         r"\(\.\.\.\); got 'some'"):
        sr.remat(lambda x: x, "some")


# ---------------------------------------------------------------- partitioned once
def deep_scan(length):
    def f(h, ws):
        c, _ = sr.scan(lambda c, w: (snp.tanh(c @ w), None), h, ws)
        return c
    return sr.trace(f, sr.TensorSpec((8, 4), "float64"), sr.TensorSpec((length, 4, 4), "float64"))


def test_bfloat16_carries_and_xs_are_differentiated():
    """bfloat16 is floating although NumPy does not say so: the reverse scan must not drop its gradients."""
    pytest.importorskip("ml_dtypes")

    def loss(h, ws, unrolled):
        if unrolled:
            for k in range(ws.shape[0]):
                h = snp.tanh(h @ ws[k])
        else:
            h, _ = sr.scan(lambda h, w: (snp.tanh(h @ w), None), h, ws)
        return snp.sum(snp.astype(h, "float32"))
    rng = np.random.default_rng(0)
    args = [sr.TensorSpec((2, 4), "bfloat16"), sr.TensorSpec((3, 4, 4), "bfloat16")]
    values = [rng.standard_normal(a.shape).astype(sr.dtypes.dtype("bfloat16")) for a in args]
    grads = [sr.evaluate(sr.trace(sr.grad(lambda h, w, u=u: loss(h, w, u), (0, 1)), *args), *values)
             for u in (False, True)]
    for scanned, unrolled in zip(*grads):
        assert np.abs(np.asarray(scanned, np.float32)).max() > 0.1
        np.testing.assert_allclose(np.asarray(scanned, np.float32), np.asarray(unrolled, np.float32), rtol=2e-2,
                                   atol=2e-2)


def test_body_is_partitioned_once_whatever_the_length():
    mesh = sr.Mesh((2,), ("x",))
    short, long = (sr.partition(deep_scan(n), mesh, in_specs=[("x", None), None]) for n in (2, 64))
    assert len(short.instrs) == len(long.instrs)
    listing = str(long)
    assert listing.count("einsum(") == 1 and listing.count("tanh(") == 1, listing
    assert re.search(r"scan\(.*length=64.*\n\s+body\(", listing), listing
    body = next(i for i in long.instrs if i.op == "scan").attrs["body"]
    assert [i.op for i in body.instrs if i.op not in ("parameter",)] == ["einsum", "tanh"]


def test_mesh_split_inside_the_body_constrains_the_carry():
    mesh = sr.Mesh((2, 2), ("x", "y"))

    def f(h, ws):
        def body(c, w):
            c = sr.mesh_split(c, mesh, ("x", "y"))
            return c * w, None
        return sr.scan(body, h, ws)[0]
    program = sr.partition(sr.trace(f, np.ones((4, 6)), np.ones((3, 4, 6))), mesh)
    scan = next(i for i in program.instrs if i.op == "scan")
    body = scan.attrs["body"]
    assert str(body.inputs[0].sharding) == "[x, y]" and str(body.outputs[0].sharding) == "[x, y]"
    assert str(body.inputs[1].sharding) == "[x, y]"  # the x slice follows the carry it multiplies
    assert not body.comm_summary(), str(program)  # nothing moves inside the loop
    assert str(program.outputs[0].sharding) == "[x, y]"


def test_xs_and_ys_keep_their_other_dims_split():
    mesh = sr.Mesh((4,), ("x",))

    def f(xs):
        xs = sr.mesh_split(xs, mesh, (None, "x"))
        return sr.scan(lambda c, x: (c + snp.sum(x), x * 2.0), snp.zeros((), "float64"), xs)[1]
    program = sr.partition(sr.trace(f, np.ones((5, 8))), mesh)
    body = next(i for i in program.instrs if i.op == "scan").attrs["body"]
    assert str(body.inputs[1].sharding) == "[x]" and str(program.outputs[0].sharding) == "[R, x]"
    xs = np.arange(40.0).reshape(5, 8)
    assert_matches(program, [xs], [xs * 2.0])


def test_split_scanned_dim_is_gathered_with_a_note():
    mesh = sr.Mesh((2,), ("x",))

    def f(xs):
        xs = sr.mesh_split(xs, mesh, ("x", None))
        return sr.scan(lambda c, x: (c + x, c), snp.zeros(3, "float64"), xs)
    xs = np.arange(12.0).reshape(4, 3)
    with pytest.warns(UserWarning, match=r"runs over dim 0 of .* split over \('x',\): all-gathered"):
        program = sr.partition(sr.trace(f, xs), mesh)
    assert_matches(program, [xs], [xs.sum(0), np.cumsum(xs, 0) - xs])


def test_loop_program_saved_loaded_and_run(tmp_path):
    mesh = sr.Mesh((2, 2), ("x", "y"))
    graph, program, args, expected = build_case(CASES[0], mesh)
    program.save(tmp_path / "loop.json")
    loaded = sr.load_program(tmp_path / "loop.json")
    assert loaded.hash == program.hash and str(loaded) == str(program)
    assert_matches(loaded, args, expected)


def test_remat_lowers_peak_memory():
    def program(policy):
        def loss(h, ws):
            body = sr.remat(lambda c, w: (snp.tanh((c @ w) * (c @ w)), None), policy)
            return snp.sum(sr.scan(body, h, ws)[0])
        graph = sr.trace(sr.grad(loss, (0, 1)), sr.TensorSpec((64, 32), "float64"), sr.TensorSpec((16, 32, 32), "float64"))
        return sr.partition(graph, sr.Mesh((1,), ("x",)))
    peaks = {p: program(p).peak_bytes() for p in ("everything_saveable", "dots_saveable", "nothing_saveable")}
    assert peaks["nothing_saveable"] < peaks["dots_saveable"] < peaks["everything_saveable"], peaks


def test_comm_summary_counts_a_loop_body_collective_per_iteration():
    mesh = sr.Mesh((2,), ("x",))

    def f(h, ws):
        return sr.scan(lambda c, w: (snp.tanh(c @ w), None), h, ws)[0]
    program = sr.partition(sr.trace(f, np.ones((4, 6)), np.ones((5, 6, 6))), mesh,
                           in_specs=[(None, "x"), (None, "x", None)])
    (entry,) = [c for c in program.comm_summary() if c.get("trips")]
    assert entry["trips"] == 5 and entry["kind"] == "reduce_scatter"  # the carry keeps its [R, x] split
    assert entry["wire_bytes"] == 5 * (2 - 1) / 2 * entry["bytes_in"]
    once = program.cost_model.seconds(entry["kind"], 2, entry["bytes_in"], entry["bytes_out"])
    assert once > 0 and entry["predicted_s"] == pytest.approx(5 * once)  # priced per trip too


# ---------------------------------------------------------------- errors
def trace_error(fn, *specs):
    return lambda: sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in specs])


@pytest.mark.parametrize("fn,specs,error,message", [
    (lambda x: sr.scan(lambda c, _: (c.sum(), None), x, length=2), [(3,)], TypeError,
     r"scan body must keep each carry's shape and dtype; got float64\[\] for carry leaf 0, which enters as "
     r"float64\[3\]"),
    (lambda x: sr.scan(lambda c, _: (c.astype("float32"), None), x, length=2), [(3,)], TypeError,
     r"float32\[3\] for carry leaf 0"),
    (lambda x: sr.scan(lambda c, _: ((c, c), None), x, length=2), [(3,)], TypeError, "keep the carry's structure"),
    (lambda x: sr.while_loop(lambda c: c > 0, lambda c: c, x), [(3,)], TypeError,
     r"cond_fun must return a scalar bool \(shape \(\), dtype bool\); got bool\[3\]"),
    (lambda x: sr.while_loop(lambda c: c.sum(), lambda c: c, x), [(3,)], TypeError, r"got float64\[\]"),
    (lambda x: sr.cond(x, lambda a: a, lambda a: a, x), [(3,)], TypeError,
     r"cond's predicate must be a scalar bool .*got float64\[3\]"),
    (lambda x: sr.cond(x.sum() > 0, lambda a: a, lambda a: a.sum(), x), [(3,)], TypeError,
     "branches must return the same structure, shapes and dtypes"),
    (lambda x: sr.fori_loop(0, x.sum(), lambda i, c: c, x), [(3,)], TypeError, "Python int bounds"),
    (lambda x: sr.scan(lambda c, y: (c, y), x, np.ones((2, 3)), length=3), [(3,)], ValueError,
     "same leading dim, equal to length"),
    (lambda x: sr.grad(lambda a: sr.while_loop(lambda c: c.sum() < 9.0, lambda c: c * 2.0, a).sum())(x), [(3,)],
     NotImplementedError, "through sr.while_loop is not supported"),
    (lambda x: sr.remat(lambda a: a, "most")(x), [(3,)], ValueError, "remat policy is one of"),
])
def test_bad_loops_raise_clear_errors(fn, specs, error, message):
    with pytest.raises(error, match=message):
        trace_error(fn, *specs)()
