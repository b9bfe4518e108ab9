"""Imported by every fault script (run under mpiexec): a small program, this rank, and markers for the harness.

It calls ``sr.distributed.initialize()``, so each script is guarded from its start (a fault before the first run
ends the job too); a case with ``FAULT_GUARD=lazy`` leaves the guard to the runtime's first use of MPI."""
import os
import signal  # noqa: F401 - used by the scripts
import sys
import time

import numpy as np
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp

if os.environ.get("FAULT_GUARD") != "lazy":
    sr.distributed.initialize()
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
HERE = os.environ["FAULT_DIR"]
MESH = sr.Mesh((SIZE,), ("x",))
X = np.arange(4.0 * SIZE)


def program(mesh=MESH):
    """sum(exp(x) * 2) with x split over the mesh: one all-reduce."""
    return sr.partition(sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((4 * SIZE,), "float64")), mesh,
                        in_specs=[("x",)], fuse=False)  # unfused: a case may patch one op's kernel


def fault(what: str) -> None:
    """Tell the harness the fault happens now (exit times are measured from here)."""
    _say(f"FAULT {time.time():.3f} rank {RANK}: {what}")


def ready() -> None:
    """Tell the harness this rank's pid, so it can signal it."""
    _say(f"rank {RANK} has pid {os.getpid()}")
    with open(os.path.join(HERE, f"pid.{RANK}"), "w") as f:
        f.write(str(os.getpid()))


def break_kernel(op: str, exc: BaseException) -> None:
    """Make this rank's ``op`` kernel raise ``exc`` (a fault inside a run)."""
    def broken(xp, *args, **kwargs):
        fault(f"{op} kernel raises {type(exc).__name__}")
        raise exc
    replace_kernel(op, broken)


def stop_kernel(op: str, what: str) -> None:
    """Make this rank's ``op`` kernel stop the process (SIGSTOP): the peers wait at the next collective."""
    def stop(xp, *args, **kwargs):
        fault(what)
        os.kill(os.getpid(), signal.SIGSTOP)
    replace_kernel(op, stop)


def replace_kernel(op: str, fn) -> None:
    from spmd_runtime import opdef
    opdef.lookup(op).kernel = fn


def done() -> None:
    _say(f"rank {RANK} finished")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the launcher prefixes the rank per chunk
    sys.stdout.flush()
