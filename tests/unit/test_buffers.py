"""Buffers kept across runs: a collective whose result cannot leave the run refills one receive buffer;
outputs never are (or view) a kept buffer, so a second run leaves the first run's outputs intact."""
import tracemalloc

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec import loops
from spmd_runtime.exec.buffers import PLAN_ENV, output_buffers, plan_buffers
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.exec.runner import Runtime, shard

MESH = sr.Mesh((4,), ("data",))
SPEC = sr.TensorSpec((8, 6), "float32")


def gathered(fn, out_ndims):
    """``fn`` on x split over data, outputs replicated: the program ends in all_gathers."""
    return sr.partition(sr.trace(fn, SPEC), MESH, in_specs=[("data", None)],
                        out_specs=[(None,) * n for n in out_ndims])


def gathers(program):
    return {i.out for i in program.instrs if i.op in ("all_gather", "all_gather_done")}  # a done owns the result


def test_output_buffers_are_the_collectives_an_output_is_or_views():
    direct = gathered(lambda x: (snp.tanh(x), snp.tanh(x).T), (2, 2))  # returned, and returned through a view
    assert gathers(direct) and gathers(direct) <= output_buffers(direct)
    consumed = gathered(lambda x: snp.sum(snp.tanh(x) @ snp.tanh(x).T, axis=0), (1,))
    inner = gathers(consumed)
    assert inner and not inner & output_buffers(consumed)  # gathered operand of a matmul: kept across runs


def test_outputs_of_a_run_survive_the_next_run():
    program = gathered(lambda x: (snp.tanh(x) * 2.0, (snp.tanh(x) * 2.0).T), (2, 2))
    first, second = [np.random.default_rng(s).standard_normal((8, 6)).astype(np.float32) for s in (0, 1)]

    def body(comm):
        block = lambda x: shard(x, program.inputs[0].sharding, MESH, comm.Get_rank())
        outs = sr.run_local(program, block(first), comm=comm)
        kept = [o.copy() for o in outs]
        sr.run_local(program, block(second), comm=comm)
        return [np.array_equal(o, k) for o, k in zip(outs, kept)] + [np.allclose(kept[0], np.tanh(first) * 2)]

    assert all(all(same) for same in run_simulated(MESH.size, body))


# ------------------------------------------------------------------ result buffers planned once (plan_buffers)
def mlp_loss(x, w1, w2):
    h = snp.tanh(x @ w1) * 2.0 + 1.0
    return snp.sum(snp.maximum(h @ w2, 0.0), axis=1), snp.exp(snp.sum(x, axis=0))


MLP_SPECS = [sr.TensorSpec((256, 128), "float32"), sr.TensorSpec((128, 256), "float32"),
             sr.TensorSpec((256, 128), "float32")]


def second_run_allocation(program, args, planned: bool):
    """(bytes the second run held at its peak above what was live before it, bytes of its outputs, outputs
    of both runs) of ``program`` on one rank."""
    def body(comm):
        mc = Runtime.of(comm).communicator(program.mesh)
        with pytest.MonkeyPatch.context() as env:  # $SPMD_PLAN_BUFFERS=0: every result a new buffer each run
            env.setenv(PLAN_ENV, "1" if planned else "0")
            interp = Interpreter(program, mc, np)
        first = interp.run(args)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        second = interp.run(args)
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        return peak, sum(o.nbytes for o in second), first, second
    return run_simulated(1, body)[0]


