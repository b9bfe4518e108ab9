"""scripts/bench_overlap.py's MPI clock wraps the interpreter without changing what a program computes: a
scanned program (its loop passes its body's steps to ``Interpreter.run``) gives the same outputs, and the
clock records the whole run. (It once lagged ``Interpreter.run``'s signature and broke every job.)"""
import importlib.util
import os

import numpy as np

import spmd_runtime as sr
from spmd_runtime.comm import collectives
from spmd_runtime.exec import interpreter
from simulated import run_everywhere

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("bench_overlap", os.path.join(ROOT, "scripts", "bench_overlap.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mpi_clock_times_a_scanned_program_and_leaves_its_outputs_alone(monkeypatch):
    for owner, name in [(collectives, "bind"), (collectives, "all_to_allv"), (collectives.Pending, "wait"),
                        (interpreter.Interpreter, "run")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    cfg = sr.LMConfig(layers=2, d=16, heads=2, ffn=32, vocab=24, seq=8, batch=4, dtype="float64")
    ts = sr.build_train_step(cfg, sr.train_mesh((2,), "megatron"), "megatron", sr.AdamW())
    assert any(i.op == "scan" for i in ts.program.instrs)
    state = ts.init(0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    args = sr.pytree.flatten((state["params"], state["opt_state"], {"tokens": tokens, "labels": tokens}))[0]
    plain = run_everywhere(ts.program, *args)
    clock = load_script()._time_mpi(collectives)
    timed = run_everywhere(ts.program, *args)
    for want, got in zip(plain, timed):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
    assert clock[1] > 0 and clock[0] > 0  # a whole run timed, and time inside the collectives
