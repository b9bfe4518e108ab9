"""Whole jobs under mpiexec: the CLI, and a failure on one rank ending the job instead of hanging it."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = os.environ.get("MPIEXEC") or shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or \
    shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (scripts/test.sh installs MPICH)")


def mpiexec(n, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_cli_run_matches_reference(tmp_path):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((8, 12)), rng.standard_normal((12, 6))
    graph = sr.trace(lambda x, w: snp.exp(x @ w * 0.1).sum(axis=0), x, w)
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), None]).save(tmp_path / "p.json")
    np.savez(tmp_path / "in.npz", x=x, w=w)
    r = mpiexec(2, "-m", "spmd_runtime", "run", str(tmp_path / "p.json"), "--inputs", str(tmp_path / "in.npz"),
                "--out", str(tmp_path / "out.npz"))
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["out0"], sr.evaluate(graph, x, w)[0], rtol=1e-12)


def test_cli_runs_a_saved_loop_program(tmp_path):
    rng = np.random.default_rng(4)
    h, ws = rng.standard_normal((5, 6)), 0.5 * rng.standard_normal((4, 6, 6))
    graph = sr.trace(lambda h, ws: sr.scan(lambda c, w: (snp.tanh(c @ w), snp.sum(c)), h, ws), h, ws)
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), (None, None, "x")]).save(tmp_path / "p.json")
    np.savez(tmp_path / "in.npz", h=h, ws=ws)
    r = mpiexec(2, "-m", "spmd_runtime", "run", str(tmp_path / "p.json"), "--inputs", str(tmp_path / "in.npz"),
                "--out", str(tmp_path / "out.npz"))
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "out.npz") as out:
        for k, want in enumerate(sr.evaluate(graph, h, ws)):
            np.testing.assert_allclose(out[f"out{k}"], want, rtol=1e-12)


def test_cli_show_prints_listing_and_comm_summary(tmp_path):
    graph = sr.trace(lambda x: x.sum(axis=0), sr.TensorSpec((8, 4), "float64"))
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None)]).save(tmp_path / "p.json")
    r = subprocess.run([sys.executable, "-m", "spmd_runtime", "show", str(tmp_path / "p.json")], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert "all_reduce" in r.stdout and "total wire bytes per rank: 32" in r.stdout


def test_cli_missing_input_key_ends_the_job_with_the_rule(tmp_path):
    graph = sr.trace(lambda x: x * 2.0, sr.TensorSpec((4,), "float64"))
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x",)]).save(tmp_path / "p.json")
    np.savez(tmp_path / "in.npz", y=np.ones(4))
    r = mpiexec(2, "-m", "spmd_runtime", "run", str(tmp_path / "p.json"), "--inputs", str(tmp_path / "in.npz"),
                "--out", str(tmp_path / "out.npz"))
    assert r.returncode != 0
    assert "needs one array per program input ['x']" in r.stderr


def test_failure_on_one_rank_mid_run_aborts_the_whole_job(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from mpi4py import MPI
        import spmd_runtime as sr
        from spmd_runtime.opdef import OPS
        mesh = sr.Mesh((3,), ("x",))
        program = sr.partition(sr.trace(lambda a: (a * 2.0).sum(), sr.TensorSpec((6,), "float64")), mesh, in_specs=[("x",)],
                               fuse=False)  # the local sum stays its own kernel, broken below (a mul may run as a ufunc)
        if MPI.COMM_WORLD.Get_rank() == 1:
            def broken(xp, *args, **kwargs):
                raise FloatingPointError("kernel exploded on purpose")
            OPS["reduce"].kernel = broken
        sr.run(program, np.ones(6))  # ranks 0 and 2 wait in the all-reduce: the abort must end them
        print("unreachable")
    """))
    r = mpiexec(3, str(script), timeout=60)
    assert r.returncode != 0
    assert "rank 1 failed, aborting the job" in r.stderr and "kernel exploded on purpose" in r.stderr
    assert "unreachable" not in r.stdout
