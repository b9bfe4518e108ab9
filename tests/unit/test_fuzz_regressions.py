"""Named regression tests for failures the differential fuzzer found (scripts/fuzz.py)."""
import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.partition.resharding import _greedy

from simulated import run_everywhere


def test_out_spec_that_disagrees_with_mesh_split_reshards_at_the_output():
    """Fuzz seeds 4, 6, 20: an out spec on an annotated value used to be refused as a second user sharding."""
    mesh = sr.Mesh((2, 2), ("x", "y"))
    graph = sr.trace(lambda a: sr.mesh_split(a * 2.0, mesh, ("x", "y")), sr.TensorSpec((6, 4), "float64"))
    program = sr.partition(graph, mesh, out_specs=[("y", None)])
    assert program.outputs[0].sharding == sr.Sharding((("y",), ()))
    x = np.arange(24.0).reshape(6, 4)
    for (out,) in run_everywhere(program, x):
        np.testing.assert_array_equal(out, 2 * x)


def test_same_value_returned_twice_with_two_out_specs():
    mesh = sr.Mesh((4,), ("x",))
    graph = sr.trace(lambda a: (a + 1.0, a + 1.0), sr.TensorSpec((5, 3), "float64"))
    program = sr.partition(graph, mesh, out_specs=[("x", None), (None, "x")])
    x = np.ones((5, 3))
    for outs in run_everywhere(program, x):
        np.testing.assert_array_equal(outs[0], x + 1) and np.testing.assert_array_equal(outs[1], x + 1)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_size_one_mesh_axis_counts_as_unsplit_when_padding():
    """Fuzz seeds 66, 244, 287: on a (1, 4) mesh a dim split only over the size-1 axis was not padded
    before an all-to-all split it 4 ways (dim 5 not divisible by 4)."""
    mesh = sr.Mesh((1, 4), ("x", "y"))
    graph = sr.trace(lambda a: a * 1.0, sr.TensorSpec((10, 5), "float64"))
    program = sr.partition(graph, mesh, in_specs=[(("y", "x"), None)], out_specs=[(None, ("x", "y"))])
    src, dst = program.inputs[0].sharding, program.outputs[0].sharding
    assert "all_to_all" in [s.op for s in _greedy(src, dst, (10, 5), mesh)]  # the padded path, still the bound
    assert program.collectives() == ["all_to_allv"]  # the searched plan sends true blocks, no padding
    x = np.arange(50.0).reshape(10, 5)
    for (out,) in run_everywhere(program, x):
        np.testing.assert_array_equal(out, x)


def test_output_that_views_a_buffer_blocks_writing_into_it_in_place():
    """Fuzz seeds 163, 402: ``y = x * s`` returned as ``y.T`` (a view) while ``y * t`` was written into y's
    buffer in place, corrupting the transposed output."""
    def fn(a, s, t):
        y = a * s
        return y * t, y.T
    mesh = sr.Mesh((2,), ("x",))
    program = sr.partition(sr.trace(fn, *[sr.TensorSpec((4, 4), "float64")] * 3), mesh)
    product = next(i for i in program.instrs if i.op == "mul")
    assert all(i.donate < 0 for i in program.instrs if product.out in i.args)
    rng = np.random.default_rng(0)
    a, s, t = (rng.standard_normal((4, 4)) for _ in range(3))
    for first, second in run_everywhere(program, a, s, t):
        np.testing.assert_array_equal(first, a * s * t)
        np.testing.assert_array_equal(second, (a * s).T)


def test_dying_elementwise_buffer_is_reused_in_place():
    mesh = sr.Mesh((2,), ("x",))
    graph = sr.trace(lambda a: (sr.numpy.exp(a) + 1.0) * 2.0, sr.TensorSpec((8, 4), "float64"))
    program = sr.partition(graph, mesh, in_specs=[("x", None)], fuse=False)  # one instruction per op
    ops = {i.op: i for i in program.instrs}
    assert ops["add"].donate == 0 and ops["mul"].donate == 0 and ops["exp"].donate == -1  # a is the caller's
    (fusion,) = [i for i in sr.partition(graph, mesh, in_specs=[("x", None)]).instrs if i.op == "fusion"]
    assert fusion.donate == -1  # fused, the chain still never writes into the caller's a
    x = np.linspace(-1, 1, 32).reshape(8, 4)
    for (out,) in run_everywhere(program, x):
        np.testing.assert_allclose(out, (np.exp(x) + 1) * 2, rtol=1e-15)
