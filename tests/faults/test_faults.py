"""Fault injection under real MPI: every fault ends the whole job fast, names the rank and the reason on the
ranks' output, leaves no process behind and never damages the previous checkpoint.

Each case starts its own ``mpiexec`` (the venv's, or $MPIEXEC) on a small script (``prelude.py`` builds a
one-all-reduce program), injects one fault (an exception, a signal from this harness, an early exit,
different inputs, a tampered file) and asserts: exit status non-zero, exit within ``limit`` seconds of the
fault (``FAULT <time>`` printed by the script, or the moment the harness sent the signal), the expected
lines in the output (``-prepend-rank`` attributes each line to its rank), no process of the job left.
Cases run concurrently (they share nothing but the CPUs); ``FAULTS_REPORT=path`` writes the table.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = os.environ.get("MPIEXEC") or shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or \
    shutil.which("mpiexec")
HYDRA = MPIEXEC is not None and "hydra" in subprocess.run([MPIEXEC, "--version"], capture_output=True,
                                                           text=True).stdout.lower()
pytestmark = pytest.mark.skipif(not HYDRA, reason="the fault suite needs MPICH's mpiexec (hydra); "
                                                  "scripts/test.sh installs it")
HANG = 90  # a case still running after this many seconds hangs: it is killed and fails
PARALLEL = int(os.environ.get("SPMD_FAULT_JOBS", "4"))


@dataclass
class Case:
    name: str
    script: str = ""  # after "from prelude import *"; or argv for a CLI case
    expect: list = field(default_factory=list)  # substrings of the output, "[r] ..." lines per rank
    n: int = 2
    env: dict = field(default_factory=dict)
    send: tuple | None = None  # (rank or "mpiexec", signal): sent once every rank wrote its pid file
    limit: float = 10.0
    argv: list | None = None  # a CLI command instead of a script (per-rank MPMD allowed: a list of argv)
    every_rank: str | None = None  # a line every rank must print
    succeeds: bool = False  # not a fault: the job must exit 0 (and no rank may be aborted)
    victim: int | None = None  # the one rank ending without a word: the host's watcher must name it and no other


def one_rank_computes(rank: int) -> str:
    """Every rank reports its pid; ``rank`` computes for a minute while the others wait in the run's agreement."""
    return f"""
        p = program()
        ready()
        if RANK == {rank}:
            time.sleep(60)
        sr.run(p, X)"""


