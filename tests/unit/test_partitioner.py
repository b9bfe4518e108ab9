"""Partitioner table tests, in the style of XLA's spmd_partitioner_test:
(function, input shardings, mesh) -> the exact collectives emitted, plus numerics
against the reference evaluator in the simulated world."""
import gc

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

MESH_2x4 = sr.Mesh((2, 4), ("data", "model"))
MESH_4 = sr.Mesh((4,), ("x",))


def megatron_mlp(x, w1, w2):
    return snp.maximum(x @ w1, 0.0) @ w2


def contract_split_result(x, w):
    return x @ w


def two_projections(x, w1, w2):
    return (x @ w1) * (x @ w2)


def identity(x):
    return x * 1.0


def softmax(x):
    e = snp.exp(x - snp.max(x, axis=-1, keepdims=True))
    return e / snp.sum(e, axis=-1, keepdims=True)


def row_sum_then_scale(x):
    return x / snp.sum(x, axis=0)


# (name, fn, shapes, mesh, in_specs, out_specs, expected [(kind, axes)] in program order)
TABLE = [
    ("megatron_mlp", megatron_mlp, [(8, 16), (16, 32), (32, 16)], MESH_2x4,
     [("data", None), (None, "model"), ("model", None)], None, [("all_reduce", ("model",))]),
    ("contracting_split_result", contract_split_result, [(8, 16), (16, 8)], MESH_4,
     [(None, "x"), ("x", None)], [("x", None)], [("reduce_scatter", ("x",))]),
    ("contracting_split_result_2d", contract_split_result, [(8, 16), (16, 8)], MESH_2x4,
     [("data", "model"), ("model", None)], [("data", "model")], [("reduce_scatter", ("model",))]),
    ("dim_to_dim_reshard", identity, [(8, 8)], MESH_4, [("x", None)], [(None, "x")], [("all_to_all", ("x",))]),
    ("softmax_split_dim", softmax, [(8, 16)], MESH_2x4, [("data", "model")], [("data", "model")],
     [("all_reduce", ("model",)), ("all_reduce", ("model",))]),
    ("data_parallel_matmul", contract_split_result, [(8, 16), (16, 8)], MESH_4, [("x", None), None],
     [("x", None)], []),
    ("gather_for_replicated_out", identity, [(8, 8)], MESH_2x4, [("data", "model")], [(None, None)],
     [("all_gather", ("data",)), ("all_gather", ("model",))]),
    ("reduce_split_dim", row_sum_then_scale, [(8, 8)], MESH_4, [("x", None)], None, [("all_reduce", ("x",))]),
    ("reshard_xy_to_yx_2x4", identity, [(8, 8)], MESH_2x4, [("data", "model")], [("model", "data")],
     [("all_to_allv", ("data", "model"))]),  # both dims change axes: one exchange (was gather + all-to-all)
    # the same einsum (spec, shapes, x's layout) twice: w1 split on its columns is local, w2 split on its rows
    # sums partials (the einsum's choice is made per operand layouts, and taken once per distinct layouts)
    ("same_einsum_other_weight_layouts", two_projections, [(2, 64), (64, 8), (64, 8)], MESH_4,
     [(None, None), (None, "x"), ("x", None)], None, [("reduce_scatter", ("x",))]),
    ("device_order_change", identity, [(8, 8)], MESH_2x4, [(("data", "model"), None)],
     [(("model", "data"), None)], [("collective_permute", ("data", "model"))]),
]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_specs,expected", TABLE, ids=[t[0] for t in TABLE])
def test_collectives_and_numerics(name, fn, shapes, mesh, in_specs, out_specs, expected):
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s) for s in shapes]
    graph = sr.trace(fn, *args)
    program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=out_specs)
    got = [(c["kind"], c["axes"]) for c in program.comm_summary()]
    assert got == expected, str(program)
    want = sr.evaluate(graph, *args)
    for outs in run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm)):
        np.testing.assert_allclose(outs[0], want[0], rtol=1e-12, atol=1e-12)


def test_megatron_mlp_from_annotations_inside_the_function():
    """mesh_split inside the traced function, no in_specs: one all-reduce of the output along model."""
    def mlp(x, w1, w2):
        x = sr.mesh_split(x, MESH_2x4, ("data", None))
        w1 = sr.mesh_split(w1, MESH_2x4, (None, "model"))
        w2 = sr.mesh_split(w2, MESH_2x4, ("model", None))
        return megatron_mlp(x, w1, w2)
    program = sr.partition(sr.trace(mlp, sr.TensorSpec((8, 16), "float64"), sr.TensorSpec((16, 32), "float64"), sr.TensorSpec((32, 16), "float64")),
                           MESH_2x4)
    summary = program.comm_summary()
    assert [(c["kind"], c["axes"], c["group_size"]) for c in summary] == [("all_reduce", ("model",), 4)]
    # local output block 4x16 float64 = 512 bytes; ring all-reduce moves 2(k-1)/k of it
    assert summary[0]["bytes_in"] == 512 and summary[0]["wire_bytes"] == pytest.approx(2 * 3 / 4 * 512)
    assert program.outputs[0].sharding == sr.Sharding((("data",), ()))


