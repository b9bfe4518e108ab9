"""scripts/bench_train.py runs end to end: its pipeline report wraps the loop binder (``LoopClock``), which once
lagged ``exec.loops._bound``'s and ``Interpreter.run``'s signatures and broke every pipeline job."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = os.environ.get("MPIEXEC") or shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or \
    shutil.which("mpiexec")
TINY = ["--layers", "2", "--d", "16", "--heads", "2", "--ffn", "32", "--vocab", "32", "--seq", "8", "--batch", "4"]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (scripts/test.sh installs MPICH)")
def test_the_pipeline_preset_reports_its_loop_times():
    """Two stages, two micro-batches: every rank's pipeline loops were timed, and the bubble measured."""
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "scripts", "bench_train.py"),
                          "--preset", "pipeline", "--microbatches", "2", "--steps", "2", "--threads", "1", *TINY],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    pipe = line["pipeline"]
    assert 0 < line["cpu_step_s"]["min"] <= line["cpu_step_s"]["median"]  # the process CPU time per step
    assert pipe["stages"] == 2 and pipe["microbatches"] == 2
    assert len(pipe["pipeline_loop_s_per_step_per_rank"]) == 2 and min(pipe["pipeline_loop_s_per_step_per_rank"]) > 0
    assert all(0 <= b < 1 for b in pipe["bubble_measured_per_rank"])
