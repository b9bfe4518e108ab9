"""The collective scheduler (partition/schedule.py): collectives split into start/done pairs, the start right
after its operand, the done right before its first use, in-flight receive buffers within the budget; the
listing, save/load and program_check know the pairs; loop bodies are scheduled too; the scheduled program
computes exactly what the blocking one does (simulated world, every preset of the training step).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.exec.overlap import progress_mode
from spmd_runtime.opdef import lookup
from spmd_runtime.partition.schedule import overlap_budget
from spmd_runtime.program_check import ProgramError, check_program
from spmd_runtime.train import build_train_step, train_mesh

from simulated import train_simulated

CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
OPT = AdamW(lr=1e-2, weight_decay=0.1)
M2 = sr.Mesh((2,), ("x",))


def traced_step(shape, preset, cfg=CFG):
    return build_train_step(cfg, train_mesh(shape, preset), preset, OPT)


def pairs(program):
    """start slot -> done instruction, for every split collective."""
    return {i.args[0]: i for i in program.instrs if i.op.endswith("_done")}


def in_flight_bytes(program) -> list[int]:
    """Receive bytes of the collectives started and not yet done, before each instruction."""
    open_, out = {}, []
    for ins in program.instrs:
        out.append(sum(open_.values()))
        if ins.op.endswith("_start"):
            open_[ins.out] = ins.nbytes
        elif ins.op.endswith("_done"):
            del open_[ins.args[0]]
    return out


def overlapped(a, w):
    """An all-reduce (a is split) with independent work (on w) between it and its use."""
    return a.sum() + snp.exp(w).sum()


def test_start_follows_its_operand_and_done_precedes_its_first_use():
    g = sr.trace(overlapped, sr.TensorSpec((8,), "float64"), sr.TensorSpec((4,), "float64"))
    p = sr.partition(g, M2, in_specs=[("x",), None], fuse=False)
    ops = [i.op for i in p.instrs if i.op != "parameter"]
    assert ops == ["reduce", "all_reduce_start", "exp", "reduce", "all_reduce_done", "add"]
    start = next(i for i in p.instrs if i.op == "all_reduce_start")
    done = pairs(p)[start.out]
    assert start.args == (start.out - 1,) and done.args == (start.out, start.args[0])
    assert p.collectives() == ["all_reduce"]  # a pair counts once
    text = str(p)
    assert f"%{start.out} = all_reduce_start(%{start.args[0]}, axes=(x), op=sum)" in text
    assert f"%{done.out} = all_reduce_done(%{start.out}, %{start.args[0]})" in text
    args = [np.arange(8.0), np.linspace(0, 1, 4)]
    want = sr.evaluate(g, *args)
    for outs in run_simulated(2, lambda comm: sr.run(p, *args, comm=comm)):
        np.testing.assert_allclose(outs[0], want[0], rtol=1e-12)


def test_nothing_to_hide_behind_stays_blocking_and_off_switches():
    g = sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((8,), "float64"))
    assert [i.op for i in sr.partition(g, M2, in_specs=[("x",)]).instrs][-1] == "all_reduce"
    g = sr.trace(overlapped, sr.TensorSpec((8,), "float64"), sr.TensorSpec((4,), "float64"))
    off = sr.partition(g, M2, in_specs=[("x",), None], overlap=False)
    assert "all_reduce" in [i.op for i in off.instrs] and not any(i.op.endswith("_start") for i in off.instrs)


def test_gradient_all_reduce_reduces_in_place_into_its_dying_operand():
    ts = traced_step((4,), "dp")
    dones = [i for i in ts.program.instrs if i.op == "all_reduce_done"]
    assert len(dones) >= 4  # the gradients (stacked layers: one per kind of weight)
    users = {}
    for i in ts.program.instrs:
        for a in i.args:
            users.setdefault(a, []).append(i.out)
    by_slot = {i.out: i for i in ts.program.instrs}
    sole = [d for d in dones if users[d.args[1]] == [d.args[0], d.out]  # read by its start and done only,
            and lookup(by_slot[d.args[1]].op).fresh  # and a buffer of its own (an einsum's, not a scatter's)
            and d.shape]  # a gradient: a 0-d value (the loss) is never reduced in place (_assign_donations)
    assert len(sole) >= 3 and all(d.donate == 1 for d in sole)  # shown as %x! in the listing
    assert any(f"all_reduce_done(%{d.args[0]}, %{d.args[1]}!)" in str(ts.program) for d in dones)


@pytest.mark.parametrize("shape,preset", [((2,), "dp"), ((2,), "megatron"), ((2, 2), "megatron_wus"),
                                          ((4,), "fsdp"), ((2, 2), "fsdp_megatron"), ((2,), "seq")])
def test_scheduled_step_equals_the_blocking_step_bit_for_bit(shape, preset, monkeypatch):
    ts = traced_step(shape, preset)
    monkeypatch.setenv("SPMD_ASYNC", "0")
    blocking = traced_step(shape, preset)
    assert not any(i.op.endswith("_start") for i in blocking.program.instrs)
    assert any(i.op.endswith("_start") for i in ts.program.instrs), f"{preset}: nothing was split"
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)), rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)))
            for _ in range(2)]
    state = ts.init(seed=1)
    got, want = train_simulated(ts, state, data), train_simulated(blocking, state, data)
    assert got[1] == want[1]
    for g, w in zip(sr.pytree.flatten(got[0])[0], sr.pytree.flatten(want[0])[0], strict=True):
        np.testing.assert_array_equal(g, w)


def test_fsdp_weight_gathers_prefetch_within_the_budget(monkeypatch):
    unrolled = dataclasses.replace(CFG, scan_layers=False)  # prefetch across layers (not across loop iterations)
    big = traced_step((4,), "fsdp", unrolled).program
    gathers = [i for i in big.instrs if i.op == "all_gather_start"]
    assert len(gathers) > 4
    # with room for everything every weight all-gather starts before the first compute
    first_compute = next(k for k, i in enumerate(big.instrs) if i.op not in ("parameter", "all_gather_start"))
    assert sum(i.out < first_compute for i in gathers) > 4
    budget = 3 * max(i.nbytes for i in gathers)
    monkeypatch.setenv("SPMD_ASYNC_BUDGET", str(budget))
    small = traced_step((4,), "fsdp", unrolled).program
    flight = in_flight_bytes(small)
    assert 0 < max(flight) <= budget
    assert max(flight) > max(i.nbytes for i in gathers)  # more than one gather ahead of its use
    started = [k for k, i in enumerate(small.instrs) if i.op == "all_gather_start"]
    assert started[-1] > first_compute  # later layers' weights wait for room: prefetched, not all at once


def test_budget_zero_splits_nothing_and_bad_budgets_are_refused(monkeypatch):
    g = sr.trace(overlapped, sr.TensorSpec((8,), "float64"), sr.TensorSpec((4,), "float64"))
    p = sr.partition(g, M2, in_specs=[("x",), None], overlap_budget=0)
    assert not any(i.op.endswith("_start") for i in p.instrs)
    monkeypatch.setenv("SPMD_ASYNC_BUDGET", "lots")
    with pytest.raises(ValueError, match=r"SPMD_ASYNC_BUDGET must be a whole number of bytes; got 'lots'"):
        overlap_budget(None)
    with pytest.raises(ValueError, match=r"overlap_budget must be a whole number of bytes >= 0; got -1"):
        overlap_budget(-1)


def test_pairs_survive_save_and_load_and_program_check_rejects_broken_ones(tmp_path):
    g = sr.trace(overlapped, sr.TensorSpec((8,), "float64"), sr.TensorSpec((4,), "float64"))
    p = sr.partition(g, M2, in_specs=[("x",), None], fuse=False)
    p.save(tmp_path / "p.json")
    q = sr.load_program(tmp_path / "p.json")
    assert q.hash == p.hash and str(q) == str(p)
    start = next(i for i in q.instrs if i.op == "all_reduce_start")
    done = pairs(q)[start.out]
    done.args = (start.out, start.out + 2)  # waits for the start but names another (live) operand
    with pytest.raises(ProgramError, match=r"a done takes \(its own start, the start's operand\)"):
        check_program(q)
    done.args, done.op = (start.out, start.args[0]), "all_gather_done"
    with pytest.raises(ProgramError, match="a done takes"):
        check_program(q)
    q.instrs[done.out] = type(done)(**{**done.__dict__, "op": "exp", "args": (start.args[0],)})
    with pytest.raises(ProgramError, match=r"every collective start must have its done; got none for slot"):
        check_program(q)


def test_loop_bodies_are_scheduled():
    def f(h, ws, w2):
        def body(c, w):
            m = h @ w  # w's contracted dim is split: an all-reduce, whose first use comes after the exp
            e = snp.exp(c * w2).sum()
            return c + e + m.sum(), None
        return sr.scan(body, snp.zeros((), "float64"), ws)[0]
    specs = [sr.TensorSpec((4, 8), "float64"), sr.TensorSpec((3, 8, 2), "float64"), sr.TensorSpec((5,), "float64")]
    p = sr.partition(sr.trace(f, *specs), M2, in_specs=[(None, "x"), (None, "x", None), None], fuse=False)
    scan = next(i for i in p.instrs if i.op == "scan")
    body_ops = [i.op for i in scan.attrs["body"].instrs]
    assert "all_reduce_start" in body_ops and "all_reduce_done" in body_ops
    assert "all_reduce_start(" in str(p)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape) for s in specs]
    want = sr.evaluate(sr.trace(f, *specs), *args)
    for outs in run_simulated(2, lambda comm: sr.run(p, *args, comm=comm)):
        np.testing.assert_allclose(outs[0], want[0], rtol=1e-12)


def test_progress_modes_agree_and_a_bad_mode_is_refused(monkeypatch):
    g = sr.trace(overlapped, sr.TensorSpec((8,), "float64"), sr.TensorSpec((4,), "float64"))
    args = [np.arange(8.0), np.linspace(0, 1, 4)]
    results = {}
    for mode in ("test", "none"):
        monkeypatch.setenv("SPMD_PROGRESS", mode)
        p = sr.partition(g, M2, in_specs=[("x",), None])  # each simulated world binds it anew
        results[mode] = run_simulated(2, lambda comm: sr.run(p, *args, comm=comm))[0][0]
    assert results["test"] == results["none"]
    monkeypatch.setenv("SPMD_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match=r"SPMD_PROGRESS must be one of \['test', 'none'\]; got 'sometimes'"):
        progress_mode()
