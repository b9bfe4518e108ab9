"""Name the rank that died: a watcher process per host reports a rank that ends before the job's exit barrier.

A rank killed by SIGKILL (or the OOM killer, or a crash in C code) cannot say anything, and MPICH's launcher
SIGKILLs the other ranks within milliseconds, before they can either; its own message names a pid, not a
rank, and not always the first to die. So the lowest rank on each host starts this file as a small process
(``python -I -S deathwatch.py``: no package import, ~20 ms) in a session of its own, which the launcher's
cleanup does not kill; it inherits the rank's stdout/stderr, and the launcher forwards what it writes. It
waits on a pidfd per local rank (woken by the kernel when one ends, no polling) and on a datagram socket:

- a rank that reaches the exit barrier (``bye``) or aborts the job itself (``abort``: it printed why) sends
  one datagram, and the watcher exits without a word;
- a rank that ends with neither makes the watcher print which rank it was (pid, host, the signal) and exit.
  It names only the rank that ended first: the launcher kills the others once it sees that rank go, and
  they are bystanders, not causes.

Which rank ended first is the kernel's to say, not the watcher's: the order in which processes finish exiting
(their pidfds) is not the order they were hit (a rank killed while it frees a large heap or writes a file
exits after the bystanders the launcher killed meanwhile), and the watcher may be scheduled late. So each
local rank holds a lifeline: one semaphore of a SysV set made for its host, raised with ``SEM_UNDO`` (``hold``).
However a process ends, the kernel lowers its lifeline in ``exit_sem``, before it closes the process's files,
so before the launcher (which watches those files: the rank's pipes and its PMI socket) can learn of it and
kill anyone. A watcher thread per rank waits, in one atomic ``semop``, for its rank's lifeline to fall AND
takes the set's one token: the kernel completes that wait inside the dying rank's own exit, so the first rank
to end takes the token and the others' waits can never complete. Where SysV semaphores are missing (or for a
rank that had not taken hold yet) the watcher falls back to the pidfds, and then names every rank that ends
within ``GRACE_S`` of the first, flagged "together with others".

It exits as soon as one of these happens, so it never outlives the job's ranks on its host.
The socket is bound by the rank that starts the watcher (its address is in the Linux abstract namespace:
no file to clean up) and handed over, so no datagram can come before it listens.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading

_PREFIX = "\0spmd_runtime.deathwatch."
_IPC_PRIVATE, _IPC_CREAT, _IPC_RMID, _SETVAL, _SEM_UNDO = 0, 0o1000, 0, 16, 0x1000  # <sys/ipc.h>, <sys/sem.h>
_libc = None


class _SemBuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


def available() -> bool:
    return hasattr(os, "pidfd_open") and sys.platform.startswith("linux")


def pid_space() -> str:
    """Which ranks share this process's pids: same host name, same boot, same pid namespace (hosts or
    containers may share a name; a pid means the same process only within one kernel's namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "?", 0
    try:  # a rank's lifeline (a SysV semaphore id) means the same set only within one IPC namespace
        ipc = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc = 0
    return f"{socket.gethostname()}/{boot}/{namespace}/{ipc}"


def address(host_lead_pid: int) -> str:
    """The datagram address of the watcher started by the rank with this pid (unique on its host)."""
    return f"{_PREFIX}{host_lead_pid}"


