"""sr.shard_map: manual SPMD regions with explicit collectives, on simulated meshes of 1, 2, 4 and 8 ranks
(1-d and 2-d), against the same computation written for the automatic partitioner: values and
gradients, by the reference evaluator and partitioned on every rank; the collectives each plan uses; and
bad input refused with the rule named."""
import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import P
from spmd_runtime.cost import collective_kind
from shard_map_cases import CASES, build, ring_attention
from simulated import collectives, run_everywhere

MESHES = [sr.Mesh((1,), ("x",)), sr.Mesh((2,), ("x",)), sr.Mesh((4,), ("x",)), sr.Mesh((8,), ("x",)),
          sr.Mesh((2, 2), ("x", "y")), sr.Mesh((2, 4), ("x", "y"), devices=tuple(reversed(range(8))))]


def _meshes(case):
    return [m for m in MESHES if len(m.shape) == 2 or not case.two_d]


def _close(got, want, what):
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        assert np.shape(g) == np.shape(w), f"{what} output {k}"
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=f"{what} output {k}")


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("grad", [False, True], ids=["value", "grad"])
@pytest.mark.parametrize("case,mesh", [(c, m) for c in CASES for m in _meshes(c)],
                         ids=[f"{c.name}-{m}" for c in CASES for m in _meshes(c)])
def test_region_matches_the_automatic_version(case, mesh, grad):
    region, auto, args = build(case, mesh, grad)
    want = sr.evaluate(auto, *args)
    _close(sr.evaluate(region, *args), want, "reference evaluator")
    in_specs = None if grad else case.in_specs
    program = sr.partition(region, mesh, in_specs=in_specs)
    for rank, outs in enumerate(run_everywhere(program, *args)):
        _close(outs, want, f"rank {rank}")


# ---------------------------------------------------------------- the worked examples' plans
def _plans(case_name, mesh):
    case = next(c for c in CASES if c.name == case_name)
    region, auto, args = build(case, mesh)
    outs = None if case.out_spec is None else [case.out_spec]
    return (sr.partition(region, mesh, in_specs=case.in_specs, out_specs=outs),
            sr.partition(auto, mesh, in_specs=case.in_specs, out_specs=outs), args)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_moves_keys_and_values_by_collective_permute(n):
    mesh = sr.Mesh((n,), ("x",))
    ring, auto, args = _plans("ring_attention", mesh)
    summary = ring.comm_summary()
    assert [c["kind"] for c in summary] == ["collective_permute"] * (2 * (n - 1))
    k_block = args[1].nbytes // n
    assert all(c["wire_bytes"] == k_block for c in summary)  # one key (or value) block per step
    assert "collective_permute" not in auto.collectives()  # the automatic plan gathers instead
    for r, a in zip(run_everywhere(ring, *args), run_everywhere(auto, *args)):
        np.testing.assert_allclose(r[0], a[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r[0], attention_np(*args), rtol=1e-12)


def attention_np(q, k, v):
    s = q @ k.T
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) @ v


def test_reduce_scatter_matmul_plans_one_reduce_scatter_like_the_automatic_one():
    mesh = sr.Mesh((4,), ("x",))
    manual, auto, args = _plans("reduce_scatter_matmul", mesh)
    assert collectives(manual) == [("reduce_scatter", ("x",))]
    assert collectives(auto) == [("reduce_scatter", ("x",))]
    assert manual.wire_bytes == auto.wire_bytes == 3 / 4 * (8 * 4 * 8)  # (k-1)/k of the local [8, 4] float64 partial
    for r, a in zip(run_everywhere(manual, *args), run_everywhere(auto, *args)):
        np.testing.assert_allclose(r[0], a[0], rtol=1e-12)
        np.testing.assert_allclose(r[0], args[0] @ args[1], rtol=1e-12)


