"""The CLI with per-rank sharded input/output directories, and `profile DIR`."""
import subprocess
import sys

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from tests.unit.test_cli_mpiexec import ROOT, mpiexec, pytestmark  # noqa: F401 - skipped without mpiexec


def test_cli_run_from_a_sharded_directory_and_profile(tmp_path):
    mesh = sr.Mesh((2,), ("x",))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((7, 4)).astype("float32"), rng.standard_normal((4, 3)).astype("float32")
    graph = sr.trace(lambda x, w: snp.tanh(x @ w), x, w)
    program = sr.partition(graph, mesh, in_specs=[sr.P("x"), sr.P()], out_specs=[sr.P("x")])
    program.save(tmp_path / "p.json")

    def save(comm):  # each rank writes only its own rows: no file holds the whole of x
        d = sr.device_put(x, sr.P("x"), mesh, comm=comm)
        sr.save_checkpoint(tmp_path / "in", {"x": d.local, "w": w}, program, comm=comm)
    run_simulated(2, save)
    r = mpiexec(2, "-m", "spmd_runtime", "run", str(tmp_path / "p.json"), "--inputs", str(tmp_path / "in"),
                "--out", str(tmp_path / "out"), "--profile", str(tmp_path / "prof"))
    assert r.returncode == 0, r.stderr
    info = sr.checkpoint_info(tmp_path / "out")["tensors"]["out0"]
    assert len(info["blocks"]) == 2  # one block per rank, never gathered
    out = sr.load_checkpoint(tmp_path / "out", sr.Mesh((1,), ("x",)))["out0"]
    np.testing.assert_allclose(out, np.tanh(x @ w), rtol=1e-5)

    r = mpiexec(2, "-m", "spmd_runtime", "run", str(tmp_path / "p.json"), "--inputs", str(tmp_path / "in"),
                "--out", str(tmp_path / "out.npz"))
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "out.npz") as f:
        np.testing.assert_allclose(f["out0"], np.tanh(x @ w), rtol=1e-5)

    r = subprocess.run([sys.executable, "-m", "spmd_runtime", "profile", str(tmp_path / "prof")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "profile of 2 rank(s)" in r.stdout and "einsum" in r.stdout and "MPI ms" in r.stdout