def start(local: dict[int, int], host: str, wait: float = 10.0) -> subprocess.Popen | None:
    """Start the watcher of ``local`` (rank -> pid, the ranks on this host); call on one rank per host.
    Returns once it watches (at most ``wait`` seconds: a watcher started late could not tell who died first).
    Its ``lifelines`` attribute: the id of the host's lifeline set (None without one), for every local rank's
    ``hold`` (the set is the watcher's to remove, when it exits)."""
    if not available():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ready_read, ready_write = os.pipe()
    lifelines = _make_lifelines(len(local))
    try:
        sock.bind(address(os.getpid()))
        args = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(sock.fileno()), str(ready_write), host,
                str(-1 if lifelines is None else lifelines), *(f"{rank}:{pid}" for rank, pid in sorted(local.items()))]
        watcher = subprocess.Popen(args, pass_fds=[sock.fileno(), ready_write], stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        os.close(ready_write)
        ready_write = None
        watcher.lifelines, lifelines = lifelines, None  # handed over: the watcher removes the set
        select.select([ready_read], [], [], wait)
        return watcher
    except OSError:
        return None
    finally:
        if lifelines is not None:
            _remove_lifelines(lifelines)
        sock.close()
        os.close(ready_read)
        if ready_write is not None:
            os.close(ready_write)


def hold(lifelines: int | None, index: int) -> None:
    """Take hold of this process's lifeline: semaphore ``index`` (its place among the host's ranks, sorted) of
    the set ``lifelines`` (``start``'s, shared by the host's lead rank), raised with SEM_UNDO so the kernel
    lowers it however the process ends (module doc). Never fails: without it the watcher uses the pidfds."""
    if lifelines is not None:
        try:
            _semop(lifelines, (index, 1, _SEM_UNDO))
        except OSError:
            pass


def _libc_calls():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _semop(semid: int, *ops) -> None:
    """One atomic ``semop`` of ``ops`` ((semaphore, change, flags), ...); blocks until all can be done."""
    buffer = (_SemBuf * len(ops))(*(_SemBuf(num, change, flags) for num, change, flags in ops))
    if _libc_calls().semop(semid, buffer, len(ops)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _make_lifelines(count: int) -> int | None:
    """A private SysV semaphore set: ``count`` lifelines (0: not held yet) and, last, the one token (1)."""
    try:
        calls = _libc_calls()
        semid = calls.semget(_IPC_PRIVATE, count + 1, _IPC_CREAT | 0o600)
    except (OSError, AttributeError):
        return None
    if semid < 0:
        return None
    if calls.semctl(semid, count, _SETVAL, ctypes.c_int(1)) != 0:
        _remove_lifelines(semid)
        return None
    return semid


def _remove_lifelines(semid: int) -> None:
    """Remove the set (a kernel object: it would outlive the job); the waits on it end with EIDRM."""
    try:
        _libc_calls().semctl(semid, 0, _IPC_RMID)
    except (OSError, AttributeError):
        pass


def tell(host_lead_pid: int, what: str) -> None:
    """Send ``what`` ('bye' or 'abort') to this host's watcher; never fails."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(what.encode(), address(host_lead_pid))
    except OSError:
        pass


def _ending(pid: int) -> str:
    """How the process ended, read from /proc while it is still a zombie (its exit code is there), else a guess."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = int(f.read().rsplit(")", 1)[1].split()[-1])
    except (OSError, ValueError, IndexError):
        return "killed (SIGKILL, the OOM killer), crashed, or called os._exit"
    if code & 0x7F:
        try:
            return f"killed by signal {signal.Signals(code & 0x7F).name}"
        except ValueError:
            return f"killed by signal {code & 0x7F}"
    return f"exited with status {code >> 8} without leaving through Python (os._exit, or a crash in C code)"


def _watch(fd: int, ready: int, host: str, ranks: dict[int, int], lifelines: int | None) -> None:
    try:
        _watch_ranks(socket.socket(fileno=fd), ready, host, ranks, lifelines)
    finally:
        if lifelines is not None:
            _remove_lifelines(lifelines)


def _watch_ranks(sock, ready: int, host: str, ranks: dict[int, int], lifelines: int | None) -> None:
    pidfds: dict[int, int] = {}
    gone = []
    for rank, pid in ranks.items():
        try:
            pidfds[os.pidfd_open(pid)] = rank
        except ProcessLookupError:
            gone.append(rank)
    first_read, first_write = os.pipe()
    if lifelines is not None:
        for index, rank in enumerate(sorted(ranks)):
            threading.Thread(target=_wait_for_the_first, args=(lifelines, index, len(ranks), rank, ranks[rank],
                                                               first_write), daemon=True).start()
    os.write(ready, b"1")
    os.close(ready)
    if gone:
        _report(gone, ranks, host, lambda pid: "it was gone when the watcher started")
        return
    ready, _, _ = select.select([sock, first_read, *pidfds], [], [])
    if first_read not in ready and lifelines is not None and sock not in ready:
        # a pidfd first: a rank that held its lifeline lowered it before it ended, so its thread is about to say
        ready += select.select([sock, first_read], [], [], GRACE_S)[0]
    if sock in ready or select.select([sock], [], [], 0)[0]:  # checked first: a rank sends before it ends
        return
    if first_read in ready:
        rank, ending = os.read(first_read, 4096).decode().split(" ", 1)
        _report([int(rank)], ranks, host, lambda pid: ending)
        return
    _report(sorted(pidfds[f] for f in _settled(ready, list(pidfds))), ranks, host, _ending)


def _wait_for_the_first(lifelines: int, index: int, token: int, rank: int, pid: int, out: int) -> None:
    """Wait until rank ``rank`` holds its lifeline, then until it falls while the token is still there (one
    atomic semop: the kernel decides it in the first dying rank's exit), and say so on ``out``: its rank and
    how it ended, read at once (its exit code is in /proc while it still exits)."""
    try:
        _semop(lifelines, (index, -1, 0), (index, 1, 0))
        _semop(lifelines, (index, 0, 0), (token, -1, 0))
    except OSError:  # the set is gone: the watcher is leaving
        return
    os.write(out, f"{rank} {_ending(pid)}".encode())


GRACE_S = 0.2  # how long more ranks may keep ending after the first one seen


def _settled(ready: list, pidfds: list) -> list:
    """``ready`` and every other pidfd that becomes ready within GRACE_S of the last. A process's pidfd is
    ready once it has fully exited, which for the rank killed first can come after the launcher has already
    seen its pipes close and killed the others (a rank killed in the middle of writing a file exits last):
    seeing only the first pidfd would name a bystander."""
    ready, rest = list(ready), [f for f in pidfds if f not in ready]
    while rest:
        more, _, _ = select.select(rest, [], [], GRACE_S)
        if not more:
            break
        ready += more
        rest = [f for f in rest if f not in more]
    return ready


def _report(dead: list[int], ranks: dict[int, int], host: str, ending) -> None:
    """One line: the rank(s) that ended (several when the watcher saw them end at once: the first was killed,
    then the launcher ended the others) and how."""
    who = ", ".join(f"rank {r} (pid {ranks[r]}): {ending(ranks[r])}" for r in dead)
    sys.stderr.write(f"spmd_runtime (watcher of the ranks on {host}): {who}; it ended before the job's exit "
                     f"barrier{', together with others' if len(dead) > 1 else ''}, and the job cannot complete "
                     f"without it\n")
    sys.stderr.flush()


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
           {int(r): int(p) for r, p in (a.split(":") for a in sys.argv[5:])},
           None if int(sys.argv[4]) < 0 else int(sys.argv[4]))
