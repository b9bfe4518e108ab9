"""Name the rank that died: a watcher process per host reports a rank that ends before the job's exit barrier.

A rank killed by SIGKILL (or the OOM killer, or a crash in C code) cannot say anything, and MPICH's launcher
SIGKILLs the other ranks within milliseconds, before they can either; its own message names a pid, not a
rank, and not always the first to die. So the lowest rank on each host starts this file as a small process
(``python -I -S deathwatch.py``: no package import, ~20 ms) in a session of its own, which the launcher's
cleanup does not kill; it inherits the rank's stdout/stderr, and the launcher forwards what it writes. It
waits on a pidfd per local rank (woken by the kernel when one ends, no polling) and on a datagram socket:

- a rank that reaches the exit barrier (``bye``) or aborts the job itself (``abort``: it printed why) sends
  one datagram, and the watcher exits without a word;
- a rank that ends with neither makes the watcher print which rank it was (pid, host, the signal when it
  can still read it) and exit; it first waits a moment (``GRACE_S``) for other ranks ending with it, and
  names them all, since the order in which killed processes finish exiting is not the order they were hit.

It exits as soon as one of these happens, so it never outlives the job's ranks on its host.
The socket is bound by the rank that starts the watcher (its address is in the Linux abstract namespace:
no file to clean up) and handed over, so no datagram can come before it listens.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys

_PREFIX = "\0spmd_runtime.deathwatch."


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
    return f"{socket.gethostname()}/{boot}/{namespace}"


def address(host_lead_pid: int) -> str:
    """The datagram address of the watcher started by the rank with this pid (unique on its host)."""
    return f"{_PREFIX}{host_lead_pid}"


def start(local: dict[int, int], host: str, wait: float = 10.0) -> subprocess.Popen | None:
    """Start the watcher of ``local`` (rank -> pid, the ranks on this host); call on one rank per host.
    Returns once it watches (at most ``wait`` seconds: a watcher started late could not tell who died first)."""
    if not available():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ready_read, ready_write = os.pipe()
    try:
        sock.bind(address(os.getpid()))
        args = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(sock.fileno()), str(ready_write), host,
                *(f"{rank}:{pid}" for rank, pid in sorted(local.items()))]
        watcher = subprocess.Popen(args, pass_fds=[sock.fileno(), ready_write], stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        os.close(ready_write)
        ready_write = None
        select.select([ready_read], [], [], wait)
        return watcher
    except OSError:
        return None
    finally:
        sock.close()
        os.close(ready_read)
        if ready_write is not None:
            os.close(ready_write)


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


def _watch(fd: int, ready: int, host: str, ranks: dict[int, int]) -> None:
    sock = socket.socket(fileno=fd)
    pidfds: dict[int, int] = {}
    gone = []
    for rank, pid in ranks.items():
        try:
            pidfds[os.pidfd_open(pid)] = rank
        except ProcessLookupError:
            gone.append(rank)
    os.write(ready, b"1")
    os.close(ready)
    if gone:
        _report(gone, ranks, host, lambda pid: "it was gone when the watcher started")
        return
    ready, _, _ = select.select([sock, *pidfds], [], [])
    if sock in ready:  # checked first: a rank sends before it ends
        return
    _report(sorted(pidfds[f] for f in _settled(ready, list(pidfds))), ranks, host, _ending)


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
           {int(r): int(p) for r, p in (a.split(":") for a in sys.argv[4:])})