def test_a_second_run_allocates_nothing_beyond_its_outputs():
    program = sr.partition(sr.trace(mlp_loss, *MLP_SPECS), sr.Mesh((1,), ("x",)))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(np.float32) * 0.1 for s in MLP_SPECS]
    peak, out_bytes, first, second = second_run_allocation(program, args, planned=True)
    unplanned_peak = second_run_allocation(program, args, planned=False)[0]
    activation = 256 * 256 * 4
    assert unplanned_peak > out_bytes + activation  # without the plan: every intermediate is a new buffer
    assert peak <= out_bytes + 16 * 2**10  # with it: the outputs, and a few small Python objects
    want = sr.evaluate(sr.trace(mlp_loss, *MLP_SPECS), *args)
    for f, s, w in zip(first, second, want):  # buffers shared by values whose lifetimes never overlap
        np.testing.assert_allclose(f, w, rtol=1e-5)
        np.testing.assert_array_equal(f, s)


def two_products(x, w1, w2):
    first = snp.sum(x @ w1, axis=1)  # x @ w1 dies here: x @ w2 can take its buffer
    return first + snp.sum(x @ w2.T, axis=1)


def test_planned_buffers_are_shared_only_by_values_that_never_live_at_once():
    program = sr.partition(sr.trace(two_products, *MLP_SPECS), sr.Mesh((1,), ("x",)), fuse=False)
    planned = plan_buffers(program, np)
    outputs = output_buffers(program)
    assert planned and not set(planned) & outputs  # outputs are fresh each run
    position = {i.out: k for k, i in enumerate(program.instrs)}
    last = {}
    for k, ins in enumerate(program.instrs):
        for a in ins.args:
            last[a] = k
    by_buffer = {}
    for slot, buf in planned.items():
        by_buffer.setdefault(buf.__array_interface__["data"][0], []).append(slot)
    assert any(len(slots) > 1 for slots in by_buffer.values())  # some buffer serves several values
    for slots in by_buffer.values():
        spans = sorted((position[s], last.get(s, position[s])) for s in slots)
        assert all(end < start for (_, end), (start, _) in zip(spans, spans[1:]))  # one value at a time


# ------------------------------------------------------------------ scans: stacked results made once
def train_step_inputs(scan_layers: bool):
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=48, seq=16, batch=4, scan_layers=scan_layers)
    ts = sr.build_train_step(cfg, sr.train_mesh((1,), "dp"), "dp", sr.AdamW())
    state = ts.init(0)
    tokens = np.random.default_rng(0).integers(0, 48, (4, 16)).astype(np.int32)
    return ts.program, sr.pytree.flatten((state["params"], state["opt_state"],
                                          {"tokens": tokens, "labels": tokens.copy()}))[0]


def test_a_scanned_training_step_runs_again_without_allocating_beyond_its_outputs():
    """The forward scan's residuals are written in place into stacked arrays made once; the backward scan
    reads them; the second run allocates its outputs and a few small Python objects."""
    program, args = train_step_inputs(scan_layers=True)
    assert any(i.op == "scan" for i in program.instrs)
    peak, out_bytes, first, second = second_run_allocation(program, args, planned=True)
    assert peak <= out_bytes + 32 * 2**10
    for f, s in zip(first, second):  # (tests/unit/test_train_scan.py: the same step as unrolled layers)
        np.testing.assert_array_equal(f, s)