def test_partially_manual_region_keeps_the_batch_split_over_the_automatic_axis():
    mesh = sr.Mesh((2, 2), ("x", "y"))
    region, _, args = _plans("partial_manual_batch_on_y", mesh)
    assert collectives(region) == [("all_reduce", ("x",))]  # nothing gathered over y
    body = next(i for i in region.instrs if i.op == "shard_map").attrs["body"]
    assert str(body.inputs[0].sharding) == "[y, R]"  # the block keeps its batch split


def test_partially_manual_region_reduces_an_automatic_contraction_inside_the_body():
    region, _, _ = _plans("partial_manual_contract_on_y", sr.Mesh((2, 2), ("x", "y")))
    assert collectives(region) == [("all_reduce", ("y",))]  # entering moved nothing; y's partial sums reduced
    body = next(i for i in region.instrs if i.op == "shard_map").attrs["body"]
    assert [str(i.sharding) for i in body.inputs] == ["[R, y]", "[y, R]"]


def _grad_plan(name, mesh):
    region, _, args = build(next(c for c in CASES if c.name == name), mesh, grad=True)
    return region, sr.partition(region, mesh)


MESH22 = sr.Mesh((2, 2), ("x", "y"))


def test_a_psum_transposes_to_a_pbroadcast_that_moves_nothing():
    _, program = _grad_plan("psum_matmul", MESH22)
    assert collectives(program) == []  # Megatron's g: all-reduce forward, identity backward


def test_a_value_replicated_into_the_region_gets_its_cotangent_summed_over_the_axes_it_meets():
    graph, program = _grad_plan("closure", MESH22)
    assert collectives(program) == [("all_reduce", ("x",))]  # b met the x-split blocks; nothing over y
    region = next(n for n in graph.nodes if n.op == "shard_map")
    assert [n.attrs["axes"] for n in region.attrs["body"].nodes if n.op == "pbroadcast"] == [("x",)]


@pytest.mark.parametrize("name,kind", [("all_gather", "reduce_scatter"), ("reduce_scatter_matmul", "all_gather"),
                                       ("all_to_all", "all_to_all")])
def test_collectives_transpose_to_their_pair(name, kind):
    _, program = _grad_plan(name, sr.Mesh((4,), ("x",)))
    assert kind in program.collectives()


def test_a_ppermute_transposes_to_the_inverse_permutation():
    _, program = _grad_plan("ppermute_shift", sr.Mesh((4,), ("x",)))
    pairs = {i.attrs["pairs"] for i in _instrs(program) if collective_kind(i.op) == "collective_permute"}  # or start
    forward, inverse = (tuple(sorted((i, (i + step) % 4) for i in range(4))) for step in (1, -1))
    assert pairs == {forward, inverse}  # the recomputed forward's shift and its transpose


def _instrs(program):
    for ins in program.instrs:
        yield ins
        if ins.op == "shard_map":
            yield from _instrs(ins.attrs["body"])


# ---------------------------------------------------------------- bad input: the rule named
MESH2 = sr.Mesh((2, 2), ("x", "y"))


def _trace(fn, *shapes):
    with MESH2:
        return sr.trace(fn, *[sr.TensorSpec(s, "float32") for s in shapes])


def test_a_collective_over_an_automatic_axis_is_refused():
    region = sr.shard_map(lambda x: sr.psum(x, "y"), MESH2, in_specs=P("x"), out_specs=P("x"), axis_names=("x",))
    with pytest.raises(ValueError, match=r"manual in the enclosing shard_map \('x',\).*'y'.*stay automatic"):
        _trace(region, (4, 2))


def test_a_collective_outside_a_region_or_inside_a_loop_in_it_is_refused():
    with pytest.raises(ValueError, match="top level of a sr.shard_map body.*outside any region"):
        _trace(lambda x: sr.psum(x, "x"), (4,))
    looped = sr.shard_map(lambda x: sr.fori_loop(0, 2, lambda i, c: sr.psum(c, "x"), x), MESH2, in_specs=P("x"),
                          out_specs=P("x"))
    with pytest.raises(ValueError, match="inside a loop or cond body within it"):
        _trace(looped, (4,))


