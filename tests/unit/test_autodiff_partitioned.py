"""Partitioned gradients: traced value_and_grad graphs partitioned over simulated meshes match the reference
evaluator, gradient shardings follow their primal values, and data-parallel weight gradients cost exactly
one all-reduce each."""
import inspect

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad, value_and_grad
from spmd_runtime.comm import run_simulated
from spmd_runtime.models import BlockConfig, block_params, megatron_specs, transformer_block

# (mesh, data axis, model axis)
MESHES = [
    (sr.Mesh((2,), ("data",)), "data", None),
    (sr.Mesh((4,), ("model",)), None, "model"),
    (sr.Mesh((2, 2), ("data", "model")), "data", "model"),
    (sr.Mesh((2, 4), ("data", "model")), "data", "model"),
]
MESH_IDS = ["2:data", "4:model", "2x2", "2x4"]


def flat(fn, argnums):
    """value_and_grad(fn) with flat outputs (value, grad_0, grad_1, ...) for sr.trace."""
    def f(*args):
        value, grads = value_and_grad(fn, argnums)(*args)
        return (value, *grads)
    f.__signature__ = inspect.signature(fn)  # inputs keep their names
    return f


def run_and_compare(graph, program, args, rtol=1e-10):
    want = sr.evaluate(graph, *args)
    for rank, outs in enumerate(run_simulated(program.mesh.size, lambda comm: sr.run(program, *args, comm=comm))):
        for k, (o, w) in enumerate(zip(outs, want)):
            np.testing.assert_allclose(o, w, rtol=rtol, atol=1e-12, err_msg=f"rank {rank} output {k}")


def assert_grads_sharded_like_inputs(program, argnums):
    for k, i in enumerate(argnums):
        got, want = program.outputs[1 + k].sharding, program.inputs[i].sharding
        assert got == want, f"gradient of {program.inputs[i].name} is {got}, its value is {want}\n{program}"


# ---------------------------------------------------------------- Megatron MLP
def mlp_loss(x, w1, w2, y):
    h = snp.maximum(x @ w1, 0.0) @ w2
    return snp.mean((h - y) ** 2.0)


def mlp_args(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((8, 16), (16, 32), (32, 16), (8, 16))]


@pytest.mark.parametrize("mesh,data,model", MESHES, ids=MESH_IDS)
def test_megatron_mlp_gradients_match_reference_and_follow_weight_shardings(mesh, data, model):
    args = mlp_args()
    graph = sr.trace(flat(mlp_loss, (0, 1, 2)), *args)
    specs = [(data, None), (None, model), (model, None), (data, None)]
    program = sr.partition(graph, mesh, in_specs=specs)
    assert_grads_sharded_like_inputs(program, (0, 1, 2))
    if model:  # the weights really are split, so the check above is not vacuous
        assert program.outputs[2].sharding.dims == ((), (model,))
    run_and_compare(graph, program, args)


def test_gradient_shardings_follow_mesh_split_annotations_inside_the_function():
    mesh = sr.Mesh((2, 4), ("data", "model"))

    def loss(x, w1, w2, y):
        x = sr.mesh_split(x, mesh, ("data", None))
        w1 = sr.mesh_split(w1, mesh, (None, "model"))
        w2 = sr.mesh_split(w2, mesh, ("model", None))
        return mlp_loss(x, w1, w2, y)
    args = mlp_args(1)
    graph = sr.trace(flat(loss, (1, 2)), *args)
    program = sr.partition(graph, mesh)  # no in_specs: the annotations inside are all there is
    assert [str(o.sharding) for o in program.outputs[1:]] == ["[R, model]", "[model, R]"]
    run_and_compare(graph, program, args)


# ---------------------------------------------------------------- Transformer block
CFG = BlockConfig(batch=2, seq=4, d=16, heads=4, ffn=32, dtype="float64")


@pytest.mark.parametrize("mesh,data,model", MESHES, ids=MESH_IDS)
def test_transformer_block_gradients_match_reference(mesh, data, model):
    block = transformer_block(CFG)
    weights = np.random.default_rng(5).standard_normal((CFG.batch, CFG.seq, CFG.d))

    def loss(*args):
        return snp.sum(block(*args) * weights)
    args = block_params(CFG, seed=2)
    argnums = tuple(range(len(args)))
    graph = sr.trace(flat(loss, argnums), *args)
    program = sr.partition(graph, mesh, in_specs=megatron_specs(data, model))
    assert_grads_sharded_like_inputs(program, argnums)
    run_and_compare(graph, program, args, rtol=1e-9)


# ---------------------------------------------------------------- data parallelism
def linear_loss(x, w, b, y):
    return snp.mean((x @ w + b - y) ** 2.0)


@pytest.mark.parametrize("mesh", [m for m, _, _ in MESHES], ids=MESH_IDS)
@pytest.mark.parametrize("with_value", [False, True], ids=["grad", "value_and_grad"])
def test_data_parallel_weight_gradient_is_one_all_reduce_each(mesh, with_value):
    rng = np.random.default_rng(3)
    x, w, b, y = (rng.standard_normal(s) for s in ((32, 16), (16, 4), (4,), (32, 4)))
    fn = flat(linear_loss, (1, 2)) if with_value else grad(linear_loss, argnums=(1, 2))
    graph = sr.trace(fn, x, w, b, y)
    batch = (mesh.axis_names, None)
    program = sr.partition(graph, mesh, in_specs=[batch, None, None, batch])
    summary = program.comm_summary()
    expected = ([8] if with_value else []) + [w.nbytes, b.nbytes]  # the loss, then dW and db
    assert sorted(c["bytes_in"] for c in summary) == sorted(expected), str(program)
    assert all(c["kind"] == "all_reduce" and set(c["axes"]) == set(mesh.axis_names) for c in summary), str(program)
    assert all(o.sharding.is_replicated for o in program.outputs)
    args = (x, w, b, y)
    run_and_compare(graph, program, args)


def test_a_grad_spec_annotates_the_cotangent_so_an_fsdp_gradient_is_one_reduce_scatter():
    """FSDP: a weight held sharded over "data", gathered for use (mesh_split to replicated), its gradient wanted
    sharded: grad_spec makes the pending batch sum a reduce-scatter, where the default (the cotangent annotated
    like the value) all-reduces it and then slices."""
    mesh = sr.Mesh((4,), ("data",))
    rng = np.random.default_rng(5)
    x, w, b, y = (rng.standard_normal(s) for s in ((32, 16), (16, 4), (4,), (32, 4)))

    def loss(grad_spec):
        def fn(x, w, b, y):
            return linear_loss(x, sr.mesh_split(w, mesh, (None, None), grad_spec=grad_spec), b, y)
        return grad(fn, argnums=1)

    kinds = {}
    for grad_spec in (None, ("data", None)):
        graph = sr.trace(loss(grad_spec), x, w, b, y)
        program = sr.partition(graph, mesh, in_specs=[("data", None), ("data", None), None, ("data", None)],
                               out_specs=[("data", None)])
        kinds[grad_spec] = sorted((c["kind"], c["bytes_in"]) for c in program.comm_summary())
        run_and_compare(graph, program, (x, w, b, y))
    assert ("all_reduce", w.nbytes) in kinds[None]
    assert kinds[("data", None)] == [("all_gather", w.nbytes // 4), ("reduce_scatter", w.nbytes)]
