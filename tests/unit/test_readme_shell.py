"""README shell blocks, executed as written where that is practical: in a temp dir, with the placeholders
(PROGRAM.json, in.npz, IN_DIR, ...) made here and small settings (2 ranks where the README says 8).

Lines that cannot run in the suite, and why (``NOT_RUN``; test_readme.py checks that every block is covered):
- ``scripts/demo.sh``: the full demo is three 8-rank jobs of minutes and a 2-rank GPT-2 one;
  ``test_demo_train_runs_small`` runs its training script at 2 ranks with a tiny model instead (the demo's other
  parts: demo_transformer is the quick-start layer, the MoE run is tests/unit/test_moe.py), and
  ``test_demo_gpt2_runs_small`` its GPT-2 script small.
- ``scripts/test.sh``: it is the suite this test runs in (CI runs it).
- ``module load``, ``python3 -m venv``, the two ``pip install`` lines: a site MPI, a fresh venv and the
  network; the block's last line (which MPI mpi4py uses) runs.
- ``scripts/launch.sh -n 16 --ranks-per-node 4 --hostfile hosts``: a cluster; it runs with ``--dry-run``,
  which prints the launcher command it would run.
"""
import os
import re
import subprocess
import sys

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from tests.unit.test_cli_mpiexec import MPIEXEC, ROOT, pytestmark  # noqa: F401 - skipped without mpiexec
from tests.unit.test_readme import BLOCKS

NOT_RUN = {"scripts/demo.sh", "scripts/test.sh", "module load openmpi", "python3 -m venv .venv",
           "MPICC=$(which mpicc) pip install", "pip install -e '.[test,bf16,digest,weights]'",
           "scripts/emulate_cluster.sh"}  # needs root: tests/faults/test_cluster.py and test.sh's cluster stage


def block(first: str) -> list[str]:
    """The commands of the README bash block starting with ``first`` (continuation lines joined, comments cut)."""
    code = next(c for kind, c in BLOCKS if kind == "bash" and c.startswith(first))
    joined = code.replace("\\\n", " ")
    return [line.split("   #")[0].split("  # ")[0].strip() for line in joined.splitlines() if line.strip()]


def run(command: str, cwd, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PATH=os.path.dirname(MPIEXEC) + os.pathsep + os.path.dirname(sys.executable) + os.pathsep +
               os.environ["PATH"])
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_every_shell_line_runs_here_or_is_listed_as_not_run():
    for kind, code in BLOCKS:
        if kind == "bash":
            for line in code.replace("\\\n", " ").splitlines():
                covered = any(line.startswith(k) for k in NOT_RUN) or line.startswith(RUN_PREFIXES)
                assert covered, f"a README shell line neither run nor listed in NOT_RUN: {line}"


RUN_PREFIXES = ("scripts/launch.sh", "python -m spmd_runtime", "mpiexec -n 8 python -m spmd_runtime",
                "python -c 'from mpi4py import MPI")


def test_cli_block_runs_as_written_on_a_saved_program(tmp_path):
    mesh = sr.Mesh((2,), ("x",))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 4)), rng.standard_normal((4, 3))
    graph = sr.trace(lambda x, w: snp.tanh(x @ w), x, w)
    program = sr.partition(graph, mesh, in_specs=[sr.P("x"), sr.P()], out_specs=[sr.P("x")])
    program.save(tmp_path / "PROGRAM.json")
    np.savez(tmp_path / "in.npz", x=x, w=w)
    run_simulated(2, lambda comm: sr.save_checkpoint(
        tmp_path / "IN_DIR", {"x": sr.device_put(x, sr.P("x"), mesh, comm=comm).local, "w": w}, program, comm=comm))
    for command in block("python -m spmd_runtime show"):
        command = command.replace("mpiexec -n 8", "mpiexec -n 2").replace(" [--backend numpy|cupy]", "")
        r = run(command, tmp_path)
        assert r.returncode == 0, (command, r.stderr[-2000:])
        if " show " in command:
            assert "einsum" in r.stdout and "total wire bytes per rank" in r.stdout
        if " profile " in command:
            assert "profile of 2 rank(s)" in r.stdout and "MPI ms" in r.stdout
    want = np.tanh(x @ w)
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["out0"], want, rtol=1e-12)
    np.testing.assert_allclose(sr.load_checkpoint(tmp_path / "OUT_DIR", sr.Mesh((1,), ("x",)))["out0"], want,
                               rtol=1e-12)


def test_launcher_block_dry_runs(tmp_path):
    (tmp_path / "hosts").write_text("node1\nnode2\nnode3\nnode4\n")
    commands = block("scripts/launch.sh -n 16")
    assert len(commands) == 2
    for command in commands:
        if "--dry-run" not in command:
            command = command.replace("scripts/launch.sh", "scripts/launch.sh --dry-run", 1)
        r = run(command.replace("scripts/launch.sh", os.path.join(ROOT, "scripts", "launch.sh"), 1), tmp_path)
        assert r.returncode == 0, (command, r.stderr)
        printed = r.stdout.strip().splitlines()[-1]
        assert re.search(r"\b16\b", printed) and "python -m spmd_runtime run prog.py" in printed, printed
        if "--hostfile" in command:
            assert "hosts" in printed and "4" in printed


def test_which_mpi_line_runs():
    (command,) = [c for c in block("module load openmpi") if c.startswith("python -c")]
    r = run(command, ROOT)
    assert r.returncode == 0 and "MPICH" in r.stdout or "Open MPI" in r.stdout, r.stdout + r.stderr


def test_demo_train_runs_small(tmp_path):
    """scripts/demo.sh's training job at small settings (the full demo: minutes at 8 ranks): it must train,
    agree with the 1-process reference, reload its checkpoint on another mesh and sample, exiting 0."""
    r = run(f"mpiexec -n 2 python {ROOT}/scripts/demo_train.py --mesh 1,2 --steps 2 --log-every 1 --check-steps 1 "
            f"--layers 1 --d 16 --heads 2 --ffn 32 --seq 8 --batch 2 --reload-mesh 2 --reload-preset wus "
            f"--out {tmp_path}", tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "-> OK" in r.stdout and "sample (temperature" in r.stdout


def test_demo_gpt2_runs_small(tmp_path):
    """scripts/demo.sh's GPT-2 job (the model zoo through train.Model and fit) at small settings: token files, fit
    with evaluation and checkpoints, greedy decoding; run twice, the second resumes from the checkpoint."""
    command = (f"mpiexec -n 2 python {ROOT}/scripts/demo_gpt2.py --mesh 1,2 --steps 4 --eval-every 2 --eval-steps 1 "
               f"--checkpoint-every 2 --layers 1 --heads 2 --d 16 --seq 16 --batch 4 --new-tokens 3 --out {tmp_path}")
    r = run(command, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "-> OK" in r.stdout and "greedy decode with a KV cache (3 tokens" in r.stdout, r.stdout[-2000:]
    again = run(command.replace("--steps 4", "--steps 5"), tmp_path, timeout=300)
    assert again.returncode == 0 and "resumed from" in again.stdout and "fit: steps 5..5" in again.stdout, \
        again.stdout[-2000:] + again.stderr[-2000:]
