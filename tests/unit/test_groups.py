"""Sibling groups (exec/groups.py): fusions of one shape whose results feed another run as ONE compiled loop
with several results; which fusions group (table), the merged loop, and the same bits as each fusion alone."""
import os
import shutil

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.exec import groups
from spmd_runtime.exec.backends import numpy_c as cpu_kernels
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.exec.runner import communicator
from test_fusion import fusions

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")
F32 = "float32"
MESH = sr.Mesh((1,), ("x",))


@pytest.fixture(autouse=True)
def compiled(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "1")
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "0")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))


def adam(g, m, v, p):
    """AdamW's update of one parameter: the new moments are outputs and feed the new parameter."""
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g * g
    return m2, v2, p - 0.01 * (m2 / (snp.sqrt(v2) + 1e-8) + 0.1 * p)


def program_of(fn, n, shape=(6, 8)):
    return sr.partition(sr.trace(fn, *[sr.TensorSpec(shape, F32)] * n), MESH, in_specs=[(None, None)] * n)


def test_adamw_moments_and_parameter_are_one_group_led_by_the_first_moment():
    program = program_of(adam, 4)
    m2, v2, p2 = [o.slot for o in program.outputs]
    assert {i.out for i in fusions(program)} == {m2, v2, p2}  # three fusions in the program and its listing
    (group,) = groups.sibling_groups(program).values()
    assert group.members == tuple(sorted((m2, v2, p2)))
    assert sorted(group.ins.args) == [i.out for i in program.instrs if i.op == "parameter"]  # each read once
    steps = group.ins.attrs["code"].split("; ")
    assert [steps[k].split("=")[1].split("(")[0] for k in group.results] == ["add", "add", "sub"]


def test_the_group_loop_writes_every_result():
    program = program_of(adam, 4)
    (group,) = groups.sibling_groups(program).values()
    source = cpu_kernels.c_function(group.fusion, list(group.dtypes), "k", list(group.results))
    assert source.splitlines()[0] == ("void k(const float* p0, const float* p1, const float* p2, const float* p3, "
                                      "float* out0, float* out1, float* out2) {")
    assert [line.strip().split("[")[0] for line in source.splitlines() if line.strip().startswith("out")] == [
        "out0", "out1", "out2"]


def test_grouped_and_alone_give_the_same_bits_and_fresh_results():
    program = program_of(adam, 4)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((6, 8)).astype(F32) for _ in range(4)]
    args[2] = np.abs(args[2])  # v >= 0
    mc = communicator(program.mesh)
    grouped, alone = Interpreter(program, mc, np), Interpreter(program, mc, np, groups=False)
    assert ("group", min(o.slot for o in program.outputs)) in grouped.cpu_kernels
    assert not any(isinstance(k, tuple) for k in alone.cpu_kernels)
    first, want = grouped.run(args), alone.run(args)
    second = grouped.run(args)
    for a, b, c in zip(first, second, want):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
        assert not np.shares_memory(a, b)  # program outputs stay fresh every run


def test_a_member_whose_outside_operand_comes_later_keeps_the_fusions_apart():
    def fn(x, w):
        a = snp.exp(x) * 2.0  # a fusion, an output
        b = x @ w  # computed after it
        return a, a * b + 1.0  # reads a and b: grouping would run before b exists
    program = sr.partition(sr.trace(fn, sr.TensorSpec((6, 6), F32), sr.TensorSpec((6, 6), F32)), MESH,
                           in_specs=[(None, None)] * 2)
    assert len(fusions(program)) == 2 and groups.sibling_groups(program) == {}


def test_a_later_member_with_a_planned_buffer_runs_alone():
    """p below is no output (a reduce reads it): its buffer is planned and may hold another value until its
    place, so the group is not run; the results are those of the fusions alone."""
    def fn(x, y):
        a = x * 0.9 + y
        p = a * 2.0 + y
        q = snp.sum(p * p, axis=0)
        return q, snp.sum(a, axis=0)  # a read after p: p cannot be computed into a's buffer
    program = program_of(fn, 2)
    assert groups.sibling_groups(program)  # a group in the program...
    mc = communicator(program.mesh)
    interp = Interpreter(program, mc, np)
    assert not any(isinstance(k, tuple) for k in interp.cpu_kernels)  # ...not run: p's buffer is planned
    rng = np.random.default_rng(2)
    args = [rng.standard_normal((6, 8)).astype(F32) for _ in range(2)]
    for got, want in zip(interp.run(args), Interpreter(program, mc, np, groups=False).run(args)):
        np.testing.assert_array_equal(got, want)


def test_the_switch_binds_every_fusion_alone(monkeypatch):
    monkeypatch.setenv(groups.GROUPS_ENV, "0")
    assert groups.sibling_groups(program_of(adam, 4)) == {}


def test_a_training_step_with_groups_gives_the_bits_of_its_fusions_alone():
    cfg = sr.LMConfig(layers=2, d=16, heads=2, ffn=32, vocab=24, seq=8, batch=4)
    ts = sr.build_train_step(cfg, sr.train_mesh((1,), "wus"), "wus", sr.AdamW())
    assert groups.sibling_groups(ts.program)
    state = ts.init(0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    args = sr.pytree.flatten((state["params"], state["opt_state"], {"tokens": tokens, "labels": tokens}))[0]
    mc = communicator(ts.program.mesh)
    for got, want in zip(Interpreter(ts.program, mc, np).run(args),
                         Interpreter(ts.program, mc, np, groups=False).run(args)):
        np.testing.assert_array_equal(got, want)
