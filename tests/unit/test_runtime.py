"""The Runtime object and the agreement before a run (issue 9), in the simulated world."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

MESH = sr.Mesh((2,), ("x",))


def _program():
    return sr.partition(sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((6,), "float64")), MESH, in_specs=[("x",)])


def _errors(fn):
    """Each simulated rank's AgreedError message (None where the call returned)."""
    def body(comm):
        try:
            fn(comm)
        except sr.AgreedError as e:
            return str(e)
        return None
    return run_simulated(2, body)


def test_runtime_owns_its_caches_and_frees_its_communicators():
    program, x = _program(), np.arange(6.0)

    def body(comm):
        with sr.Runtime(comm) as rt:
            out = sr.run(program, x, comm=rt)[0]
            again = sr.run(program, x, comm=rt)[0]
            held = (len(rt._meshes), len(rt._interpreters), len(rt._meshes[MESH]._subs))
        return out, again, held, (len(rt._meshes), len(rt._interpreters))

    for out, again, held, after in run_simulated(2, body):
        assert out == again == pytest.approx(2 * np.exp(x).sum())
        assert held == (1, 1, 1) and after == (0, 0)
    assert "_interpreters" not in program.__dict__  # nothing cached on the program


def test_different_global_inputs_fail_on_every_rank_unless_unchecked():
    program = _program()
    messages = _errors(lambda comm: sr.run(program, np.arange(6.0) + comm.Get_rank(), comm=comm))
    for m in messages:
        assert "every rank must pass the same global inputs to sr.run" in m and "check_inputs=False" in m
    outs = run_simulated(2, lambda comm: sr.run(program, np.arange(6.0) + comm.Get_rank(), comm=comm,
                                                check_inputs=False)[0])
    assert outs[0] == outs[1]  # the mix the check exists to prevent: each rank's block of a different input


def test_ranks_binding_collectives_differently_fail_on_every_rank(monkeypatch):
    """SPMD_PERSISTENT or SPMD_PLAN_BUFFERS set on some ranks only: persistent requests on some, plain calls on
    the others would never match, so the run stops on every rank before any collective."""
    import threading
    from spmd_runtime.exec import runner
    mine, read = threading.local(), runner.read_settings  # the simulated ranks are threads of one process
    monkeypatch.setattr(runner, "read_settings", lambda: {**read(), "SPMD_PERSISTENT": mine.persistent})
    program = _program()

    def body(comm):
        mine.persistent = comm.Get_rank() == 0
        sr.run(program, np.arange(6.0), comm=comm)
    for m in _errors(body):
        assert "every rank must run with the same settings" in m
        assert "got different SPMD_PERSISTENT (persistent collectives match only persistent ones): ranks [0]: True; " \
               "ranks [1]: False" in m


def test_rank_local_input_errors_are_agreed_on():
    program = _program()

    class Odd:
        shape, dtype = (6,), "no-such-dtype"
    for m in _errors(lambda comm: sr.run(program, Odd() if comm.Get_rank() else np.arange(6.0), comm=comm)):
        assert "got errors on rank(s) [1]: global input" in m and "must be an array of float64[6]" in m
    other = sr.partition(sr.trace(lambda a: a.sum(), sr.TensorSpec((6,), "float64")), sr.Mesh((3,), ("x",)), in_specs=[("x",)])
    for m in _errors(lambda comm: sr.run(other if comm.Get_rank() else program, np.arange(6.0), comm=comm)):
        assert "got errors on rank(s) [1]: a program on Mesh(x=3) needs one MPI process per mesh device (3)" in m


def test_train_step_checks_tokens_and_labels_on_every_rank():
    cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
    step = sr.build_train_step(cfg, sr.train_mesh((2,), "dp"), "dp", sr.SGD(lr=0.1))
    state = step.init(0)
    tokens = np.zeros((2, 4), np.int64)
    bad = {"token id": (np.where(np.eye(2, 4) > 0, 16, tokens), tokens, "tokens must be token ids in [0, vocab=16)"),
           "float labels": (tokens, tokens + 0.5, "labels must be integer token ids; got dtype float64"),
           "shape": (tokens[:, :3], tokens, "must have shape (batch, seq) = (2, 4)")}
    for name, (tok, lab, message) in bad.items():
        def body(comm, tok=tok, lab=lab):
            step.step(step.shard_state(state, comm.Get_rank()), tok, lab, comm=comm)
        for m in _errors(body):
            assert m is not None and message in m, (name, m)