def test_a_block_shape_that_disagrees_with_the_specs_is_refused():
    region = sr.shard_map(lambda x: x, MESH2, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
    with pytest.raises(ValueError, match=r"splits dim 0 over \('x', 'y'\) \(4 shards\); got size 6"):
        _trace(region, (6, 2))
    too_long = sr.shard_map(lambda x: x, MESH2, in_specs=P("x", None, None), out_specs=P())
    with pytest.raises(ValueError, match="one entry per dim"):
        _trace(too_long, (4, 2))
    out_too_long = sr.shard_map(lambda x: x.sum(), MESH2, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="one entry per dim"):
        _trace(out_too_long, (4, 2))
    wrong_count = sr.shard_map(lambda a, b: a, MESH2, in_specs=(P("x"),), out_specs=P())
    with pytest.raises(ValueError, match="one spec per element of a tuple of 2"):
        _trace(wrong_count, (4,), (4,))


def test_a_nested_region_is_refused():
    inner = sr.shard_map(lambda x: x, MESH2, in_specs=P(), out_specs=P())
    outer = sr.shard_map(inner, MESH2, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(NotImplementedError, match="shard_map inside another shard_map's body is not supported"):
        _trace(outer, (4,))


def test_a_spec_naming_an_automatic_axis_is_refused():
    region = sr.shard_map(lambda x: x, MESH2, in_specs=P("y"), out_specs=P(), axis_names="x")
    with pytest.raises(ValueError, match=r"manual axes \('x',\) only.*P\('y'\)"):
        _trace(region, (4,))


@pytest.mark.parametrize("collective", [lambda x: sr.psum(x, "x"), lambda x: sr.pmax(x, "x"),
                                        lambda x: sr.psum_scatter(x, "x", tiled=True)], ids=["psum", "pmax", "scatter"])
def test_a_reduction_over_an_unsupported_dtype_is_refused(collective):
    region = sr.shard_map(lambda x: collective(x > 0), MESH2, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(TypeError, match=r"reduces float16, bfloat16, float32, float64, int32, int64 blocks; got bool"):
        _trace(region, (4,))


def test_a_bad_permutation_is_refused():
    region = sr.shard_map(lambda x: sr.ppermute(x, "x", [(0, 1), (1, 1)]), MESH2, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match=r"each source and each destination once; got perm=\[\(0, 1\), \(1, 1\)\]"):
        _trace(region, (4,))


def test_ring_attention_reference_equals_numpy():
    mesh = sr.Mesh((4,), ("x",))
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    got = sr.evaluate(sr.trace(ring_attention(mesh), q, k, v), q, k, v)[0]
    np.testing.assert_allclose(got, attention_np(q, k, v), rtol=1e-12)


def test_a_region_program_saves_and_loads_back(tmp_path):
    mesh = sr.Mesh((2, 2), ("x", "y"))
    region, auto, args = build(next(c for c in CASES if c.name == "ring_attention"), mesh, grad=True)
    sr.partition(region, mesh).save(tmp_path / "ring.json")
    loaded = sr.load_program(tmp_path / "ring.json")  # validated against the op records (program_check)
    assert loaded.collectives().count("collective_permute") >= 2
    want = sr.evaluate(auto, *args)
    for rank, outs in enumerate(run_everywhere(loaded, *args)):
        _close(outs, want, f"rank {rank}")


def test_a_bfloat16_psum_moves_16_bits_and_sums_like_the_reference():
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    mesh = sr.Mesh((4,), ("x",))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(bf16)
    region = sr.shard_map(lambda x: sr.psum(x, "x"), mesh, in_specs=P("x"), out_specs=P())
    graph = sr.trace(region, x)
    program = sr.partition(graph, mesh)
    want = x.astype(np.float32).sum(axis=0, keepdims=True).astype(bf16)  # float32 sum, rounded once
    np.testing.assert_array_equal(sr.evaluate(graph, x)[0], want)
    for outs in run_everywhere(program, x):
        np.testing.assert_array_equal(outs[0], want)
    assert program.comm_summary()[0]["bytes_in"] == 8 * 2  # one [1, 8] bfloat16 block
