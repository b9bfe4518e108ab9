"""Reverse-mode autodiff: every VJP rule against central finite differences (float64, reference evaluator),
plus the API (argnums, has_aux, errors, higher order, no dead backward code)."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.autodiff import grad, value_and_grad
from spmd_runtime.autodiff.rules.table import VJP
from spmd_runtime.comm import run_simulated

VJP_RULES = {record.name for record in VJP.ops()}
from spmd_runtime.models import BlockConfig, block_params, transformer_block
from spmd_runtime.nn import gelu, layer_norm, softmax
from spmd_runtime.ops.core import with_gradients
from spmd_runtime.trace import emit

MESH_2 = sr.Mesh((2,), ("x",))


def weighted_sum(fn):
    """A scalar loss sum(fn(*args) * W) with a fixed random W, so cotangents are not all ones."""
    def loss(*args):
        out = fn(*args)
        w = np.random.default_rng(7).standard_normal(out.shape)
        return snp.sum(out * w)
    return loss


def flat_value_and_grad(loss, argnums):
    def f(*args):
        value, grads = value_and_grad(loss, argnums)(*args)
        return (value, *grads)
    return f


def numeric_grads(loss, args, argnums, eps=1e-6):
    graph = sr.trace(loss, *args)
    f = lambda *a: float(sr.evaluate(graph, *a)[0])
    out = []
    for k in argnums:
        g = np.zeros_like(args[k])
        for idx in np.ndindex(args[k].shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[k][idx] += eps
            minus[k][idx] -= eps
            g[idx] = (f(*plus) - f(*minus)) / (2 * eps)
        out.append(g)
    return f(*args), out


def check_grads(loss, args, argnums=None, rtol=1e-6, atol=1e-7):
    argnums = tuple(range(len(args))) if argnums is None else argnums
    value, *got = sr.evaluate(sr.trace(flat_value_and_grad(loss, argnums), *args), *args)
    want_value, want = numeric_grads(loss, args, argnums)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    for k, g, w in zip(argnums, got, want):
        assert g.shape == args[k].shape and g.dtype == args[k].dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"gradient of argument {k}")


def rand(*shape, positive=False, seed=0):
    x = np.random.default_rng(seed + sum(shape)).standard_normal(shape)
    return np.abs(x) + 0.5 if positive else x


# (name, fn, args): each fn returns a tensor, the loss is its weighted sum
OP_CASES = [
    ("add_broadcast_3x1_1x4", lambda a, b: a + b, [rand(3, 1), rand(1, 4, seed=1)]),
    ("sub_row_vector", lambda a, b: a - b, [rand(3, 4), rand(4)]),
    ("mul_scalar", lambda a, s: a * s, [rand(3, 1), rand()]),
    ("mul_same_operand", lambda a: a * a, [rand(2, 3)]),
    ("div_broadcast", lambda a, b: a / b, [rand(3, 4), rand(1, 4, positive=True)]),
    ("pow_tensor_exponent", lambda a, b: a ** b, [rand(3, 4, positive=True), rand(3, 4, seed=2)]),
    ("pow_constant_exponent", lambda a: a ** 3.0, [rand(3, 4)]),
    ("rpow_constant_base", lambda b: 2.0 ** b, [rand(4)]),
    ("neg", lambda a: -a, [rand(5)]),
    ("exp", snp.exp, [rand(3, 4)]),
    ("log", snp.log, [rand(3, 4, positive=True)]),
    ("tanh", snp.tanh, [rand(3, 4)]),
    ("sqrt", snp.sqrt, [rand(3, 4, positive=True)]),
    ("abs", snp.abs, [rand(3, 4)]),
    ("square", snp.square, [rand(3, 4)]),
    ("maximum_broadcast", snp.maximum, [rand(3, 4), rand(4, seed=3)]),
    ("minimum_scalar", lambda a, b: snp.minimum(a, b), [rand(3, 4), rand()]),
    ("relu", lambda a: snp.maximum(a, 0.0), [rand(3, 4)]),
    ("select", lambda a, b: snp.where(a > 0, a * b, b), [rand(3, 4), rand(3, 4, seed=4)]),
    ("select_broadcast_cond", lambda a, b: snp.where(a > 0, a, b), [rand(3, 1), rand(1, 4, seed=5)]),
    ("logic_in_condition", lambda a, b: snp.where(((a > 0) & (b < 0.5)) | ~(a > b), a, 2.0 * b),
     [rand(3, 4), rand(3, 4, seed=6)]),
    ("comparison_as_float", lambda a: a * (a > 0).astype("float64"), [rand(3, 4)]),
    ("broadcast_in_dim_expand_and_new", lambda a: snp.broadcast_in_dim(a, (2, 3, 4), (1, 2)), [rand(3, 1)]),
    ("broadcast_to_from_scalar", lambda a: snp.broadcast_to(a, (2, 3)), [rand()]),
    ("broadcast_keep_size_1", lambda a: snp.broadcast_in_dim(a, (1, 3, 2), (0, 1)), [rand(1, 3)]),
    ("expand_dims", lambda a: snp.expand_dims(a, (0, 2)) * rand(4, 3, 2, 5), [rand(3, 5)]),
    ("reshape_transpose_chain",
     lambda a: snp.transpose(snp.reshape(snp.reshape(a, (6, 4)).T, (2, 2, 6)), (2, 0, 1)), [rand(2, 3, 4)]),
    ("swapaxes_squeeze", lambda a: snp.squeeze(snp.swapaxes(a, 0, 2), 1), [rand(3, 1, 2)]),
    ("reshape_minus_one", lambda a: snp.reshape(a, (-1,)) * 1.5, [rand(2, 3)]),
    ("sum_axis0", lambda a: snp.sum(a, axis=0), [rand(3, 4)]),
    ("sum_axis1_keepdims", lambda a: snp.sum(a, axis=1, keepdims=True), [rand(3, 4)]),
    ("sum_axes_0_2", lambda a: snp.sum(a, axis=(0, 2)), [rand(2, 3, 4)]),
    ("sum_all", lambda a: snp.sum(a) * a, [rand(2, 3)]),
    ("max_axis_last", lambda a: snp.max(a, axis=-1), [rand(3, 5)]),
    ("max_axes_0_2_keepdims", lambda a: snp.max(a, axis=(0, 2), keepdims=True), [rand(2, 3, 4)]),
    ("min_axis0", lambda a: snp.min(a, axis=0), [rand(4, 3)]),
    ("min_all", lambda a: snp.min(a) + snp.max(a), [rand(2, 3)]),
    ("mean_var", lambda a: snp.mean(a, axis=0) + snp.var(a, axis=0), [rand(4, 3)]),
    ("matmul", lambda a, b: a @ b, [rand(3, 4), rand(4, 5)]),
    ("matmul_vector", lambda a, v: a @ v, [rand(3, 4), rand(4)]),
    ("einsum_batch_contract_free", lambda a, b: snp.einsum("bij,bjk->bik", a, b), [rand(2, 3, 4), rand(2, 4, 5)]),
    ("einsum_attention_scores", lambda q, k: snp.einsum("bqhd,bkhd->bhqk", q, k),
     [rand(2, 3, 2, 4), rand(2, 5, 2, 4, seed=8)]),
    ("einsum_outer", lambda a, b: snp.einsum("i,j->ij", a, b), [rand(3), rand(4)]),
    ("einsum_full_contraction", lambda a, b: snp.einsum("ij,ij->", a, b), [rand(3, 4), rand(3, 4, seed=9)]),
    ("einsum_summed_free_letter", lambda a, b: snp.einsum("ij,jk->k", a, b), [rand(3, 4), rand(4, 2)]),
    ("einsum_three_operands", lambda a, b, c: snp.einsum("ij,jk,kl->li", a, b, c),
     [rand(2, 3), rand(3, 4), rand(4, 5)]),
    ("mesh_split", lambda a, b: sr.mesh_split(a, MESH_2, ("x", None)) * b, [rand(4, 3), rand(4, 3, seed=10)]),
    ("softmax", softmax, [rand(3, 5)]),
    ("softmax_axis0", lambda a: softmax(a, axis=0), [rand(3, 5)]),
    ("layer_norm", layer_norm, [rand(3, 6), rand(6), rand(6, seed=11)]),
    ("gelu", gelu, [rand(3, 4)]),
]


@pytest.mark.parametrize("name,fn,args", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_gradient_matches_finite_differences(name, fn, args):
    check_grads(weighted_sum(fn), args)


def test_transformer_block_gradients_match_finite_differences():
    cfg = BlockConfig(batch=2, seq=4, d=8, heads=2, ffn=16, dtype="float64")
    block = transformer_block(cfg)
    args = block_params(cfg, seed=3)
    args[1] = args[1] + 0.1 * rand(8)  # non-trivial LayerNorm scales and shifts
    args[8] = args[8] + 0.1 * rand(8, seed=12)
    check_grads(lambda *a: snp.sum(block(*a)), args, rtol=1e-5, atol=1e-6)


def test_every_traced_op_has_a_vjp_rule():
    from spmd_runtime.ops.core import ELEMENTWISE_LIKE
    ELEMENTWISE_OPS = tuple(op.name for op in ELEMENTWISE_LIKE)
    ops = set(ELEMENTWISE_OPS) | {"parameter", "constant", "broadcast_in_dim", "reshape", "transpose", "reduce",
                                  "einsum", "mesh_split", "stop_gradient"}
    assert ops <= set(VJP_RULES), sorted(ops - set(VJP_RULES))


# ---------------------------------------------------------------- rules at non-smooth points
def grads_of(loss, *args, argnums=0):
    f = lambda *a: grad(loss, argnums)(*a)
    return sr.evaluate(sr.trace(f, *args), *args)


def test_reduce_max_splits_ties_equally():
    (g,) = grads_of(lambda x: snp.max(x, axis=1).sum(), np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]]))
    np.testing.assert_array_equal(g, [[0, 0.5, 0.5], [0.5, 0, 0.5]])


def test_reduce_min_routes_to_the_argmin():
    (g,) = grads_of(lambda x: snp.min(x, axis=0).sum() * 2.0, np.array([[1.0, 3.0], [0.0, 4.0]]))
    np.testing.assert_array_equal(g, [[0, 2], [2, 0]])


def test_maximum_and_minimum_split_ties_like_jax():
    x = np.array([-1.0, 0.0, 2.0])
    (g,) = grads_of(lambda x: snp.maximum(x, 0.0).sum(), x)
    np.testing.assert_array_equal(g, [0, 0.5, 1])
    (g,) = grads_of(lambda x: snp.minimum(x, 0.0).sum(), x)
    np.testing.assert_array_equal(g, [1, 0.5, 0])


def test_abs_at_zero_has_slope_one():
    (g,) = grads_of(lambda x: snp.abs(x).sum(), np.array([-2.0, 0.0, 3.0]))
    np.testing.assert_array_equal(g, [-1, 1, 1])


def test_pow_at_zero_base_and_zero_exponent_is_finite():
    x, y = np.array([0.0, 2.0]), np.array([0.0, 3.0])
    gx, gy = grads_of(lambda x, y: snp.sum(x ** y), x, y, argnums=(0, 1))
    np.testing.assert_array_equal(gx, [0.0, 12.0])
    np.testing.assert_allclose(gy, [0.0, 8.0 * np.log(2.0)])


def test_convert_casts_the_cotangent_back_and_integers_block_it():
    x = np.array([1.25, -2.5, 3.75])
    f = lambda x: snp.sum(x.astype("float32").astype("float64") * np.array([1.0, 2.0, 3.0]))
    (g,) = grads_of(f, x)
    np.testing.assert_array_equal(g, [1, 2, 3])
    (g,) = grads_of(lambda x: snp.sum(x * x.astype("int32").astype("float64")), x)
    np.testing.assert_array_equal(g, [1, -2, 3])  # the integer path carries no gradient


def test_float32_gradients_keep_float32():
    graph = sr.trace(grad(lambda x, w: snp.sum(snp.tanh(x @ w)), argnums=(0, 1)),
                     sr.TensorSpec((3, 4), "float32"), sr.TensorSpec((4, 2), "float32"))
    assert [s.dtype for s in graph.output_specs] == ["float32", "float32"]


def test_mesh_split_cotangent_carries_the_same_sharding():
    graph = sr.trace(grad(lambda a: snp.sum(sr.mesh_split(a, MESH_2, ("x", None)) ** 2.0)), sr.TensorSpec((4, 3)))
    splits = [n for n in graph.nodes if n.op == "mesh_split"]
    assert len(splits) == 2 and splits[0].attrs == splits[1].attrs
    assert graph.outputs[0] == splits[1].id  # the gradient is the annotated cotangent


# ---------------------------------------------------------------- API
def loss3(x, y, z):
    return snp.sum(x * y * 2.0 + z)


def test_argnums_int_gives_one_gradient_and_tuple_gives_a_tuple():
    x, y, z = rand(2, 3), rand(2, 3, seed=1), rand(2, 3, seed=2)
    (gy,) = grads_of(loss3, x, y, z, argnums=1)
    np.testing.assert_allclose(gy, 2 * x)

    def both(x, y, z):
        grads = grad(loss3, argnums=(2, 0))(x, y, z)
        assert isinstance(grads, tuple) and len(grads) == 2
        return grads
    gz, gx = sr.evaluate(sr.trace(both, x, y, z), x, y, z)
    np.testing.assert_allclose(gz, np.ones_like(z))
    np.testing.assert_allclose(gx, 2 * y)


def test_value_and_grad_returns_the_value_and_keeps_parameter_names():
    x = rand(3)
    graph = sr.trace(value_and_grad(lambda inp: snp.sum(snp.exp(inp))), x)
    assert graph.param_names == ["inp"]
    v, g = sr.evaluate(graph, x)
    np.testing.assert_allclose(v, np.exp(x).sum())
    np.testing.assert_allclose(g, np.exp(x))


def test_has_aux_returns_aux_alongside():
    def loss(x):
        y = x * 3.0
        return snp.sum(y), y

    def f(x):
        (v, aux), g = value_and_grad(loss, has_aux=True)(x)
        g2, aux2 = grad(loss, has_aux=True)(x)
        return v, aux, g, g2, aux2
    x = rand(2, 2)
    v, aux, g, g2, aux2 = sr.evaluate(sr.trace(f, x), x)
    np.testing.assert_allclose(aux, 3 * x)
    np.testing.assert_allclose(aux2, 3 * x)
    np.testing.assert_allclose(g, np.full_like(x, 3.0))
    np.testing.assert_allclose(g2, np.full_like(x, 3.0))
    assert v == pytest.approx(3 * x.sum())


def test_has_aux_needs_a_pair():
    with pytest.raises(TypeError, match="has_aux=True requires .* pair"):
        sr.trace(grad(lambda x: snp.sum(x), has_aux=True), sr.TensorSpec((2,)))


def test_non_scalar_output_is_refused():
    with pytest.raises(TypeError, match=r"scalar \(shape \(\)\) output; got output of shape \(2, 3\)"):
        sr.trace(grad(lambda x: x * 2.0), sr.TensorSpec((2, 3)))


def test_missing_vjp_rule_names_the_op():
    def f(x):
        return snp.sum(emit("fancy_op", [x], {}, x.shape, x.dtype))
    with pytest.raises(NotImplementedError, match="VJP rule .* op 'fancy_op'"):
        sr.trace(grad(f), sr.TensorSpec((3,)))


def test_missing_rule_off_the_gradient_path_is_harmless():
    def f(x, c):
        return snp.sum(x * emit("fancy_op", [c], {}, c.shape, c.dtype))
    sr.trace(grad(f), sr.TensorSpec((3,)), sr.TensorSpec((3,)))  # c is not differentiated


def test_integer_inputs_and_outputs_are_refused():
    with pytest.raises(TypeError, match="floating-point inputs; got argument 0 of dtype int32"):
        sr.trace(grad(lambda x: snp.sum(x)), sr.TensorSpec((3,), "int32"))
    with pytest.raises(TypeError, match="floating-point output; got dtype int64"):
        sr.trace(grad(lambda x: snp.sum(x.astype("int64"))), sr.TensorSpec((3,)))


def test_bad_argnums_are_refused():
    with pytest.raises(ValueError, match="argnums"):
        grad(loss3, argnums=())
    with pytest.raises(ValueError, match="argnums"):
        grad(loss3, argnums=(0, 0))
    with pytest.raises(ValueError, match="refers past the 3 positional arguments"):
        sr.trace(grad(loss3, argnums=3), *[sr.TensorSpec((2,))] * 3)


def test_grad_needs_an_active_trace():
    with pytest.raises(RuntimeError, match="active trace"):
        grad(lambda x: snp.sum(x))(np.ones(3))


def test_same_tensor_passed_twice_is_two_variables():
    x = rand(3)
    gx, gy = grads_of(lambda a, b: snp.sum(a * b * b), x, x, argnums=(0, 1))
    np.testing.assert_allclose(gx, x * x)
    np.testing.assert_allclose(gy, 2 * x * x)


def test_unused_argument_gets_zeros():
    x, y = rand(3), rand(2, 2)
    gx, gy = grads_of(lambda a, b: snp.sum(a), x, y, argnums=(0, 1))
    np.testing.assert_array_equal(gx, np.ones(3))
    np.testing.assert_array_equal(gy, np.zeros((2, 2)))


def test_closed_over_values_are_constants():
    def outer(x, w):
        h = x * 2.0  # computed before the differentiated function runs: a constant to it
        return grad(lambda w: snp.sum(h * w))(w)
    x, w = rand(3), rand(3, seed=1)
    (g,) = sr.evaluate(sr.trace(outer, x, w), x, w)
    np.testing.assert_allclose(g, 2 * x)


def test_python_scalar_argument_is_differentiable():
    def f(x):
        return grad(lambda s, x: snp.sum(x * s * s))(3.0, x)
    x = rand(4)
    (g,) = sr.evaluate(sr.trace(f, x), x)
    np.testing.assert_allclose(g, 6.0 * x.sum())


def test_second_order():
    def d2(x):
        first = grad(lambda x: snp.sum(x ** 3.0 + snp.tanh(x)))
        return grad(lambda x: snp.sum(first(x)))(x)
    x = rand(4)
    (g,) = sr.evaluate(sr.trace(d2, x), x)
    t = np.tanh(x)
    np.testing.assert_allclose(g, 6 * x - 2 * t * (1 - t * t), rtol=1e-12)


def test_only_requested_gradients_are_emitted():
    """grad w.r.t. w of sum(x @ w) contracts once for the forward and once for dW; no dX is built."""
    graph = sr.trace(grad(lambda x, w: snp.sum(x @ w), argnums=1), sr.TensorSpec((3, 4)), sr.TensorSpec((4, 5)))
    assert [n.attrs["spec"] for n in graph.nodes if n.op == "einsum"] == ["XY,YZ->XZ", "XY,XZ->YZ"]
    assert not any(n.op == "transpose" for n in graph.nodes)


# ---------------------------------------------------------------- stop_gradient
def test_stop_gradient_is_the_value_forward_and_a_constant_backward():
    x = rand(3, 4)
    value, g = sr.evaluate(sr.trace(lambda a: value_and_grad(lambda b: snp.sum(b * sr.stop_gradient(b)))(a), x), x)
    np.testing.assert_allclose(value, np.sum(x * x))
    np.testing.assert_array_equal(g, x)  # d/dx of x * c at c = x: without the stop it would be 2x


def test_stop_gradient_partitions_to_no_instruction():
    x = rand(4, 6)
    graph = sr.trace(lambda a: sr.stop_gradient(a) * 2.0, x)
    program = sr.partition(graph, MESH_2, in_specs=[("x", None)])
    assert "stop_gradient" not in {i.op for i in program.instrs}
    for outs in run_simulated(2, lambda comm: sr.run(program, x, comm=comm)):
        np.testing.assert_allclose(outs[0], 2.0 * x)


def test_with_gradients_gives_its_arrays_the_given_gradients_beside_the_values_own():
    """d/dx of with_gradients(sum(x * x), [x, y], [gx, gy]) is 2 x + gx; d/dy is gy; the gradients get none; the
    value is sum(x * x) even where a given gradient is not finite (the zero it stands for is never computed)."""
    x, y, gx, gy = rand(3, 4), rand(5), rand(3, 4, seed=1), rand(5, seed=1)
    gy[2] = np.inf
    loss = lambda a, b, ga, gb: with_gradients(snp.sum(a * a), [a, b], [ga, gb])
    f = lambda *args: value_and_grad(loss, argnums=(0, 1, 2, 3))(*args)
    value, dx, dy, dgx, dgy = sr.evaluate(sr.trace(f, x, y, gx, gy), x, y, gx, gy)
    np.testing.assert_allclose(value, np.sum(x * x))
    np.testing.assert_allclose(dx, 2 * x + gx)
    np.testing.assert_array_equal(dy, gy)
    np.testing.assert_array_equal(dgx, np.zeros_like(gx))
    np.testing.assert_array_equal(dgy, np.zeros_like(gy))


def test_with_gradients_partitions_to_no_instruction_and_reads_neither_the_arrays_nor_the_gradients():
    x, gx = rand(4, 6), rand(4, 6, seed=1)
    graph = sr.trace(lambda a, ga: with_gradients(snp.sum(a), [a], [ga]), x, gx)
    program = sr.partition(graph, MESH_2, in_specs=[("x", None), ("x", None)])
    assert [i.op for i in program.instrs if i.op != "parameter"] == ["reduce", "all_reduce"]
    for outs in run_simulated(2, lambda comm: sr.run(program, x, gx, comm=comm)):
        np.testing.assert_allclose(outs[0], np.sum(x))


@pytest.mark.parametrize("value,wrt,grads,match", [
    ((3,), [(2,)], [(2,)], "with_gradients gives derivatives of a scalar; got a value of shape \\(3,\\)"),
    ((), [(2,)], [(3,)], "with_gradients needs one gradient of each array's shape; got arrays of shapes "
                         "\\[\\(2,\\)\\] and gradients of shapes \\[\\(3,\\)\\]"),
    ((), [(2,)], [], "one gradient of each array's shape")])
def test_with_gradients_refuses_a_non_scalar_value_and_gradients_of_other_shapes(value, wrt, grads, match):
    specs = [sr.TensorSpec(value)] + [sr.TensorSpec(s) for s in wrt + grads]
    n = len(wrt)
    with pytest.raises(ValueError, match=match):
        sr.trace(lambda v, *rest: with_gradients(v, rest[:n], rest[n:]), *specs)


def test_softmax_backward_does_not_differentiate_its_row_max():
    """The shift by the row max is a constant for differentiation (as JAX's and PyTorch's softmax): the backward
    holds no max-tie mask (``eq``) and no count of ties, and the gradient is softmax's own (finite differences
    above)."""
    x = rand(3, 5)
    graph = sr.trace(lambda a: grad(weighted_sum(softmax))(a), x)
    assert "eq" not in {n.op for n in graph.nodes}
