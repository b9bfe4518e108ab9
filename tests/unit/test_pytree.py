"""Pytrees (spmd_runtime.pytree) and their use by trace, grad, run and checkpoints; P, UNCONSTRAINED, the
context mesh and the float32 defaults."""
import collections
import dataclasses

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import pytree
from spmd_runtime.comm import run_simulated
from tests.simulated import run_everywhere

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Layer:
    w: object
    b: object


TREES = [
    {"b": 1, "a": [2, (3, None)], "c": Point(4, 5)},
    [Layer(1, 2), Layer(3, {"k": 4})],
    (),
    None,
    7,
    {"": [], "z": {"y": ()}},
]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_flatten_unflatten_round_trip(tree):
    leaves, tdef = pytree.flatten(tree)
    assert tdef.unflatten(leaves) == tree
    assert tdef.num_leaves == len(leaves)
    assert pytree.flatten(tdef.unflatten(leaves))[1] == tdef  # equal structures, equal hashes
    assert hash(pytree.flatten(tree)[1]) == hash(tdef)


def test_dict_leaves_in_sorted_key_order_and_paths():
    paths, _ = pytree.flatten_with_path({"b": 1, "a": [2, Point(3, 4)]})
    assert [(pytree.keystr(p), v) for p, v in paths] == [("a.0", 2), ("a.1.x", 3), ("a.1.y", 4), ("b", 1)]


def test_structures_differ_by_keys_types_and_arity():
    base = pytree.flatten({"a": 1, "b": 2})[1]
    assert base != pytree.flatten({"a": 1, "c": 2})[1]
    assert base != pytree.flatten([1, 2])[1]
    assert pytree.flatten([1, 2])[1] != pytree.flatten((1, 2))[1]
    assert pytree.flatten(Point(1, 2))[1] != pytree.flatten((1, 2))[1]


def test_registered_user_type():
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda aux, ch: Pair(*ch),
                                lambda p, aux: ["a", "b"])
    paths, tdef = pytree.flatten_with_path({"p": Pair(1, [2])})
    assert [pytree.keystr(p) for p, _ in paths] == ["p.a", "p.b.0"]
    back = tdef.unflatten([10, 20])
    assert isinstance(back["p"], Pair) and (back["p"].a, back["p"].b) == (10, [20])
    with pytest.raises(ValueError, match="registered as a pytree node once"):
        pytree.register_pytree_node(Pair, lambda p: ([], None), lambda aux, ch: None)


def test_unflatten_and_flatten_like_name_the_structures():
    _, tdef = pytree.flatten({"a": 1, "b": 2})
    with pytest.raises(ValueError, match="has 2 leaves; got 3"):
        tdef.unflatten([1, 2, 3])
    with pytest.raises(ValueError, match=r"must have the structure PyTreeDef\(\{'a': \*, 'b': \*\}\); got "
                                         r"PyTreeDef\(\{'a': \*, 'c': \*\}\)"):
        pytree.flatten_like({"a": 1, "c": 2}, tdef, "grads")


@pytest.mark.parametrize("other", [
    {"a": [1, {"x": 2}], "b": (3,)},  # a container where a leaf was
    {"a": [1, 2], "b": [3]},  # a list for a tuple
    {"a": [1, 2, 9], "b": (3,)},  # another length
    {"a": [1, 2], "c": (3,)},  # another key
    {"a": Point(1, 2), "b": (3,)},  # a namedtuple for a list
    collections.OrderedDict(a=[1, 2], b=(3,)),  # an OrderedDict for a dict
])
def test_flatten_like_reads_a_tree_of_the_structure_and_refuses_any_other(other):
    """flatten_like reads the leaves along the given structure, building none; any difference still raises."""
    tree = {"a": [1, 2], "b": (3,)}
    tdef = pytree.flatten(tree)[1]
    assert pytree.flatten_like({"a": [np.ones(2), "s"], "b": (3.0,)}, tdef)[1:] == ["s", 3.0]
    with pytest.raises(ValueError, match="must have the structure"):
        pytree.flatten_like(other, tdef)


def test_a_type_registered_after_use_as_a_leaf_is_a_node():
    class Box:
        def __init__(self, v):
            self.v = v

    assert pytree.flatten([Box(1)])[1].num_leaves == 1  # a leaf type until registered
    pytree.register_pytree_node(Box, lambda b: ([b.v, b.v], None), lambda aux, ch: Box(ch[0]))
    assert pytree.flatten([Box(1)])[0] == [1, 1]


