"""Partial sums combined before they are reduced (partition/pending_sums.py; XLA's all-reduce reassociation and
while-loop all-reduce code motion), in the simulated world.

A table: (function, shapes, mesh, in specs, out specs) -> the exact collectives (kind, axes, bytes in per rank)
and the values against the reference evaluator on 1 to 8 ranks, even and uneven. Then loops (an accumulator
that starts at zero completes its sum once, after the loop) and the training step: Megatron's 4 tensor-parallel
all-reduces of the (b, s, h) activation per layer (5 with full remat: the recomputed forward needs only the
attention's), gradient accumulation reducing once per step with results equal to the plain step, and a tied
embedding's two gradient contributions reduced once.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import pytree
from spmd_runtime.models.lm import LMConfig, param_shapes

from simulated import run_everywhere

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("collectives_per_layer",
                                               os.path.join(ROOT, "scripts", "collectives_per_layer.py"))
per_layer_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(per_layer_script)

F8 = 8  # bytes of a float64


def mesh(*shape, names=None):
    return sr.Mesh(shape, names or ("x", "y")[:len(shape)])


# ---------------------------------------------------------------- the table
def qkv_input_cotangent(g1, g2, g3, w1, w2, w3):
    """Megatron's backward through the Q, K and V projections of one input: three partial products summed."""
    return g1 @ w1.T + g2 @ w2.T + g3 @ w3.T


def difference(x, w1, w2):
    return x @ w1 - x @ w2


def negated_sum(x, w1, w2):
    return -(x @ w1) + x @ w2


def scaled_sum(x, w1, w2, s):
    return (x @ w1) * s + (x @ w2) / s


def two_inputs_difference(a, w1, b, w2):
    return a @ w1 - b @ w2


def nonlinear_summand(x, w1, w2):
    return snp.tanh(x @ w1) + x @ w2


def product_used_twice(x, w1, w2, w3):
    p = x @ w1
    return p + x @ w2, p + x @ w3


def transposed_summand(x, y, w):
    """A tied embedding's two gradients: one contraction transposed, added to another."""
    return snp.transpose(snp.einsum("bd,bv->dv", x, y)) + snp.einsum("bv,bd->vd", y, w)


def one(x, w):
    return x @ w


ROWS = ("x", None)
COLS = (None, "x")
M4, M3, M8, M2x4 = mesh(4), mesh(3), mesh(8), mesh(2, 4)
# name, fn, shapes, mesh, in_specs, out_specs, expected [(kind, axes, bytes in per rank)]
TABLE = [
    ("qkv_cotangent_one_all_reduce", qkv_input_cotangent, [(6, 8)] * 3 + [(10, 8)] * 3, M4,
     [COLS] * 6, None, [("all_reduce", ("x",), 6 * 10 * F8)]),
    ("qkv_cotangent_uneven_3", qkv_input_cotangent, [(6, 8)] * 3 + [(10, 8)] * 3, M3,
     [COLS] * 6, None, [("all_reduce", ("x",), 6 * 10 * F8)]),
    ("qkv_cotangent_8", qkv_input_cotangent, [(6, 16)] * 3 + [(5, 16)] * 3, M8,
     [COLS] * 6, None, [("all_reduce", ("x",), 6 * 5 * F8)]),
    ("qkv_cotangent_on_y_of_2x4", qkv_input_cotangent, [(6, 8)] * 3 + [(10, 8)] * 3, M2x4,
     [("x", "y")] * 3 + [(None, "y")] * 3, [("x", None)], [("all_reduce", ("y",), 3 * 10 * F8)]),
    ("difference", difference, [(4, 8), (8, 6), (8, 6)], M4, [COLS, ROWS, ROWS], None,
     [("all_reduce", ("x",), 4 * 6 * F8)]),
    ("negated_sum", negated_sum, [(4, 8), (8, 6), (8, 6)], M4, [COLS, ROWS, ROWS], None,
     [("all_reduce", ("x",), 4 * 6 * F8)]),
    ("scaled_by_final_values", scaled_sum, [(4, 8), (8, 6), (8, 6), (4, 6)], M4, [COLS, ROWS, ROWS, None], None,
     [("all_reduce", ("x",), 4 * 6 * F8)]),
    # wanted split: the one completion is a reduce-scatter of the summed partial products
    ("sum_reduce_scattered", difference, [(8, 8), (8, 6), (8, 6)], M4, [COLS, ROWS, ROWS], [ROWS],
     [("reduce_scatter", ("x",), 8 * 6 * F8)]),
    # a transpose keeps the sum pending: the tied embedding's gradients
    ("transposed_summand", transposed_summand, [(8, 6), (8, 5), (8, 6)], M4, [ROWS, ROWS, ROWS], None,
     [("all_reduce", ("x",), 5 * 6 * F8)]),
    # controls: a nonlinear op needs its operand complete; a product used twice is completed once, for both
    ("nonlinear_summand_completes_first", nonlinear_summand, [(4, 8), (8, 6), (8, 6)], M4, [COLS, ROWS, ROWS],
     None, [("all_reduce", ("x",), 4 * 6 * F8)] * 2),
    ("product_used_twice", product_used_twice, [(4, 8), (8, 6), (8, 6), (8, 6)], M4, [COLS, ROWS, ROWS, ROWS],
     None, [("all_reduce", ("x",), 4 * 6 * F8)] * 3),
    # sums over different axes are not one sum
    ("different_axes_stay_apart", two_inputs_difference, [(4, 8), (8, 6), (4, 8), (8, 6)], M2x4,
     [COLS, ROWS, (None, "y"), ("y", None)], None,
     [("all_reduce", ("x",), 4 * 6 * F8), ("all_reduce", ("y",), 4 * 6 * F8)]),
    ("one_product_one_rank", one, [(4, 8), (8, 6)], mesh(1), [COLS, ROWS], None, []),
]