def test_a_2_rank_scanned_step_writes_its_in_place_results_and_reduced_gradients_into_the_stacked_arrays(
        monkeypatch):
    """Stacked results computed in place (attention's scores, exponentiated in their buffer; each layer's weight
    gradients, all-reduced in place) are written straight into the stacked arrays kept across runs: of the
    stacked results only the layer inputs (body parameters) are copied, and two runs give the bits of copying
    every result. A donating step: its backward's stacked gradients stay in the run (without donation AdamW
    computes v' into them, so they leave it: fresh arrays each run, copied all the same)."""
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=48, seq=16, batch=4, scan_layers=True)
    ts = sr.build_train_step(cfg, sr.train_mesh((2,), "dp"), "dp", sr.AdamW(), donate=True)
    assert not any(loops._escapes(ts.program, i) for i in ts.program.instrs if i.op == "scan")
    tokens = np.random.default_rng(0).integers(0, 48, (4, 17)).astype(np.int32)

    def two_steps(comm):
        rt = Runtime.of(comm)
        local = ts.shard_state(ts.init(0), rt.rank)
        for _ in range(2):
            local, loss = ts.step(local, tokens[:, :-1], tokens[:, 1:], comm=rt)
        interp = rt.interpreter(ts.program, rt.communicator(ts.program.mesh), np)
        copied = [[o.slot for j, o in enumerate(ch.program.outputs[1:]) if j not in loops._written_in_place(ch, 1)]
                  for ch in interp.children]
        rt.unbind()
        return copied, sr.pytree.flatten(local)[0], loss

    copied, direct, loss = run_simulated(2, two_steps)[0]
    bodies = [ch for ch in (i.attrs.get("body") for i in ts.program.instrs) if ch is not None]
    for body, slots in zip(bodies, copied):
        assert all(body.instrs[s].op == "parameter" for s in slots), slots
    assert any(i.op == "all_reduce_done" for i in bodies[1].instrs)  # the backward's gradients: none copied
    monkeypatch.setattr(loops, "_written_in_place", lambda body, nc: {})
    _, plain, plain_loss = run_simulated(2, two_steps)[0]
    assert loss == plain_loss
    for d, p in zip(direct, plain):
        np.testing.assert_array_equal(d, p)


def scan_returning_ys(x, w):
    def body(c, xt):
        y = snp.tanh(xt @ w + c)
        return y, y * 2.0
    return sr.scan(body, snp.zeros((4,), "float32"), x)


def test_stacked_results_that_leave_the_run_are_fresh_each_run():
    specs = [sr.TensorSpec((3, 4), "float32"), sr.TensorSpec((4, 4), "float32")]
    program = sr.partition(sr.trace(scan_returning_ys, *specs), sr.Mesh((1,), ("x",)))
    rng = np.random.default_rng(0)
    a = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]
    b = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]

    def body(comm):
        interp = Interpreter(program, Runtime.of(comm).communicator(program.mesh), np)
        first = interp.run(a)
        kept = [o.copy() for o in first]
        interp.run(b)
        return all(np.array_equal(o, k) for o, k in zip(first, kept)), kept
    same, kept = run_simulated(1, body)[0]
    want = sr.evaluate(sr.trace(scan_returning_ys, *specs), *a)
    assert same
    for k, w in zip(kept, want):
        np.testing.assert_allclose(k, w, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_planned_instruction_leaves_its_value_in_its_buffer(dtype):
    """The contract a scan's in-place stacking relies on: a kernel given a planned buffer returns that buffer,
    C-ordered, holding the value (16-bit sums and einsums, computed in float32, are copied in)."""
    cfg = sr.LMConfig(layers=2, d=32, heads=4, ffn=64, vocab=48, seq=16, batch=4, scan_layers=False, dtype=dtype)
    ts = sr.build_train_step(cfg, sr.train_mesh((1,), "dp"), "dp", sr.AdamW())
    state = ts.init(0)
    tokens = np.random.default_rng(0).integers(0, 48, (4, 16)).astype(np.int32)
    args = sr.pytree.flatten((state["params"], state["opt_state"], {"tokens": tokens, "labels": tokens.copy()}))[0]

    def body(comm):
        interp = Interpreter(ts.program, Runtime.of(comm).communicator(ts.program.mesh), np)
        env, wrong, checked = {}, [], 0
        for out, index, free in interp.params:
            env[out] = args[index]
        for out, fn, ins_args, free in interp.steps:
            env[out] = value = fn(*[env[a] for a in ins_args])
            if out in interp.planned:
                checked += 1
                buffer = interp.planned[out]
                if value.ctypes.data != buffer.ctypes.data or not value.flags.c_contiguous:
                    wrong.append(ts.program.instrs[out].op)
            for s in free:
                del env[s]
        return checked, wrong
    checked, wrong = run_simulated(1, body)[0]
    assert checked > 20 and wrong == []