def test_broadcast_prefix_specs():
    is_spec = lambda x: isinstance(x, sr.P)  # noqa: E731
    args = ({"w": 1, "b": 2}, [3, 4])
    assert pytree.broadcast_prefix((sr.P("x"), [None, sr.P()]), args, is_spec) == [sr.P("x"), sr.P("x"), None, sr.P()]
    assert pytree.broadcast_prefix(sr.P(), args, is_spec) == [sr.P()] * 4
    with pytest.raises(ValueError, match="must match the arguments' structure"):
        pytree.broadcast_prefix(({"w": sr.P()}, None), args, is_spec)


# ---------------------------------------------------------------- P, UNCONSTRAINED, context mesh
MESH = sr.Mesh((2, 2), ("data", "model"))


def test_p_is_a_tuple_with_jax_semantics():
    assert sr.P("data", None) == ("data", None) and isinstance(sr.P(), tuple)
    assert sr.parse_spec(sr.P("data"), MESH, 3) == sr.Sharding((("data",), (), ()))  # trailing dims replicated
    assert sr.parse_spec(sr.P(("data", "model")), MESH, 1) == sr.Sharding((("data", "model"),))
    assert sr.parse_spec((0, -1), MESH, 2) == sr.Sharding((("data",), ()))  # GSPMD dims_mapping still works
    part = sr.P(None, "data", partial="model")
    assert sr.parse_spec(part, MESH, 2) == sr.Sharding(((), ("data",)), ("model",))
    assert part != sr.P(None, "data") and repr(part) == "P(None, 'data', partial='model')"
    with pytest.raises(ValueError, match="one entry per dim"):
        sr.parse_spec(("data",), MESH, 2)  # plain tuples stay strict


def test_context_mesh_and_missing_axis_error():
    def f(x):
        return sr.mesh_split(x, sr.P("data", None), name="x_split") * 2.0

    with MESH:
        assert sr.get_mesh() is MESH
        graph = sr.trace(f, sr.TensorSpec((4, 4)))
    assert sr.get_mesh() is None
    assert graph.nodes[1].attrs["mesh"] == MESH and graph.name_of(1) == "x_split"
    with pytest.raises(ValueError, match="needs a mesh: pass mesh=..., use `with mesh:` or sr.set_mesh"):
        sr.trace(f, sr.TensorSpec((4, 4)))
    with sr.set_mesh(sr.Mesh((4,), ("x",))):
        with pytest.raises(ValueError, match=r"mesh axis must be one of \('x',\); got 'data' in the spec of "
                                             r"tensor %0 'x_split'"):
            sr.trace(f, sr.TensorSpec((4, 4)))
    assert sr.get_mesh() is None


def test_context_mesh_is_per_thread_in_the_simulated_world():
    def body(comm):
        with sr.Mesh((comm.Get_size(),), ("r",)) as mesh:
            return sr.get_mesh() is mesh
    assert run_simulated(3, body) == [True] * 3


def test_unconstrained_dim_takes_the_propagated_axis():
    def f(x, w):
        x = sr.mesh_split(x, MESH, sr.P("data", None))
        w = sr.mesh_split(w, MESH, sr.P(None, "model"))
        return sr.mesh_split(x @ w, MESH, sr.P(sr.UNCONSTRAINED, None), name="h")

    program = sr.partition(sr.trace(f, sr.TensorSpec((4, 6)), sr.TensorSpec((6, 8))), MESH)
    assert program.outputs[0].sharding == sr.Sharding((("data",), ()))  # dim 0 from propagation, dim 1 pinned
    with pytest.raises(ValueError, match="UNCONSTRAINED entries are allowed in mesh_split"):
        sr.parse_spec(sr.P(sr.UNCONSTRAINED), MESH, 1)


def test_unconstrained_in_specs():
    def f(x, w):
        return sr.mesh_split(x, MESH, sr.P("data", None)) * w

    graph = sr.trace(f, sr.TensorSpec((4, 6)), sr.TensorSpec((4, 6)))
    program = sr.partition(graph, MESH, in_specs=[None, sr.P(sr.UNCONSTRAINED, "model")])
    assert program.inputs[1].sharding == sr.Sharding((("data",), ("model",)))


def test_float32_defaults():
    assert sr.TensorSpec((2,)).dtype == "float32"
    graph = sr.trace(lambda: (snp.zeros((2,)), snp.ones(3), snp.full((1,), 2.0)))
    assert [s.dtype for s in graph.output_specs] == ["float32"] * 3


# ---------------------------------------------------------------- trace / grad / run / checkpoint
def mlp(params, x):
    h = snp.maximum(x @ params["w1"] + params["b1"], 0.0)
    return {"out": h @ params["w2"], "aux": [h.sum()]}