def test_reduce_scatter_beats_all_reduce_then_slice():
    program = sr.partition(sr.trace(contract_split_result, sr.TensorSpec((8, 16), "float64"), sr.TensorSpec((16, 8), "float64")),
                           MESH_4, in_specs=[(None, "x"), ("x", None)], out_specs=[("x", None)])
    assert "all_reduce" not in program.collectives()
    assert program.wire_bytes == pytest.approx(3 / 4 * 8 * 8 * 8)


def test_propagation_reports_origin_and_keeps_user_annotation():
    graph = sr.trace(megatron_mlp, sr.TensorSpec((8, 16), "float64"), sr.TensorSpec((16, 32), "float64"), sr.TensorSpec((32, 16), "float64"))
    program = sr.partition(graph, MESH_2x4, in_specs=[("data", None), (None, "model"), ("model", None)])
    report = program.report
    assert report[graph.params[1]] == (sr.Sharding(((), ("model",))), "user")
    hidden = graph.nodes[graph.outputs[0]].inputs[0]  # relu(x @ w1)
    assert report[hidden] == (sr.Sharding((("data",), ("model",))), "propagated")


def test_missing_partition_rule_fails_at_partition_time_naming_the_op():
    graph = sr.trace(identity, sr.TensorSpec((8, 8), "float64"))
    graph.add("fancy_op", [graph.outputs[0]], {}, (8, 8), "float64")
    graph.outputs[0] = len(graph.nodes) - 1
    with pytest.raises(NotImplementedError, match="fancy_op"):
        sr.partition(graph, MESH_4)


def test_uneven_batch_on_4_ranks_pads_masks_and_trims():
    """10 rows on 4 ranks: shards of 3, the last holds 1 real row; the column sum masks the padding and
    needs exactly one all-reduce; outputs come back at the true size."""
    graph = sr.trace(lambda x: snp.sum(snp.log(x), axis=0), sr.TensorSpec((10, 6), "float64"))
    program = sr.partition(graph, MESH_4, in_specs=[("x", None)])
    assert program.inputs[0].sharding.local_shape((10, 6), MESH_4) == (3, 6)
    assert [i.op for i in program.instrs if i.op not in ("parameter",)] == [
        "log", "mask_padding", "reduce", "all_reduce"]
    x = np.random.default_rng(0).uniform(0.5, 2.0, (10, 6))
    for (out,) in run_simulated(4, lambda comm: sr.run(program, x, comm=comm)):
        np.testing.assert_allclose(out, np.log(x).sum(axis=0), rtol=1e-12)


def test_uneven_run_local_takes_and_returns_true_blocks():
    program = sr.partition(sr.trace(lambda x: x * 2.0, sr.TensorSpec((10,), "float64")), MESH_4, in_specs=[("x",)],
                           out_specs=[("x",)])
    x = np.arange(10.0)
    blocks = [x[0:3], x[3:6], x[6:9], x[9:10]]
    outs = run_simulated(4, lambda comm: sr.run_local(program, blocks[comm.Get_rank()], comm=comm)[0])
    for block, out in zip(blocks, outs):
        np.testing.assert_array_equal(out, 2 * block)


def test_conflicting_mesh_is_refused():
    other = sr.Mesh((4,), ("y",))
    graph = sr.trace(lambda x: sr.mesh_split(x, other, ("y", None)) * 2.0, sr.TensorSpec((8, 8), "float64"))
    with pytest.raises(ValueError, match="partition mesh"):
        sr.partition(graph, MESH_4)


def test_partition_restores_the_cycle_collector():
    """partition() turns CPython's cycle collector off while it runs (partitioner.py: _gc_paused) and back on
    after, also when it raises; a caller's own gc.disable() is left as it was. ``timings`` gets each pass."""
    graph = sr.trace(identity, np.ones((8, 8)))
    try:
        assert gc.isenabled()
        timings = {}
        program = sr.partition(graph, MESH_4, in_specs=[("x", None)], out_specs=[(None, "x")], fuse=True,
                               overlap=True, timings=timings)
        assert gc.isenabled()
        assert timings["schedule_instrs"] == len(program.instrs) and timings["partition"] >= 0
        with pytest.raises(ValueError, match="nope"):
            sr.partition(graph, MESH_4, in_specs=[("nope", None)])
        assert gc.isenabled()
        gc.disable()
        sr.partition(graph, MESH_4, in_specs=[("x", None)])
        assert not gc.isenabled()
    finally:
        gc.enable()
