"""Cross-iteration prefetch of a scan body's gathers (partition/scan_prefetch.py, ``$SPMD_SCAN_PREFETCH=1``):
FSDP's weight all-gathers of iteration t + 1 start at the top of iteration t and are waited at its end; the
first iteration's are gathered before the loop. Table: (preset, mesh, remat) -> how many gathers each scan
prefetches, where their starts and dones stand, and the training state after two steps equal to the bit to
the same steps without prefetch, in the simulated world."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.program import load_program
from simulated import train_simulated

CFG = sr.LMConfig(layers=3, d=16, heads=2, ffn=32, vocab=24, seq=8, batch=6, dtype="float64")
TABLE = [  # (preset, mesh, remat, shifts of the forward scan's prefetched xs, of the backward scan's)
    ("fsdp", (2,), "none", 1, None),  # remat none: the backward reads the gathered weights the forward stacked
    ("fsdp", (3,), "full", 1, -1),  # the backward regathers, in reverse (d 18: dims that 3 ranks split)
    ("fsdp", (4,), "dots", 1, -1),
    ("fsdp_megatron", (2, 2), "full", 1, -1),
    ("fsdp", (8,), "none", 1, None),
]


def build(preset, mesh, remat, prefetch: bool, monkeypatch, layers=3):
    monkeypatch.setenv("SPMD_SCAN_PREFETCH", "1" if prefetch else "0")
    sizes = {"d": 18, "ffn": 36} if 3 in mesh else {}
    cfg = dataclasses.replace(CFG, remat=remat, layers=layers, **sizes)
    return sr.build_train_step(cfg, sr.train_mesh(mesh, preset), preset, sr.AdamW(lr=1e-2))


def scans(ts):
    return [i for i in ts.program.instrs if i.op == "scan"]


@pytest.mark.parametrize("preset, mesh, remat, forward, backward", TABLE, ids=lambda v: str(v))
def test_prefetched_gathers_start_an_iteration_early_and_change_no_bit(preset, mesh, remat, forward, backward,
                                                                          monkeypatch):
    plain, piped = build(preset, mesh, remat, False, monkeypatch), build(preset, mesh, remat, True, monkeypatch)
    assert all("shifts" not in s.attrs for s in scans(plain))  # off by default
    fwd, bwd = scans(piped)
    for scan, shift in ((fwd, forward), (bwd, backward)):
        shifts = scan.attrs.get("shifts", ())
        m = sum(s != 0 for s in shifts)
        assert (m > 0) == (shift is not None) and set(shifts) <= {0, shift or 0}, shifts
        if m:
            check_placement(scan, m)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)), rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)))
               for _ in range(2)]  # (vocab, batch, seq as in CFG for every row)
    state = plain.init(0)
    (want, want_losses), (got, got_losses) = train_simulated(plain, state, batches), train_simulated(piped, state,
                                                                                                     batches)
    assert got_losses == want_losses
    for g, w in zip(sr.pytree.flatten(got)[0], sr.pytree.flatten(want)[0]):
        np.testing.assert_array_equal(g, w)


def check_placement(scan, m):
    """The body's last m inputs among the xs are the next slices; each is gathered by a start before any
    compute and a done after all of it, handed on as a carry output (never read inside the body)."""
    body, nc, nx = scan.attrs["body"], scan.attrs["num_carry"], scan.attrs["num_xs"]
    index = {i.out: i.attrs["index"] for i in body.instrs if i.op == "parameter"}
    nxt = {s for s, k in index.items() if nc + nx - m <= k < nc + nx}
    starts = [i for i in body.instrs if i.op == "all_gather_start" and i.args[0] in nxt]
    dones = [i for i in body.instrs if i.op == "all_gather_done" and i.args[0] in {s.out for s in starts}]
    compute = [i.out for i in body.instrs if i.op not in ("parameter",) and "_start" not in i.op
               and "_done" not in i.op]
    assert len(starts) == len(dones) == m
    assert max(s.out for s in starts) < min(compute) and min(d.out for d in dones) > max(compute)
    carried = {o.slot for o in body.outputs[nc - m:nc]}
    assert carried == {d.out for d in dones}
    assert not any(d.out in i.args for d in dones for i in body.instrs)


def test_not_taken_for_one_iteration_or_beyond_the_budget(monkeypatch):
    one = build("fsdp", (2,), "none", True, monkeypatch, layers=1)
    assert all("shifts" not in s.attrs for s in scans(one))
    monkeypatch.setenv("SPMD_ASYNC_BUDGET", "64")  # bytes: not even one layer's gathered weights
    tight = build("fsdp", (2,), "none", True, monkeypatch)
    assert all("shifts" not in s.attrs for s in scans(tight))


def test_a_prefetching_program_saves_and_loads(monkeypatch):
    program = build("fsdp", (2,), "full", True, monkeypatch).program
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.json")
        program.save(path)
        loaded = load_program(path)
    assert loaded.hash == program.hash and str(loaded) == str(program)
    assert any(s.attrs.get("shifts") for s in loaded.instrs if s.op == "scan")