def make_params(rng):
    return {"w1": rng.standard_normal((6, 8)).astype("float32"), "b1": rng.standard_normal(8).astype("float32"),
            "w2": rng.standard_normal((8, 4)).astype("float32")}


def test_trace_names_leaves_and_keeps_structures():
    rng = np.random.default_rng(0)
    params, x = make_params(rng), rng.standard_normal((4, 6)).astype("float32")
    graph = sr.trace(mlp, params, sr.TensorSpec((4, 6)))
    assert graph.param_names == ["params.b1", "params.w1", "params.w2", "x"]
    outs = sr.evaluate(graph, *pytree.flatten((params, x))[0])
    got = graph.out_tree.unflatten(outs)
    want_h = np.maximum(x @ params["w1"] + params["b1"], 0)
    np.testing.assert_allclose(got["out"], want_h @ params["w2"], rtol=1e-5)
    np.testing.assert_allclose(got["aux"][0], want_h.sum(), rtol=1e-5)


def test_grad_of_a_dict_returns_a_dict_and_runs_partitioned():
    rng = np.random.default_rng(1)
    params, x = make_params(rng), rng.standard_normal((4, 6)).astype("float32")

    def loss(p, x):
        x = sr.mesh_split(x, MESH, sr.P("data"))
        return snp.sum(mlp(p, x)["out"] ** 2.0)

    graph = sr.trace(sr.value_and_grad(loss), params, x)
    assert graph.out_tree == pytree.flatten((0, {"b1": 0, "w1": 0, "w2": 0}))[1]
    program = sr.partition(graph, MESH)
    ref = graph.out_tree.unflatten(sr.evaluate(graph, *pytree.flatten((params, x))[0]))
    for outs in run_everywhere(program, params, x):  # run takes the pytree itself
        value, grads = program.out_tree.unflatten(outs)
        assert set(grads) == {"b1", "w1", "w2"}
        np.testing.assert_allclose(value, ref[0], rtol=1e-5)
        for k in grads:
            assert grads[k].shape == params[k].shape
            np.testing.assert_allclose(grads[k], ref[1][k], rtol=1e-4, atol=1e-5)
    # numerical check of one gradient entry against a finite difference (float64 copy)
    p64 = {k: v.astype("float64") for k, v in params.items()}
    g64 = sr.trace(sr.grad(loss), p64, x.astype("float64"))
    d = g64.out_tree.unflatten(sr.evaluate(g64, *pytree.flatten((p64, x.astype("float64")))[0]))
    f = lambda p: float(np.sum((np.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"]) ** 2))  # noqa: E731
    bumped = {**p64, "b1": p64["b1"].copy()}
    bumped["b1"][3] += 1e-6
    assert abs((f(bumped) - f(p64)) / 1e-6 - d["b1"][3]) < 1e-3 * max(1.0, abs(d["b1"][3]))


def test_checkpoint_round_trip_of_a_nested_tree(tmp_path):
    mesh = sr.Mesh((2,), ("d",))
    tree = {"params": {"w": np.arange(10.0).reshape(5, 2), "b": np.arange(3.0)}, "step": [np.array(7)]}
    shardings = {"params.w": ((5, 2), ("d", None)), "params.b": ((3,), (None,)), "step.0": ((), ())}

    def body(comm):
        rank = comm.Get_rank()
        blocks = {"params": {"w": tree["params"]["w"][:3] if rank == 0 else tree["params"]["w"][3:],
                             "b": tree["params"]["b"]}, "step": [tree["step"][0]]}
        sr.save_checkpoint(tmp_path / "ck", blocks, shardings, mesh, comm=comm)
        return sr.load_checkpoint(tmp_path / "ck", sr.Mesh((1,), ("d",)), comm=None, like=tree) if rank == 0 else None

    loaded = run_simulated(2, body)[0]
    assert pytree.flatten(loaded)[1] == pytree.flatten(tree)[1]
    for a, b in zip(pytree.flatten(loaded)[0], pytree.flatten(tree)[0]):
        np.testing.assert_array_equal(a, b)
    assert sorted(sr.checkpoint_info(tmp_path / "ck")["tensors"]) == ["params.b", "params.w", "step.0"]


def test_structures_pickle_so_ranks_can_exchange_them():
    import pickle
    tree = {"a": [1, (2, None)], "p": Point(3, 4), "l": Layer(5, 6)}
    leaves, tdef = pytree.flatten(tree)
    again = pickle.loads(pickle.dumps(tdef))
    assert again == tdef and again.unflatten(leaves) == tree
