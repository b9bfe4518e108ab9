"""``import spmd_runtime`` under mpiexec changes nothing in the process; ``sr.distributed.initialize()`` then
installs the job guard (comm/jobguard.py), once.

One ``mpiexec -n 2`` job on a script: each rank in turn imports the package while the other waits in a barrier on
a communicator made before the import, so an import that made a communicator of the world (collective: it needs
the waiting rank) would block and the job would hang; after its import a rank finds no signal handler, no
excepthook, no wakeup fd, no thread, no atexit callback and no child process (the host's watcher) of the
package's. Then both ranks initialize: all of these appear, and a second call adds none.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from test_faults import HYDRA, MPIEXEC, ROOT

pytestmark = pytest.mark.skipif(not HYDRA, reason="the fault suite needs MPICH's mpiexec (hydra); "
                                                  "scripts/test.sh installs it")

SCRIPT = textwrap.dedent('''
    import atexit, os, signal, sys, threading
    import numpy  # noqa: F401 - its BLAS threads, if any, are not the package's
    from mpi4py import MPI

    RANK = MPI.COMM_WORLD.Get_rank()
    side = MPI.COMM_WORLD.Dup()  # the other rank waits on this one while a rank imports the package
    tasks, callbacks = len(os.listdir("/proc/self/task")), atexit._ncallbacks()


    def children() -> bool:
        try:
            return os.waitpid(-1, os.WNOHANG) is not None
        except ChildProcessError:
            return False


    def state() -> dict:
        wakeup = signal.set_wakeup_fd(-1)
        if wakeup != -1:
            signal.set_wakeup_fd(wakeup)
        return {"excepthook": sys.excepthook is not sys.__excepthook__,
                "SIGINT": signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                "SIGTERM": signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL,
                "wakeup fd": wakeup != -1,
                "threads": threading.enumerate() != [threading.main_thread()]
                           or len(os.listdir("/proc/self/task")) != tasks,
                "atexit": atexit._ncallbacks() != callbacks,
                "child process": children()}


    for turn in range(2):
        if turn == RANK:
            import spmd_runtime as sr
            changed = [k for k, v in state().items() if v]
            assert not changed and not sr.distributed.is_initialized(), f"import changed {changed}"
            print(f"rank {RANK}: the import installed nothing", flush=True)
        side.Barrier()
    side.Free()
    sr.distributed.initialize()
    installed = state()
    installed.pop("child process")  # only the lowest rank of a host starts the watcher
    assert all(installed.values()) and sr.distributed.is_initialized(), installed
    threads = threading.active_count()
    sr.distributed.initialize()
    assert threading.active_count() == threads and atexit._ncallbacks() == callbacks + 1
    print(f"rank {RANK}: initialize() installed the guard once", flush=True)
''')


def test_import_installs_nothing_and_initialize_installs_the_guard(tmp_path):
    script = tmp_path / "import_case.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([MPIEXEC, "-prepend-rank", "-n", "2", sys.executable, str(script)], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the job hung (an import that makes a communicator blocks until the other rank joins):\n{out}")
    assert proc.returncode == 0, f"the job failed with status {proc.returncode}:\n{out}"
    for rank in range(2):
        for line in ("the import installed nothing", "initialize() installed the guard once"):
            assert f"[{rank}] rank {rank}: {line}" in out, f"rank {rank} must print {line!r}:\n{out}"
