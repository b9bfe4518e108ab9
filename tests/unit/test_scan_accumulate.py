"""A scan's stacked result added into a dying accumulator is accumulated by the scan itself, in place
(partition/scan_accumulate.py), and a loop runs in the buffer of an initial carry that dies there (``adopt``):
peak bytes against hand-computed figures, numerics against the reference evaluator on 1-4 simulated ranks, and
the executor's live bytes against ``peak_bytes()``."""
import tracemalloc

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.buffers import PLAN_ENV
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.exec.runner import Runtime

L, N = 6, 512  # layers, elements per layer
ROW = N * 8  # bytes of one float64 layer


def stacked_then_added(acc, xs):
    """``acc + ys``: the per-layer results of a scan (a backward pass's stacked gradients) into an accumulator."""
    ys = sr.scan(lambda c, x: (c, snp.tanh(x) * 2.0), snp.zeros((), "float64"), xs)[1]
    return acc + ys


SPECS = [sr.TensorSpec((L, N), "float64")] * 2


def partitioned(mesh, spec=(None, "x"), fuse=True):
    return sr.partition(sr.trace(stacked_then_added, *SPECS), mesh, in_specs=[spec, spec], donate=(0,), fuse=fuse)


def scans(program):
    return [i for i in program.instrs if i.op == "scan"]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_the_scan_accumulates_into_the_dying_accumulator_it_adopts(fuse):
    program = partitioned(sr.Mesh((1,), ("x",)), fuse=fuse)
    (scan,) = scans(program)
    assert scan.attrs["num_carry"] == 2 and 1 in scan.attrs["adopt"]  # the accumulator: a carry, run in place
    assert not [i for i in program.instrs if i.op == "add"]  # no whole-stack add after the loop
    body = scan.attrs["body"]
    assert [i.op for i in body.instrs if i.op == "dynamic_update_slice" and i.donate == 0]
    assert 1 in body.written_inputs


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_peak_holds_the_accumulator_once(fuse):
    """Inputs acc and xs (L rows each), then per iteration at most a few rows: the slice of xs, tanh's result,
    the accumulator's row; never a stacked [L, N] result beside the accumulator (that was 3 L rows)."""
    program = partitioned(sr.Mesh((1,), ("x",)), fuse=fuse)
    peak = program.peak_bytes()
    assert 2 * L * ROW <= peak <= 2 * L * ROW + 4 * ROW, (peak, 2 * L * ROW)


@pytest.mark.parametrize("shape", [(1,), (2,), (4,)], ids=str)
def test_results_equal_the_reference_evaluator(shape):
    mesh = sr.Mesh(shape, ("x",))
    program = partitioned(mesh)
    rng = np.random.default_rng(0)
    acc, xs = rng.standard_normal((L, N)), rng.standard_normal((L, N))
    want = sr.evaluate(sr.trace(stacked_then_added, *SPECS), acc, xs)[0]
    outs = run_simulated(mesh.size, lambda comm: sr.run(program, acc.copy(), xs, comm=comm))
    for got in outs:
        np.testing.assert_array_equal(got[0], want)  # the same single addition per element: bit for bit


def test_a_train_step_with_scanned_layers_and_micro_batches_keeps_one_gradient_buffer():
    """The megatron preset with gradient accumulation: its layers' backward scan carries the accumulators (adopted
    from the micro-batch loop's body), stacking no gradient of its own."""
    cfg = sr.LMConfig(layers=4, d=16, heads=2, ffn=64, vocab=32, seq=8, batch=8, remat="full")
    step = sr.build_train_step(cfg, sr.Mesh((2, 2), ("data", "model")), "megatron", microbatches=4, donate=True)
    (outer,) = scans(step.program)
    inner = [s for s in scans(outer.attrs["body"]) if s.attrs["reverse"]]
    assert inner and all(s.attrs.get("adopt") for s in inner)
    stacked = [o for s in inner for o in s.attrs["body"].outputs[s.attrs["num_carry"]:]]
    assert not stacked  # every per-layer gradient accumulated in place


# ------------------------------------------------------------------ plan == run: the executor's live bytes
def two_loops(x, w):
    """A ring written slot by slot by one loop, then by a second one (the 1F1B warm-up and steady loops): the
    second runs in the first one's result, which dies there."""
    def write(ring, t):
        return snp.reshape(sr.lax.dynamic_update_slice(ring, snp.reshape(snp.tanh(w) * t, (1, N)), (t, 0)),
                           (L, N)), None
    ring = sr.scan(write, x * 1.0, snp.arange(L))[0]
    ring = sr.scan(write, ring, snp.arange(L))[0]
    return snp.sum(ring, axis=0)


def live_bytes_of_a_run(program, args) -> int:
    """Bytes the executor held at its peak during a second run of ``program`` on one rank, above what was live
    before it (every result a new buffer: no planned buffers), its inputs excluded."""
    def body(comm):
        mc = Runtime.of(comm).communicator(program.mesh)
        with pytest.MonkeyPatch.context() as env:
            env.setenv(PLAN_ENV, "0")
            interp = Interpreter(program, mc, np)
        interp.run(args)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        interp.run(args)
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        return peak
    return run_simulated(1, body)[0]


def test_the_executor_holds_what_the_planner_counts():
    specs = [sr.TensorSpec((L, N), "float64"), sr.TensorSpec((N,), "float64")]
    program = sr.partition(sr.trace(two_loops, *specs), sr.Mesh((1,), ("x",)))
    first, second = scans(program)
    assert 0 in second.attrs.get("adopt", ())  # the first loop's ring dies at the second: no copy of it
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((L, N)), rng.standard_normal(N)]
    planned = program.peak_bytes() - sum(program.input_bytes())
    held = live_bytes_of_a_run(program, args)
    # the ring once (L rows) and a few rows around it; a copy of the ring beside it would be L rows more
    assert abs(held - planned) <= 3 * ROW + 16 * 2 ** 10, (held, planned)
    want = sr.evaluate(sr.trace(two_loops, *specs), *args)[0]
    np.testing.assert_allclose(sr.run(program, *args)[0], want, rtol=1e-12)


def test_the_1f1b_steady_loop_runs_in_the_warm_up_loops_ring():
    """The pipeline_1f1b preset: the steady loop adopts the saved-input ring the warm-up loop leaves (it dies
    there) and the cool-down loop only reads it, so the ring is held once, as the planner counts it."""
    cfg = sr.LMConfig(layers=4, d=16, heads=2, ffn=64, vocab=32, seq=8, batch=8, remat="full")
    step = sr.build_train_step(cfg, sr.train_mesh((2, 1, 2), "pipeline_1f1b"), "pipeline_1f1b", microbatches=4)
    loops = scans(step.program)
    assert len(loops) == 3  # warm-up, steady, cool-down
    _, steady, cool = loops
    ring = lambda loop: [k for k in range(loop.attrs["num_carry"]) if len(loop.attrs["body"].inputs[k].shape) >= 5]
    assert ring(steady) and set(ring(steady)) <= set(steady.attrs.get("adopt", ()))
    # the cool-down only reads the ring: no copy of it either
    assert ring(cool) and not set(ring(cool)) & cool.attrs["body"].written_inputs
