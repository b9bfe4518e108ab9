"""Errors at the user's line (issue 28): every traced node records the user's (file, line); listings, partitioner
warnings and profiler spans show it; a failure while tracing under sr.jit keeps its exception type on every rank
and names the user's file and line; a Python number argument used where Python needs a value names
static_argnums."""
import inspect
import json
import os
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.comm.agreement import AgreedError

HERE = os.path.abspath(__file__)
MESH2 = sr.Mesh((2,), ("x",))


def line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (so the tests do not hard-code line numbers)."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()
    return next(k + 1 for k, text in enumerate(lines) if marker in text and "line_of(" not in text)


def broken_model(x):
    h = snp.tanh(x)
    return h.no_such_attribute  # BROKEN


def test_nodes_record_the_users_line():
    def model(x):
        return snp.exp(x) * 2.0  # EXP-LINE
    graph = sr.trace(model, sr.TensorSpec((4,)))
    exp = next(n for n in graph.nodes if n.op == "exp")
    assert exp.source == (HERE, line_of("# EXP-LINE"))
    assert f"test_trace_errors.py:{line_of('# EXP-LINE')}" in str(graph)


def test_listing_shows_the_users_line_and_survives_save_and_load(tmp_path):
    def model(x, w):
        return snp.tanh(x @ w)  # MATMUL-LINE
    graph = sr.trace(model, sr.TensorSpec((8, 4)), sr.TensorSpec((4, 6)))
    program = sr.partition(graph, MESH2, in_specs=[(None, "x"), ("x", None)])
    where = f"# test_trace_errors.py:{line_of('# MATMUL-LINE')}"
    assert any(line.split(" = ")[1].startswith("einsum") and where in line for line in str(program).splitlines()
               if " = " in line), str(program)
    program.save(tmp_path / "p.json")
    loaded = sr.load_program(tmp_path / "p.json")
    assert loaded.hash == program.hash and str(loaded) == str(program)


def test_partitioner_warnings_are_issued_at_the_users_line():
    def model(signal, k):
        return snp.conv(signal, k, padding="SAME")  # CONV-LINE
    graph = sr.trace(model, sr.TensorSpec((2, 3, 4)), sr.TensorSpec((4, 3, 9)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sr.partition(graph, sr.Mesh((4,), ("x",)), in_specs=[(None, None, "x"), None])
    mine = [w for w in caught if "spmd_runtime partitioner" in str(w.message)]
    assert mine and all((w.filename, w.lineno) == (HERE, line_of("# CONV-LINE")) for w in mine), \
        [(w.filename, w.lineno, str(w.message)) for w in caught]


def test_profiler_spans_name_the_users_line(tmp_path):
    def model(x):
        return snp.sum(snp.exp(x))  # PROFILED-LINE
    sr.jit(model, mesh=sr.Mesh((1,), ("x",)), profile=str(tmp_path))(np.ones(4))
    events = json.loads((tmp_path / "rank0.trace.json").read_text())["traceEvents"]
    sources = {e["args"].get("source") for e in events if e.get("ph") == "X" and e["cat"] == "compute"}
    assert f"{HERE}:{line_of('# PROFILED-LINE')}" in sources, sources


@pytest.mark.parametrize("n", [1, 2])
def test_a_trace_error_under_jit_keeps_its_type_and_names_the_users_line_on_every_rank(n):
    mesh = sr.Mesh((n,), ("x",))

    def call(comm):
        try:
            sr.jit(broken_model, mesh=mesh, comm=comm)(np.ones(4))
        except AttributeError as e:
            return type(e), str(e), e.__cause__, isinstance(e, AgreedError), e.ranks
        return None
    where = f"{HERE}:{line_of('# BROKEN')}"
    for kind, message, cause, agreed, ranks in run_simulated(n, call):
        assert issubclass(kind, AttributeError) and agreed and ranks == list(range(n))
        assert where in message and "no_such_attribute" in message
        assert isinstance(cause, AttributeError) and cause.__traceback__ is not None  # chained: the user's frame


def test_a_failure_on_one_rank_raises_its_type_on_every_rank():
    def call(comm):
        def model(x):
            if comm.Get_rank() == 1:
                raise KeyError("only on rank 1")  # RANK1-LINE
            return x * 2.0
        try:
            sr.jit(model, mesh=MESH2, comm=comm)(np.ones(4))
        except KeyError as e:
            return type(e).__mro__[1], str(e)
        return None
    results = run_simulated(2, call)
    assert [r[0] for r in results] == [KeyError, KeyError]
    assert results[0][1] == results[1][1] and f"test_trace_errors.py:{line_of('# RANK1-LINE')}" in results[0][1]


@pytest.mark.parametrize("body,marker", [
    (lambda x, n: [x * 2.0 for _ in range(n)][-1], "range"),
    (lambda x, n: x if n else -x, "truth value"),
    (lambda x, n: x + snp.zeros((n,)), "shape"),
])
def test_a_python_int_argument_used_as_a_static_value_names_static_argnums(body, marker):
    with pytest.raises(TypeError, match=r"'n' \(position 1, a Python int\).*static_argnums=1"):
        sr.jit(body, mesh=sr.Mesh((1,), ("x",)))(np.ones(3), 3)
    out = sr.jit(body, mesh=sr.Mesh((1,), ("x",)), static_argnums=1)(np.ones(3), 3)  # the fix works
    assert np.asarray(out).shape == (3,)


def test_gradient_nodes_carry_the_line_of_the_node_they_differentiate():
    def loss(x):
        return snp.sum(snp.tanh(x))  # TANH-LINE
    graph = sr.trace(lambda x: sr.grad(loss)(x), sr.TensorSpec((4,)))
    tanh = next(n for n in graph.nodes if n.op == "tanh")
    after = [n for n in graph.nodes if n.id > tanh.id and n.op in ("mul", "sub")]  # 1 - tanh^2, times g
    assert after and all(n.source == (HERE, line_of("# TANH-LINE")) for n in after), [(n.op, n.source) for n in after]
