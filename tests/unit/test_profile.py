"""Profiles: one Chrome trace per rank with a span per instruction, merged and summarised."""
import json

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

MESH = sr.Mesh((2, 2), ("data", "model"))


def mlp(x, w1, w2):
    x = sr.mesh_split(x, MESH, sr.P("data"))
    w1 = sr.mesh_split(w1, MESH, sr.P(None, "model"))
    w2 = sr.mesh_split(w2, MESH, sr.P("model"))
    return snp.maximum(x @ w1, 0.0) @ w2


def test_run_profile_writes_one_trace_per_rank_with_a_span_per_instruction(tmp_path):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in ((8, 6), (6, 12), (12, 6))]
    program = sr.partition(sr.trace(mlp, *args), MESH)
    run_simulated(MESH.size, lambda comm: [sr.run(program, *args, comm=comm, profile=tmp_path) for _ in range(2)])
    body = [i for i in program.instrs if i.op != "parameter"]
    for rank in range(MESH.size):
        doc = json.loads((tmp_path / f"rank{rank}.trace.json").read_text())
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        steps = [e for e in spans if e["cat"] in ("compute", "comm")]
        assert [e["name"] for e in steps] == [i.op for i in body] * 2
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in spans)
        assert [e["args"]["bytes"] for e in steps[:len(body)]] == [i.nbytes for i in body]
        comm = [e["args"] for e in steps[:len(body)] if e["cat"] == "comm"]
        assert [(tuple(a["group"]), a["wire_bytes"]) for a in comm] == \
            [(c["axes"], c["wire_bytes"]) for c in program.comm_summary()]
        assert sum(1 for e in spans if e["cat"] == "run") == 2
    text = sr.profile.summarize(tmp_path)
    merged = json.loads((tmp_path / "merged.trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == set(range(MESH.size))
    assert "einsum" in text and "MPI %" in text and len(text.splitlines()) >= 2 + 1 + MESH.size


def test_no_profile_no_files_and_env_variable(tmp_path, monkeypatch):
    program = sr.partition(sr.trace(lambda x: x * 2.0, sr.TensorSpec((4,))), sr.Mesh((1,), ("x",)))
    run_simulated(1, lambda comm: sr.run(program, np.ones(4, "float32"), comm=comm))
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("SPMD_PROFILE", str(tmp_path / "env"))
    run_simulated(1, lambda comm: sr.run(program, np.ones(4, "float32"), comm=comm))
    assert (tmp_path / "env" / "rank0.trace.json").exists()