def collectives_with_bytes(program):
    return [(c["kind"], c["axes"], c["bytes_in"]) for c in program.comm_summary()]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("name,fn,shapes,mesh_,in_specs,out_specs,expected", TABLE, ids=[t[0] for t in TABLE])
def test_pending_sums_complete_once_and_keep_the_values(name, fn, shapes, mesh_, in_specs, out_specs, expected):
    rng = np.random.default_rng(7)
    args = [rng.standard_normal(s) for s in shapes]
    graph = sr.trace(fn, *args)
    program = sr.partition(graph, mesh_, in_specs=in_specs, out_specs=out_specs)
    assert sorted(collectives_with_bytes(program)) == sorted(expected), str(program)
    want = sr.evaluate(graph, *args)
    for outs in run_everywhere(program, *args):
        for o, w in zip(outs, want):
            np.testing.assert_allclose(o, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- loops
def accumulated_products(init_zero: bool):
    def f(xs, w):
        init = snp.zeros((xs.shape[1], w.shape[1]), xs.dtype) if init_zero else snp.ones((xs.shape[1], w.shape[1]),
                                                                                          xs.dtype)
        return sr.scan(lambda acc, x: (acc + x @ w, None), init, xs)[0]
    return f


@pytest.mark.parametrize("mesh_,out_spec,kind", [(M4, None, "all_reduce"), (M3, None, "all_reduce"),
                                                 (M4, ROWS, "reduce_scatter"), (M8, None, "all_reduce")],
                         ids=["4", "3-uneven", "4-reduce-scatter", "8"])
def test_an_accumulator_starting_at_zero_completes_its_sum_once_after_the_loop(mesh_, out_spec, kind):
    rng = np.random.default_rng(3)
    xs, w = rng.standard_normal((5, 4, 8)), rng.standard_normal((8, 6))
    for zero, trips in ((True, 1), (False, 5)):  # a non-zero start: completed in every iteration, as before
        graph = sr.trace(accumulated_products(zero), xs, w)
        program = sr.partition(graph, mesh_, in_specs=[(None, None, "x"), ROWS],
                               out_specs=None if out_spec is None else [out_spec])
        summary = program.comm_summary()
        assert [(c["kind"], c["axes"], c.get("trips", 1)) for c in summary] == [(kind, ("x",), trips)], str(program)
        want = sr.evaluate(graph, xs, w)[0]
        for outs in run_everywhere(program, xs, w):
            np.testing.assert_allclose(outs[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh_,out_spec,kind", [(M4, None, "all_reduce"), (M3, None, "all_reduce"),
                                                 (M4, ROWS, "reduce_scatter")], ids=["4", "3-uneven", "4-reduce-scatter"])
def test_a_pending_sum_carried_from_one_accumulating_loop_into_the_next_completes_once_after_it(mesh_, out_spec,
                                                                                                 kind):
    """Two loops adding partial products (the 1F1B steady and cool-down loops' gradients): the second starts from
    the first's pending result, and the sum completes once, after the second; a second loop that does not
    accumulate (it scales its carry) gets the first's sum completed before it."""
    rng = np.random.default_rng(4)
    xs, ys, w = rng.standard_normal((5, 4, 8)), rng.standard_normal((3, 4, 8)), rng.standard_normal((8, 6))
    for accumulating, trips in ((True, 1), (False, None)):
        def f(xs, ys, w):
            first = accumulated_products(True)(xs, w)
            body = (lambda acc, y: (acc + y @ w, None)) if accumulating else (lambda acc, y: (acc * 0.5, None))
            return sr.scan(body, first, ys)[0]
        graph = sr.trace(f, xs, ys, w)
        program = sr.partition(graph, mesh_, in_specs=[(None, None, "x"), (None, None, "x"), ROWS],
                               out_specs=None if out_spec is None else [out_spec])
        summary = [(c["kind"], c["axes"], c.get("trips", 1)) for c in program.comm_summary()]
        if accumulating:
            assert summary == [(kind, ("x",), 1)], str(program)
        else:  # completed between the loops, then carried final
            assert [c for c in summary if c[2] != 1] == [] and len(summary) == 1
        want = sr.evaluate(graph, xs, ys, w)[0]
        for outs in run_everywhere(program, xs, ys, w):
            np.testing.assert_allclose(outs[0], want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the training step
CFG = LMConfig(layers=3, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=16, dtype="float64")


@pytest.mark.parametrize("shape", [(2, 4), (4,)], ids=["2x4", "4"])
@pytest.mark.parametrize("remat,want", [("none", 4), ("full", 5)])
def test_megatron_all_reduces_the_activation_4_times_per_layer(shape, remat, want):
    """Forward: after the attention's output projection and after the MLP's second matmul; backward: the input
    cotangents of the QKV projections (one sum) and of the MLP's first matmul. Full remat recomputes the forward
    up to the MLP's input: one more (Megatron-LM's 6 recompute the whole layer, its output unused)."""
    cfg = dataclasses.replace(per_layer_script.CFG, remat=remat)  # big enough for Megatron's own strategies
    layer, rest = per_layer_script.per_layer(cfg, shape, "megatron")
    nbytes = per_layer_script.activation_bytes(cfg, shape, "megatron")
    assert per_layer_script.tensor_parallel_all_reduces(layer, nbytes) == want
    # outside the layers: the embedding's (vocab-split lookup) and the logits' input cotangent, as Megatron-LM's
    assert per_layer_script.tensor_parallel_all_reduces(rest, nbytes) == 2


def data_reductions(program):
    """(count, wire bytes) per step of the reductions over the data axis, and the largest trip count among them."""
    summary = [c for c in program.comm_summary() if "data" in c["axes"] and c["kind"] in ("all_reduce", "reduce_scatter")]
    return (sum(c.get("trips", 1) for c in summary), sum(c["wire_bytes"] for c in summary),
            max(c.get("trips", 1) for c in summary))


def build(cfg, shape, preset, microbatches=1):
    return sr.build_train_step(cfg, sr.train_mesh(shape, preset), preset, sr.AdamW(lr=1e-2),
                               microbatches=microbatches)


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("shape,preset,scan", [((2, 2), "dp", True), ((2, 2), "megatron", True),
                                               ((4,), "dp", False), ((2, 2), "megatron_wus", True)], ids=str)
def test_accumulated_gradients_are_reduced_once_per_step_and_equal_the_plain_step(shape, preset, scan):
    cfg = dataclasses.replace(CFG, layers=2, scan_layers=scan)
    plain, accumulated = build(cfg, shape, preset), build(cfg, shape, preset, 4)
    (count, wire, trips), (plain_count, plain_wire, plain_trips) = (data_reductions(ts.program)
                                                                    for ts in (accumulated, plain))
    assert wire == pytest.approx(plain_wire, rel=1e-12) and trips == 1  # once per step, after the loop: not x 4
    # the plain step reduces each layer's gradient in the scanned layers' backward loop; accumulated, the
    # stacked gradients are reduced once, after the micro-batch loop
    assert count == (plain_count if not scan else len(param_shapes(cfg)) + 1) and plain_trips == (2 if scan else 1)
    kinds = {c["kind"] for c in accumulated.program.comm_summary() if "data" in c["axes"]}
    assert ("reduce_scatter" in kinds) == (preset == "megatron_wus")  # the update's layout, reached once
    rng = np.random.default_rng(0)
    tokens, labels = (rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype("int32") for _ in range(2))
    state = plain.init(1)
    batch = {"tokens": tokens, "labels": labels}
    want = run_everywhere(plain.program, state["params"], state["opt_state"], batch)[0]
    for got in run_everywhere(accumulated.program, state["params"], state["opt_state"], batch):
        for g, w in zip(pytree.flatten(got)[0], pytree.flatten(want)[0]):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


def test_a_tied_embeddings_two_gradients_are_reduced_once():
    """The lookup's scatter-add and the output layer's (transposed) contraction: one data-parallel reduction."""
    cfg = dataclasses.replace(CFG, layers=1, tied=True)
    program = build(cfg, (4,), "dp").program
    table = np.prod(param_shapes(cfg)["embed"]) * F8
    assert [c["kind"] for c in program.comm_summary() if c["bytes_in"] == table] == ["all_reduce"]
    assert data_reductions(program)[0] == len(param_shapes(cfg)) + 1  # one per gradient, and the loss
    untied = build(dataclasses.replace(cfg, tied=False), (4,), "dp").program
    assert data_reductions(untied)[0] == len(param_shapes(cfg)) + 2  # one more parameter: its own
