"""Job-wide fault handling under MPI: a fault on one rank ends the whole job, with that rank named.

Importing ``spmd_runtime`` installs nothing. ``install()`` runs once per process, on every rank alike (it is
collective over the world), at ``sr.distributed.initialize()`` or else at the runtime's first use of MPI
(``communicator.world()``: the first run, jit call, distributed array, checkpoint or CLI command); in an MPI
job of more than one process (``SPMD_ABORT_ON_ERROR=0`` opts out) it installs, like ``python -m mpi4py``:

- ``sys.excepthook``: an uncaught exception (any ``BaseException`` that
  reaches it, KeyboardInterrupt included) prints the traceback with the rank
  and calls ``MPI.COMM_WORLD.Abort(1)``. An ``AgreedError`` was raised alike on
  every rank after the ranks agreed: it prints one line and the rank exits with
  status 1 the normal way (no abort, no second traceback).
- SIGINT and SIGTERM abort the whole job, also while the rank is blocked
  inside an MPI call (``signal.set_wakeup_fd`` wakes the watchdog thread).
- the watchdog thread (``watchdog.py``): a rank blocked in a collective that an
  exited peer will never join aborts the job within seconds, naming that peer;
  ``SPMD_TIMEOUT`` bounds any other wait.
- a watcher process per host (``deathwatch.py``) names a rank that ends
  without a word (SIGKILL, the OOM killer, a crash in C code).
- ``atexit`` (before MPI_Finalize): the watchdog's exit barrier (a rank whose
  script ended answers "exited" while it waits for the others), then the
  watchdog stops with no control message left in flight, and the watcher is
  told the job ends normally.

A fault before the guard is installed (an exception raised, or a rank that exits, before the first run) is
not caught: a script calls ``sr.distributed.initialize()`` first thing to be guarded from its start.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
import traceback

from spmd_runtime.comm import deathwatch, watchdog
from spmd_runtime.comm.agreement import AgreedError, sleep_until_every_rank_arrives

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE",
                   "SLURM_NTASKS", "PALS_SIZE", "I_MPI_SIZE")
_aborting = threading.Lock()
_installing = threading.Lock()
_state: dict = {}  # the installed guard of this process: comm, rank, size, watchdog
_decided = False  # set once ``install`` ran in this process (installed or not, it is not tried again)


def launched_by_mpi() -> bool:
    """Whether a launcher started more than one process (read from its environment: MPI is not initialised)."""
    if "mpi4py.MPI" in sys.modules:
        return True
    for name in _SIZE_VARIABLES:
        try:
            if int(os.environ.get(name, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def decided() -> bool:
    """Whether ``install`` already ran in this process (later calls do nothing)."""
    return _decided


def installed() -> bool:
    """Whether the guard is installed in this process."""
    return bool(_state)


def install() -> bool:
    """Once per process (later calls only answer): install the guard if this is an MPI job of more than one
    process. Collective over the world when it installs. Returns whether the guard is installed."""
    global _decided
    with _installing:
        if not _decided:
            _decided = True
            if _enabled() and launched_by_mpi():
                _install()
    return bool(_state)


def _enabled() -> bool:
    return os.environ.get("SPMD_ABORT_ON_ERROR", "1").strip().lower() not in ("0", "off", "no", "false")


def _install() -> None:
    from mpi4py import MPI  # not at the top: importing it initialises MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        return
    _state.update(comm=comm, rank=comm.Get_rank(), size=comm.Get_size())
    _every_rank_arrives(comm)
    _start_deathwatch(comm)
    sys.excepthook = _excepthook
    signal_fd = _install_signal_handlers()
    control = comm.Dup()  # the watchdog's own communicator: its messages and exit barrier match nothing else
    _state["watchdog"] = watchdog.Watchdog(control, abort_job, watchdog.timeout_seconds(), signal_fd).start()
    atexit.register(_at_exit)  # registered after mpi4py's import, so it runs before MPI_Finalize


def _every_rank_arrives(comm) -> None:
    """Wait, within ``SPMD_TIMEOUT``, until every rank is installing too: installing is collective, and a rank
    that failed or exited before its first use of the runtime (unguarded then) would never join; the others end
    the job saying so instead of waiting forever."""
    limit = watchdog.timeout_seconds()
    if not sleep_until_every_rank_arrives(comm, limit):
        abort_job(f"spmd_runtime: rank {_state['rank']}: not every rank reached the runtime's first use of MPI "
                  f"within SPMD_TIMEOUT={limit:g} s (the job guard installs there, on every rank together); a "
                  f"rank that failed or exited before it was not guarded: call sr.distributed.initialize() "
                  f"first thing in the script to guard it from the start", comm)


def abort_job(message: str, comm=None, code: int = 1) -> None:
    """Print ``message`` and end every rank of the job (MPI_Abort on ``comm``, default the world); never returns.
    Only the first caller prints."""
    if not _aborting.acquire(blocking=False):
        while True:  # another thread is aborting the job
            time.sleep(1)
    if "host_lead_pid" in _state:  # this rank says why itself: its host's watcher need not
        deathwatch.tell(_state["host_lead_pid"], "abort")
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
        time.sleep(0.2)  # let the launcher forward the message before MPI_Abort tears the job down
    finally:
        if comm is None:
            from mpi4py import MPI  # not at the top: importing it initialises MPI
            comm = _state.get("comm", MPI.COMM_WORLD)
        comm.Abort(code)
        os._exit(code)  # MPI_Abort may return before the launcher kills this process


def _excepthook(etype, value, tb) -> None:
    rank, size = _state["rank"], _state["size"]
    if isinstance(value, AgreedError):  # every rank raised it alike: one line each, normal exit with status 1
        sys.stderr.write(f"spmd_runtime: rank {rank}: {etype.__name__}: {value}\n")
        sys.stderr.flush()
        return
    text = "".join(traceback.format_exception(etype, value, tb))
    abort_job(f"spmd_runtime: rank {rank} of {size} failed with an uncaught {etype.__name__}, aborting the job:\n"
              f"{text}")


def _on_signal(signum, frame) -> None:
    where = watchdog.where(frame) if frame is not None else None
    at = f" while waiting at {where}" if where else ""
    abort_job(f"spmd_runtime: rank {_state['rank']} received {signal.Signals(signum).name}{at}; aborting the job")


def _install_signal_handlers() -> int | None:
    """SIGINT/SIGTERM abort the job; returns the read end of the wakeup pipe (None outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    return read


def _start_deathwatch(comm) -> None:
    """The lowest rank of each host starts the watcher that names a rank killed without a word (deathwatch.py);
    then every rank takes hold of its lifeline in the set that watcher made (its id shared in one allgather),
    so the watcher can tell the rank that ended first from the bystanders the launcher kills after it."""
    host = socket.gethostname()
    here = deathwatch.pid_space()
    local = {r: pid for r, (h, pid) in enumerate(comm.allgather((here, os.getpid()))) if h == here}
    lead, rank, lifelines = min(local), comm.Get_rank(), None
    _state["host_lead_pid"] = local[lead]
    if lead == rank:
        _state["watcher"] = deathwatch.start(local, host)
        lifelines = getattr(_state["watcher"], "lifelines", None)
    deathwatch.hold(comm.allgather(lifelines)[lead], sorted(local).index(rank))


def _at_exit() -> None:
    dog = _state.pop("watchdog", None)
    if dog is not None:
        dog.leave()
        dog.comm.Free()
    if "host_lead_pid" in _state:  # every rank passed the exit barrier: the watcher's work is done
        deathwatch.tell(_state.pop("host_lead_pid"), "bye")
    watcher = _state.pop("watcher", None)
    if watcher is not None:
        try:
            watcher.wait(timeout=1)
        except Exception:  # noqa: BLE001 - it ends when the ranks on this host do
            pass


__all__ = ["install", "installed", "decided", "abort_job", "launched_by_mpi"]