def _cases() -> list[Case]:
    timeout = 3
    stopped_in_all_reduce = ["[0] spmd_runtime: rank 0 waited", "at an MPI collective in instruction %",
                             "= all_reduce(axes=('x',), op=sum)", "ranks that never arrived there: [1]"]
    return [
        Case("exception before a run", """
            p = program()
            if RANK == 1:
                fault("raise before run")
                raise ValueError("user code failed before the run")
            sr.run(p, X)""", ["[1] spmd_runtime: rank 1 of 2 failed with an uncaught ValueError",
                               "user code failed before the run"]),
        Case("exception inside a run", """
            p = program()
            if RANK == 1:
                break_kernel("reduce", FloatingPointError("kernel exploded on purpose"))
            sr.run(p, X)""", ["[1] spmd_runtime: rank 1 failed, aborting the job", "kernel exploded on purpose"]),
        *(Case(f"exception after a run{how}", """
            p = program()
            sr.run(p, X)
            if RANK == 1:
                fault("raise after the run")
                raise RuntimeError("post-processing failed")
            sr.run(p, X)""", ["[1] spmd_runtime: rank 1 of 2 failed with an uncaught RuntimeError",
                               "post-processing failed"], env=env)
          for how, env in (("", {}), (", the guard installed by the first run (no sr.distributed.initialize)",
                                      {"FAULT_GUARD": "lazy"}))),
        Case("raise before the first run, guard left to the runtime", """
            p = program()
            if RANK == 0:
                fault("raise before any use of the runtime")
                raise RuntimeError("setup failed")
            sr.run(p, X)""", ["[1] spmd_runtime: rank 1: not every rank reached the runtime's first use of MPI within "
                              "SPMD_TIMEOUT=3 s", "sr.distributed.initialize()", "setup failed"],
             env={"FAULT_GUARD": "lazy", "SPMD_TIMEOUT": "3"}),
        Case("KeyboardInterrupt inside a run", """
            p = program()
            if RANK == 1:
                break_kernel("reduce", KeyboardInterrupt())
            sr.run(p, X)""", ["[1] spmd_runtime: rank 1 failed, aborting the job", "KeyboardInterrupt"]),
        Case("SIGINT to a rank blocked in MPI", one_rank_computes(1), ["[0] spmd_runtime: rank 0 received SIGINT while waiting at the ranks' agreement"],
             send=(0, signal.SIGINT)),
        Case("SIGINT to a computing rank", one_rank_computes(1), ["[1] spmd_runtime: rank 1 received SIGINT"], send=(1, signal.SIGINT)),
        Case("SIGTERM to a rank", one_rank_computes(1), ["[1] spmd_runtime: rank 1 received SIGTERM"], send=(1, signal.SIGTERM)),
        Case("Ctrl-C (SIGINT) to mpiexec, 4 ranks", one_rank_computes(3), ["received SIGINT"], n=4, send=("mpiexec", signal.SIGINT)),
        Case("SIGSTOP of a rank", """
            p = program()
            if RANK == 1:
                fault("SIGSTOP")
                os.kill(os.getpid(), signal.SIGSTOP)
            sr.run(p, X)""", [f"[0] spmd_runtime: rank 0 waited {timeout}.", "no peer completed it within SPMD_TIMEOUT",
                               "ranks that never arrived there: [1]", "rank 1: no answer"],
             env={"SPMD_TIMEOUT": str(timeout)}, limit=timeout + 5),
        Case("SIGSTOP of a rank inside a run", """
            p = program()
            if RANK == 1:
                stop_kernel("reduce", "SIGSTOP inside the reduce kernel")
            sr.run(p, X)""", stopped_in_all_reduce, env={"SPMD_TIMEOUT": str(timeout)}, limit=timeout + 5),
        Case("SIGSTOP of a rank while the others wait in a persistent all-reduce", """
            p = sr.partition(sr.trace(lambda a: snp.exp(a).reshape((SIZE, 4)).sum(axis=0).sum(),
                                      sr.TensorSpec((4 * SIZE,), "float64")), MESH, in_specs=[("x",)], fuse=False)
            if RANK == 1:  # the all-reduce reduces the first reduce's planned buffer: a persistent request
                stop_kernel("reduce", "SIGSTOP inside the reduce kernel")
            sr.run(p, X)""", stopped_in_all_reduce, env={"SPMD_TIMEOUT": str(timeout)}, limit=timeout + 5),
        Case("SIGSTOP of a rank while a nonblocking all-reduce is in flight", """
            p = sr.partition(sr.trace(lambda a, w: a.sum() + snp.exp(w).sum(), sr.TensorSpec((4 * SIZE,), "float64"),
                                      sr.TensorSpec((4,), "float64")), MESH, in_specs=[("x",), None], fuse=False)
            if RANK == 1:
                stop_kernel("reduce", "SIGSTOP before the all-reduce's start: rank 0 waits at its done")
            sr.run(p, X, np.ones(4))""", ["[0] spmd_runtime: rank 0 waited", "at MPI Wait for the all_reduce over mesh "
                                          "axes ('x',) in instruction %", "= all_reduce_done()",
                                          "ranks that never arrived there: [1]"],
             env={"SPMD_TIMEOUT": str(timeout)}, limit=timeout + 5),
        Case("SIGKILL of a rank", one_rank_computes(1), ["BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "Killed (signal 9)",
                                                          "[0] spmd_runtime (watcher of the ranks on "],
             send=(1, signal.SIGKILL), victim=1),  # the host's watcher names the rank (and pid), the launcher a pid
        # the victim frees a large heap before its files close (the launcher's cue): it finishes exiting after
        # the bystanders the launcher killed, and must still be the one named
        Case("SIGKILL of a rank holding a large heap, 3 ranks", """
            p = program()
            heap = np.ones(100_000_000) if RANK == 1 else None  # 800 MB, every page touched
            ready()
            if RANK == 1:
                time.sleep(60)
            sr.run(p, X)""", ["BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "Killed (signal 9)",
                              "spmd_runtime (watcher of the ranks on "], n=3, send=(1, signal.SIGKILL), victim=1),
        Case("os._exit(3) on a rank without a word", """
            p = program()
            if RANK == 1:
                fault("os._exit(3) before the run")
                os._exit(3)
            sr.run(p, X)""", ["spmd_runtime (watcher of the ranks on ", "it ended before the job's exit barrier"],
             victim=1),
        # the watcher says "exited with status 3 without leaving through Python" when it reads the status before the
        # launcher reaps the rank, else "killed (...), crashed, or called os._exit"; either way it names rank 1 alone
        Case("early exit of a rank (sys.exit(0)), default SPMD_TIMEOUT", """
            p = program()
            if RANK == 1:
                fault("sys.exit(0) before the run")
                sys.exit(0)
            sr.run(p, X)""", ["[0] spmd_runtime: rank 0 waits at the ranks' agreement on 'preparing the run'",
                               "which rank(s) [1] will never join: they exited",
                               "[0]   rank 1: exited: its script ended"]),
        *(Case(f"a rank makes one sr.run call fewer{how}, 4 ranks", """
            p = program()
            sr.run(p, X)
            if RANK == 2:
                fault("rank 2's script returns after one run")
            else:
                sr.run(p, X)""", ["which rank(s) [2] will never join: they exited"], n=4, env=env)
          for how, env in (("", {}), (", the guard installed by the first run", {"FAULT_GUARD": "lazy"}))),
        Case("early exit while rank 0 builds the training step, 3 ranks", """
            cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=3)
            if RANK == 1:
                fault("sys.exit(0) instead of build_train_step_on_root")
                sys.exit(0)
            sr.build_train_step_on_root(cfg, sr.train_mesh((SIZE,), "dp"), "dp", sr.SGD(lr=0.1))""",
             ["waits at the ranks' barrier after tracing and partitioning the training step on rank 0",
              "which rank(s) [1] will never join: they exited"], n=3),
        Case("ranks finish at different times (legal: exit 0)", """
            p = program()
            sr.run(p, X)
            if RANK == 0:
                time.sleep(3)  # the others wait in the next run's agreement meanwhile: they ask, rank 0 answers
            sr.run(p, X)
            if RANK == 1:
                time.sleep(1)  # the others wait at the exit barrier meanwhile""", [], n=4, succeeds=True, limit=30),
        Case("different inputs on one rank", """
            p = program()
            fault("rank 1 passes other values")
            sr.run(p, X + (RANK == 1))""", [],
             every_rank="DifferentValuesError: every rank must pass the same global inputs to sr.run; got different "
                        "contents for 'a': ranks [0] vs [1] (digests "),
        Case("a device_put array differing on one rank, 4 ranks", """
            fault("rank 2 puts other values")
            sr.device_put(X + (RANK == 2), sr.P("x"), MESH)""", [], n=4,
             every_rank="DifferentValuesError: device_put needs the same global array on every rank; got different "
                        "contents for 'x': ranks [0, 1, 3] vs [2] (digests "),
        Case("SPMD_CPU_KERNELS=0 on one rank", """
            if RANK == 1:
                os.environ["SPMD_CPU_KERNELS"] = "0"  # before the runtime's first use, which reads the settings
            p = program()
            fault("rank 1 runs without the C loops")
            sr.run(p, X)""", [],
             every_rank="AgreedError: every rank must run with the same settings (each changes the program, its "
                        "numerics, or which MPI calls its collectives make); got different SPMD_CPU_KERNELS (C loops "
                        "add in another order than NumPy): ranks [0]: True; ranks [1]: False"),
        Case("mesh size mismatch on one rank", """
            p = program(MESH if RANK == 0 else sr.Mesh((SIZE + 1,), ("x",)))
            fault("rank 1 partitioned for 3 devices")
            sr.run(p, X)""", [],
             every_rank="got errors on rank(s) [1]: a program on Mesh(x=3) needs one MPI process per mesh device"),
        Case("unparsable input dtype on one rank", """
            class Odd:
                shape, dtype = X.shape, "no-such-dtype"
            p = program()
            fault("rank 1 passes an unparsable dtype")
            sr.run(p, Odd() if RANK == 1 else X)""", [],
             every_rank="got errors on rank(s) [1]: global input 'a' must be an array of float64[8]; got a Odd"),
        Case("tampered program (hash recomputed)", argv=["tampered"],
             every_rank="could not load the program or inputs: ProgramError: instruction %5 = reduce: attribute 'kind' "
                        "must be one of"),
        Case("edited program (hash not recomputed)", argv=["edited"],
             every_rank="a program file's content must match its hash"),
        Case("truncated program on one rank", argv=["truncated-on-1"],
             every_rank="got errors on rank(s) [1]: could not load the program or inputs: JSONDecodeError"),
        Case("corrupted checkpoint block", """
            p = program()
            blocks = {"a": X[RANK * 4:(RANK + 1) * 4]}
            sr.save_checkpoint(HERE + "/ckpt", blocks, p, step=1)
            MPI.COMM_WORLD.Barrier()
            if RANK == 0:
                raw = bytearray(open(HERE + "/ckpt/a.1.npy", "rb").read())
                raw[-1] ^= 1
                open(HERE + "/ckpt/a.1.npy", "wb").write(bytes(raw))
            MPI.COMM_WORLD.Barrier()
            fault("a flipped byte in block a.1.npy")
            sr.load_checkpoint(HERE + "/ckpt", MESH, {"a": ("x",)})""", [],
             every_rank="CheckpointError: load_checkpoint must succeed on every rank; got errors on rank(s) [1]: "
                        "ValueError: block file a.1.npy of 'a' must match its crc32"),
        Case("symlinked checkpoint block", """
            p = program()
            sr.save_checkpoint(HERE + "/ckpt", {"a": X[RANK * 4:(RANK + 1) * 4]}, p, step=1)
            MPI.COMM_WORLD.Barrier()
            if RANK == 0:
                os.rename(HERE + "/ckpt/a.0.npy", HERE + "/a.0.npy")
                os.symlink(HERE + "/a.0.npy", HERE + "/ckpt/a.0.npy")
            MPI.COMM_WORLD.Barrier()
            fault("block a.0.npy replaced by a symlink")
            sr.load_checkpoint(HERE + "/ckpt", MESH, {"a": ("x",)})""", [],
             every_rank="got errors on rank(s) [0]: ValueError: a block file must be a regular file, not a symlink"),
        Case("save failing on one rank keeps the previous checkpoint", """
            from spmd_runtime import checkpoint
            p = program()
            sr.save_checkpoint(HERE + "/ckpt", {"a": X[RANK * 4:(RANK + 1) * 4]}, p, step=1)
            if RANK == 1:
                def full(path, block):
                    raise OSError("no space left on device (injected)")
                checkpoint._write_npy = full
            fault("rank 1 cannot write its block")
            sr.save_checkpoint(HERE + "/ckpt", {"a": -X[RANK * 4:(RANK + 1) * 4]}, p, step=2)""", [],
             every_rank="got errors on rank(s) [1]: OSError: no space left on device (injected)"),
        Case("trace error on rank 0 in build_train_step_on_root", """
            from spmd_runtime import train
            train.step.lm_loss_and_metrics = lambda cfg, ps, *rest: float(ps[0])  # float() on a traced Tensor
            cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
            fault("rank 0 traces a loss that calls float() on a Tensor")
            train.build_train_step_on_root(cfg, sr.train_mesh((SIZE,), "dp"), "dp", sr.SGD(lr=0.1))""", [],
             every_rank="AgreedError: tracing and partitioning the training step on rank 0 must succeed on every "
                        "rank; got errors on rank(s) [0]: TypeError: float() needs values"),
        Case("SIGKILL of a rank during a checkpoint save", """
            from spmd_runtime import checkpoint
            p = program()
            sr.save_checkpoint(HERE + "/ckpt", {"a": X[RANK * 4:(RANK + 1) * 4]}, p, step=1)
            if RANK == 1:
                def killed(path, block):
                    fault("SIGKILL while writing a block")
                    os.kill(os.getpid(), signal.SIGKILL)
                checkpoint._write_npy = killed
            sr.save_checkpoint(HERE + "/ckpt", {"a": -X[RANK * 4:(RANK + 1) * 4]}, p, step=2)""",
             ["BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "Killed (signal 9)",
              "rank 1 (pid ", "it ended before the job's exit barrier"], victim=1),
        Case("checkpoint of another model config", """
            cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
            mesh = sr.train_mesh((SIZE,), "dp")
            small = sr.build_train_step(cfg, mesh, "dp", sr.SGD(lr=0.1))
            state = small.shard_state(small.init(0), RANK)
            small.save(HERE + "/ckpt", state, step=1)
            other = sr.build_train_step(sr.LMConfig(layers=2, d=8, heads=2, ffn=16, vocab=32, seq=4, batch=2), mesh,
                                        "dp", sr.SGD(lr=0.1))
            fault("load into a model with 2 layers and vocab 32")
            other.load(HERE + "/ckpt")""", ["'params.embed': stored float32[16, 8], the model needs float32[32, 8]",
                                             "'params.layers_wq': stored float32[1, 8, 8], the model needs "
                                             "float32[2, 8, 8]"],
             every_rank="a checkpoint must match the model it is loaded into (pass strict=False for a partial load)"),
    ]


