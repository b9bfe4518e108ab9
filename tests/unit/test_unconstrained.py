"""``sr.UNCONSTRAINED``: a propagation state, not a pre-pass. The annotated value's other dims are pinned; its
free dims are chosen by propagation from its neighbours (operands forward, users backward), with the axes the
pinned dims leave, and propagation goes on through it. In loop bodies too. A case table:
(function, in/out specs) -> the sharding of the named value, and the values against the reference.
"""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import P, UNCONSTRAINED as U
from spmd_runtime.comm import run_simulated

MESH = sr.Mesh((2, 2), ("data", "model"))
X, W = sr.TensorSpec((8, 6), "float64"), sr.TensorSpec((6, 4), "float64")


def free_from_operand(x, w):  # dim 0 of h from x's rows (forward through the contraction)
    x = sr.mesh_split(x, P("data", None))
    return snp.exp(sr.mesh_split(x @ w, P(U, "model"), name="h"))


def free_from_user(x, w):  # dim 0 of h from the value that uses it (backward)
    h = sr.mesh_split(snp.tanh(x @ w), P(U, None), name="h")
    return sr.mesh_split(h * 2.0, P("model", None))


def free_drops_a_pinned_axis(x, w):  # the neighbour offers "model", which the pinned dim holds: dim 0 unsplit
    x = sr.mesh_split(x, P("model", None))
    return sr.mesh_split(x @ w, P(U, "model"), name="h") + 1.0


def pinned_dim_wins(x, w):  # the operand splits dim 1 over "data"; the annotation pins it replicated
    x = sr.mesh_split(x, P("data", None))
    w = sr.mesh_split(w, P(None, "model"))
    return sr.mesh_split(x @ w, P(U, None), name="h") * 3.0


def through_the_free_value(x, w):  # a value after h inherits both the pinned and the chosen dim
    x = sr.mesh_split(x, P("model", None))
    h = sr.mesh_split(snp.exp(x) @ w, P(U, "data"), name="h")
    return sr.mesh_split(h - 1.0, P(U, U), name="after")


def free_from_another_pinned_dim(x, w):  # c's free dim takes the axis a's annotation pins (a's transpose):
    a = sr.mesh_split(snp.exp(x), P(U, "model"), name="a")  # a first pass that set loose annotations aside
    return sr.mesh_split(snp.transpose(a, (1, 0)) * 2.0, P(U, None), name="c")  # left c replicated (a gather)


CASES = {
    "another annotation's pinned dim": (free_from_another_pinned_dim, {"a": ((), ("model",)), "c": (("model",), ())}),
    "forward": (free_from_operand, {"h": (("data",), ("model",))}),
    "backward": (free_from_user, {"h": (("model",), ())}),
    "drops pinned axis": (free_drops_a_pinned_axis, {"h": ((), ("model",))}),
    "pinned wins": (pinned_dim_wins, {"h": (("data",), ())}),
    "through": (through_the_free_value, {"h": (("model",), ("data",)), "after": (("model",), ("data",))}),
}


def traced(fn, *specs):
    with MESH:  # the annotations name no mesh: the context one
        return sr.trace(fn, *specs)


def reference(fn, x, w):
    return sr.evaluate(traced(fn, X, W), x, w)


@pytest.mark.parametrize("case", sorted(CASES))
def test_free_dims_are_chosen_by_propagation_from_neighbours(case):
    fn, want = CASES[case]
    program = sr.partition(traced(fn, X, W), MESH)
    for name, dims in want.items():
        sharding, origin = program.report[name]
        assert sharding.dims == dims, (name, sharding)
        assert origin == "user"
    if case == "another annotation's pinned dim":
        assert not program.comm_summary()  # c's layout follows from a's: nothing moves
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(X.shape), rng.standard_normal(W.shape)
    expected = reference(fn, x, w)
    for outs in run_simulated(MESH.size, lambda comm: sr.run(program, x, w, comm=comm)):
        np.testing.assert_allclose(outs[0], expected[0], rtol=1e-12)


def test_unconstrained_in_and_out_specs_take_their_neighbours_dims():
    def f(x, w):
        return sr.mesh_split(x @ w, P("data", "model"))
    program = sr.partition(traced(f, X, W), MESH, in_specs=[P(U, None), P(None, U)], out_specs=[P(U, U)])
    assert program.inputs[0].sharding.dims == (("data",), ())  # from the product's rows (backward)
    assert program.inputs[1].sharding.dims == ((), ("model",))  # from the product's columns
    assert program.outputs[0].sharding.dims == (("data",), ("model",))  # from the annotated value
    assert not [c for c in program.comm_summary()]  # every layout agreed: nothing moves


def test_an_unconstrained_out_spec_keeps_its_pinned_dims():
    def f(x, w):
        return sr.mesh_split(x, P("data", "model")) @ w
    program = sr.partition(traced(f, X, W), MESH, out_specs=[P(U, "data")])
    assert program.outputs[0].sharding.dims == ((), ("data",))  # "data" is pinned on dim 1: dim 0 cannot use it


def test_an_unconstrained_dim_inside_a_scan_body_takes_the_carry_layout():
    def f(x):
        def body(c, _):
            return sr.mesh_split(snp.tanh(c), P(U, None), name="inner") * 0.5, None
        x = sr.mesh_split(x, P("data", None))
        return sr.scan(body, x, None, length=3)[0]
    program = sr.partition(traced(f, X), MESH)
    # the body is partitioned once, its loose annotation taking the rows' split from the carry: no collective
    assert not program.comm_summary(), program.comm_summary()
    rng = np.random.default_rng(2)
    x = rng.standard_normal(X.shape)
    expected = sr.evaluate(traced(f, X), x)[0]
    for outs in run_simulated(MESH.size, lambda comm: sr.run(program, x, comm=comm)):
        np.testing.assert_allclose(outs[0], expected, rtol=1e-12)
