"""The measured cost model: profiles change the partitioner's choices, comm_summary predicts seconds,
calibrate measures every collective per group size (simulated world here, real MPI in tests/mpi)."""
import json

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.calibrate import KINDS, _fit_line, calibrate, write_profile
from spmd_runtime.comm import run_simulated
from spmd_runtime.cost import CostModel

MESH = sr.Mesh((2, 4), ("x", "y"))
FAST = 1e-6  # alpha of the collectives a test profile leaves cheap


def profile(slow: dict, ks=(2, 4, 8)) -> CostModel:
    """Every collective at alpha FAST, beta 1 ns/B, except ``slow`` {kind: alpha seconds}."""
    return CostModel("test", tuple((op, k, slow.get(op, FAST), 1e-9) for op in KINDS for k in ks))


def run_on_mesh(program, mesh, *args):
    from spmd_runtime.exec.runner import shard

    def body(comm):
        r = comm.Get_rank()
        local = [shard(a, s.sharding, mesh, r) for a, s in zip(args, program.inputs)]
        return sr.run_local(program, *local, comm=comm)[0]
    return run_simulated(mesh.size, body)


def test_resharding_plan_flips_with_the_profile():
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    graph = sr.trace(lambda a: a * 1.0, x)
    kinds = {}
    for name, model in [("ring", None), ("slow point-to-point", profile({"collective_permute": 1.0}))]:
        p = sr.partition(graph, MESH, in_specs=[("x", "y")], out_specs=[("y", "x")], cost_profile=model)
        kinds[name] = p.collectives()
        from spmd_runtime.exec.runner import shard
        for r, out in enumerate(run_on_mesh(p, MESH, x)):
            np.testing.assert_array_equal(out, shard(x, p.outputs[0].sharding, MESH, r))
    assert kinds["ring"] == ["all_to_allv"]  # 2048 B: the fewest bytes
    assert "all_to_allv" not in kinds["slow point-to-point"]  # its k - 1 rounds of a 1 s permute
    assert set(kinds["slow point-to-point"]) <= {"all_to_all", "all_gather"}


def test_einsum_strategy_flips_with_the_profile():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 256)).astype(np.float32), rng.standard_normal((256, 16)).astype(np.float32)
    graph = sr.trace(lambda p, q: p @ q, a, b)
    mesh = sr.Mesh((8,), ("x",))
    chosen = {}
    for name, model in [("ring", None), ("slow all-reduce", profile({"all_reduce": 1.0}))]:
        p = sr.partition(graph, mesh, in_specs=[(None, "x"), ("x", None)], out_specs=[(None, None)],
                         cost_profile=model)
        chosen[name] = p.collectives()
        for out in run_on_mesh(p, mesh, a, b):
            np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
    assert chosen["ring"] == ["all_reduce"]  # 2 * 7/8 * 1 KiB, less than gathering 2 x 16 KiB
    assert chosen["slow all-reduce"] == ["all_gather", "all_gather"]


def test_comm_summary_predicts_seconds_from_the_profile():
    graph = sr.trace(lambda a: a * 1.0, sr.TensorSpec((8, 8), "float32"))
    model = CostModel("test", (("all_gather", 2, 1e-3, 2e-9),))
    p = sr.partition(graph, MESH, in_specs=[("x", None)], out_specs=[(None, None)], cost_profile=model)
    (c,) = p.comm_summary()
    assert (c["kind"], c["wire_bytes"]) == ("all_gather", 128)  # 1/2 * 8x8x4 B
    assert c["predicted_s"] == pytest.approx(1e-3 + 2e-9 * 128)
    default = sr.partition(graph, MESH, in_specs=[("x", None)], out_specs=[(None, None)])
    assert default.comm_summary()[0]["predicted_s"] == pytest.approx(128 * 1e-10)  # the default 10 GB/s link


def test_profile_file_and_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    doc = {"format": "spmd_runtime.cost_profile", "version": 1, "world_size": 8,
           "fits": [{"op": "all_gather", "k": 2, "alpha": 5e-4, "beta": 0.0}]}
    path.write_text(json.dumps(doc))
    graph = sr.trace(lambda a: a * 1.0, sr.TensorSpec((8, 8), "float32"))
    monkeypatch.setenv("SPMD_COST_PROFILE", str(path))
    p = sr.partition(graph, MESH, in_specs=[("x", None)], out_specs=[(None, None)])
    assert p.comm_summary()[0]["predicted_s"] == pytest.approx(5e-4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fits": []}))
    with pytest.raises(ValueError, match="format 'spmd_runtime.cost_profile'.*calibrate"):
        sr.partition(graph, MESH, cost_profile=str(bad))


def test_nearest_group_size_is_used_when_one_was_not_measured():
    model = CostModel("test", (("all_reduce", 2, 1.0, 0.0), ("all_reduce", 8, 3.0, 0.0)))
    assert model.seconds("all_reduce", 3, 100, 100) == 1.0  # 3/2 is nearer than 8/3
    assert model.seconds("all_reduce", 6, 100, 100) == 3.0
    assert model.seconds("all_gather", 2, 100, 200) == pytest.approx(100 * 1e-10)  # unmeasured: default link


def test_fit_recovers_a_line():
    points = [(w, 2e-5 + 3e-9 * w) for w in (1e3, 1e4, 1e5, 1e6)]
    alpha, beta = _fit_line(points)
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(3e-9)


def test_calibrate_measures_every_collective_per_group_size(tmp_path):
    docs = run_simulated(4, lambda comm: calibrate(comm, sizes=(256, 4096), repeats=2))
    doc = docs[0]
    assert [(f["op"], f["k"]) for f in doc["fits"]] == [(op, k) for k in (2, 4) for op in KINDS]
    assert all(f["alpha"] >= 0 and f["beta"] >= 0 for f in doc["fits"])
    assert all(d["fits"] == doc["fits"] for d in docs)  # every rank holds the same profile
    model = write_profile(doc, tmp_path / "p.json")
    assert len(model.fits) == 2 * len(KINDS)