CASES = _cases()


def _cli_setup(kind: str, where: str) -> list:
    """Files for a CLI case; returns the mpiexec arguments after -n N (per rank for MPMD)."""
    sys.path.insert(0, ROOT)
    import spmd_runtime as sr
    import spmd_runtime.numpy as snp
    graph = sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((8,), "float64"))
    good = os.path.join(where, "p.json")
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x",)], fuse=False).save(good)  # %5 = reduce
    np.savez(os.path.join(where, "in.npz"), a=np.arange(8.0))
    bad = os.path.join(where, "bad.json")
    doc = json.load(open(good))
    if kind == "tampered":  # an attribute the op does not have, hash recomputed: passes the integrity check
        ins = next(i for i in doc["instrs"] if i["op"] == "reduce")
        ins["attrs"]["kind"] = "__import__"
        body = {k: doc[k] for k in ("mesh", "inputs", "outputs", "instrs", "notes")}
        import hashlib
        doc["hash"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        json.dump(doc, open(bad, "w"))
    elif kind == "edited":
        next(i for i in doc["instrs"] if i["op"] == "reduce")["attrs"]["kind"] = "max"
        json.dump(doc, open(bad, "w"))
    else:
        open(bad, "w").write(open(good).read()[:200])
    run = [sys.executable, os.path.join(HERE, "cli.py"), "run"]  # python -m spmd_runtime run, after the imports
    tail = ["--inputs", os.path.join(where, "in.npz"), "--out", os.path.join(where, "out.npz")]
    if kind == "truncated-on-1":
        return ["-n", "1", *run, good, *tail, ":", "-n", "1", *run, bad, *tail]
    return ["-n", "2", *run, bad, *tail]


def _launch(case: Case, where: str) -> dict:
    env = dict(os.environ, FAULT_DIR=where, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **case.env)
    if case.argv is not None:
        args = _cli_setup(case.argv[0], where)
    else:
        script = os.path.join(where, "case.py")
        with open(script, "w") as f:
            f.write("from prelude import *\n" + textwrap.dedent(case.script).strip() + "\ndone()\n")
        args = ["-n", str(case.n), sys.executable, script]
    start = time.time()
    proc = subprocess.Popen([MPIEXEC, "-prepend-rank", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=where, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    fault_at = _inject(case, where, proc) if case.send else None
    try:
        rc = proc.wait(timeout=HANG)
    except subprocess.TimeoutExpired:
        rc = None
    end = time.time()
    reader.join(timeout=5)
    orphans = _leftovers(proc.pid, where)
    for pid in orphans:  # clean up after a failing case; the assertion below reports them
        _kill(pid)
    if rc is None:
        _kill(proc.pid)
    marks = [float(line.split()[2]) for line in lines if line.split()[1:2] == ["FAULT"]]
    fault_at = fault_at or (min(marks) if marks else start)
    return {"rc": rc, "seconds": end - fault_at, "output": "".join(lines), "orphans": orphans, "where": where}


def _inject(case: Case, where: str, proc) -> float | None:
    """Wait for every rank's pid file, let the others block in MPI, then send the signal."""
    target, sig = case.send
    deadline = time.time() + HANG / 2
    pids = [os.path.join(where, f"pid.{r}") for r in range(case.n)]
    while not all(os.path.exists(p) and open(p).read() for p in pids):
        if time.time() > deadline or proc.poll() is not None:
            return None
        time.sleep(0.05)
    time.sleep(1.0)  # the ranks that go on are now blocked in the run's first agreement
    pid = proc.pid if target == "mpiexec" else int(open(pids[target]).read())
    at = time.time()
    os.kill(pid, sig)
    return at


def _leftovers(session: int, where: str) -> list[int]:
    """Processes of the job still alive a moment after mpiexec returned: of its session, or (a host's
    watcher has a session of its own) with the case's FAULT_DIR in their environment."""
    for _ in range(20):
        out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout
        alive = [int(p) for p, s, st in (line.split() for line in out.splitlines())
                 if (int(s) == session or _runs_in(int(p), where)) and not st.startswith("Z")]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _runs_in(pid: int, where: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"FAULT_DIR={where}\0".encode() in f.read()
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cases(cases: list[Case], directory) -> dict:
    """Run ``cases`` concurrently, each in ``directory(case)``; returns name -> _launch's result
    (also used by scripts/fault_table.py)."""
    longest_first = sorted(cases, key=lambda c: -(3 * c.succeeds + 2 * (c.argv is not None) + (c.limit > 10)))
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {c.name: pool.submit(_launch, c, directory(c)) for c in longest_first}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case, run concurrently (each is its own mpiexec job in its own directory)."""
    got = run_cases(CASES, lambda case: str(tmp_path_factory.mktemp("fault")))
    if os.environ.get("FAULTS_REPORT"):
        with open(os.environ["FAULTS_REPORT"], "w") as f:
            json.dump(got, f, indent=1)
    return got


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_ends_the_job_fast_naming_rank_and_reason(case, results):
    r = results[case.name]
    out = r["output"]
    assert r["rc"] is not None, f"the job hung (killed after {HANG} s):\n{out}"
    if case.succeeds:
        assert r["rc"] == 0 and "abort" not in out.lower(), f"this job must succeed; got status {r['rc']}:\n{out}"
        assert not r["orphans"], f"processes of the job left behind: {r['orphans']}"
        return
    assert r["rc"] != 0, f"a fault must end the job with a non-zero status; got 0:\n{out}"
    assert r["seconds"] < case.limit, f"the job must end within {case.limit} s of the fault; took {r['seconds']:.1f}"
    assert not r["orphans"], f"processes of the job left behind: {r['orphans']}"
    for text in case.expect:
        assert text in out, f"expected {text!r} in the output:\n{out}"
    if case.send and case.send[1] == signal.SIGKILL:
        rank, pid = case.send[0], open(os.path.join(r["where"], f"pid.{case.send[0]}")).read()
        # "killed by signal SIGKILL" when the watcher reads it before the launcher reaps the rank, else "killed (...)"
        assert f"rank {rank} (pid {pid}): killed" in out and "ended before the job's exit barrier" in out, \
            f"the host's watcher must name the killed rank:\n{out}"
    if case.victim is not None:  # the bystanders the launcher killed after it are not named, nor "killed"
        assert _named_by_the_watcher(out) == [case.victim] and "together with others" not in out, \
            f"the host's watcher must name rank {case.victim} only:\n{out}"
    else:
        assert "watcher of the ranks" not in out, f"a rank that says why it ends needs no watcher's report:\n{out}"
    if case.every_rank:
        for rank in range(case.n):  # each rank's own line (hydra may glue another rank's partial line in front)
            assert re.search(rf"\[{rank}\] spmd_runtime: rank {rank}: [^\n]*{re.escape(case.every_rank)}", out), \
                f"rank {rank} must print {case.every_rank!r}:\n{out}"
        assert "Traceback" not in out, f"an agreed error prints one line per rank, no traceback:\n{out}"


def _named_by_the_watcher(out: str) -> list[int]:
    """The ranks the hosts' watchers name in ``out``, in order."""
    return [int(rank) for line in out.splitlines() if "watcher of the ranks on" in line
            for rank in re.findall(r"rank (\d+) \(pid \d+\)", line)]


@pytest.mark.parametrize("name", ["save failing on one rank keeps the previous checkpoint",
                                  "SIGKILL of a rank during a checkpoint save"])
def test_failed_save_leaves_the_previous_checkpoint_intact(results, name):
    r = results[name]
    sys.path.insert(0, ROOT)
    from spmd_runtime.checkpoint import checkpoint_info
    ckpt = os.path.join(r["where"], "ckpt")
    assert checkpoint_info(ckpt)["step"] == 1
    blocks = [np.load(os.path.join(ckpt, f"a.{i}.npy")) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(blocks), np.arange(8.0))  # step 1's values, not step 2's
    if "SIGKILL" not in name:  # a killed rank cleans up nothing; its staging directory is all it leaves
        assert sorted(os.listdir(r["where"])) == sorted(["case.py", "ckpt"]), "no temporary directory left behind"
