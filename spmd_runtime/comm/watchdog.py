"""Watchdog: a collective that no peer joins becomes an abort that says where every rank is.

Zero cost on the hot path: nothing is recorded per call. Functions that block
until peers arrive (the communicator's MPI wrappers, the agreement) are marked
once with ``@collective``; a monitor thread (mpi4py initialises MPI with
THREAD_MULTIPLE and releases the GIL in blocking calls) samples every thread's
Python stack a few times a second. When the innermost marked frame of a thread
is the same frame object for ``SPMD_TIMEOUT`` seconds (default 300; ``0`` or
``off`` disables), the monitor asks every peer where it is (control messages on
COMM_WORLD with tag ``TAG``; a stopped rank cannot answer), prints one report
and aborts the job. Frames marked with ``@context`` (the interpreter's run loop)
add the instruction being executed.

The same thread also ends the job when this rank gets SIGINT/SIGTERM while
blocked inside MPI (the Python handler only runs between bytecodes;
``signal.set_wakeup_fd`` wakes this thread).

A peer that exits early (its script ends while others still wait for it) is
caught by the timeout, not sooner: announcing an exit to the peers at atexit
made MPICH SIGKILL ordinary 8-rank jobs that finalized with those messages in
flight, so ranks send nothing at exit.

API for other modules: ``@collective(describe)`` on any function that waits for
peers (a nonblocking collective's wait, say), ``collective_closures(binder,
describe)`` for closures made at bind time, ``context(fn, describe)`` for a
frame that says what is being run; ``describe(frame) -> str`` is only called
when a report is written.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import types

TAG = 31415  # control messages on COMM_WORLD; every point-to-point receive of the runtime names its own tag
PERIOD = 0.1  # seconds between samples
ANSWER_WAIT = 1.0  # how long a report waits for the peers' answers

_SITES: dict = {}  # code object -> describe(frame): functions that wait for peers
_CONTEXTS: dict = {}  # code object -> describe(frame): frames that say what is being run


def collective(describe=None):
    """Mark a function as one that blocks until its peers arrive. Returns the function itself (no wrapper)."""
    def mark(fn):
        _SITES[fn.__code__] = describe or (lambda frame: fn.__qualname__)
        return fn
    return mark


def collective_closures(fn, describe) -> None:
    """Mark every function defined inside ``fn`` (the closures a binder returns) as waiting for peers."""
    stack = [fn.__code__]
    while stack:
        for const in stack.pop().co_consts:
            if isinstance(const, types.CodeType):
                _SITES[const] = describe
                stack.append(const)


def context(fn, describe) -> None:
    """Mark ``fn``'s frames as context for a report: ``describe(frame)`` names what it is running."""
    _CONTEXTS[fn.__code__] = describe


def timeout_seconds() -> float | None:
    """``SPMD_TIMEOUT`` in seconds (default 300); None when set to 0/off."""
    raw = os.environ.get("SPMD_TIMEOUT", "300").strip().lower()
    if raw in ("0", "off", "none", ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"SPMD_TIMEOUT must be a number of seconds or 'off'; got {raw!r}") from None
    if value <= 0:
        return None
    return value


def where(frame) -> str | None:
    """'<site> in <context>' for the innermost marked frame of a stack, or None when it waits for nobody."""
    site = ctx = None
    while frame is not None:
        code = frame.f_code
        if site is None and code in _SITES:
            site = _describe(_SITES[code], frame)
        elif site is not None and code in _CONTEXTS:
            ctx = _describe(_CONTEXTS[code], frame)
            break
        frame = frame.f_back
    return None if site is None else site + (f" in {ctx}" if ctx else "")


def _describe(fn, frame) -> str:
    try:
        return str(fn(frame))
    except Exception as e:  # noqa: BLE001 - a report must never fail
        return f"{frame.f_code.co_name} (undescribable: {type(e).__name__})"


def _innermost_site(frame):
    while frame is not None:
        if frame.f_code in _SITES:
            return frame
        frame = frame.f_back
    return None


class Watchdog:
    """The monitor thread of one rank (see the module docstring). ``abort(message)`` ends the job."""

    def __init__(self, comm, abort, timeout: float | None, signal_fd: int | None = None):
        self.comm, self.abort, self.timeout, self.signal_fd = comm, abort, timeout, signal_fd
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._seen: dict[int, tuple] = {}  # thread id -> (innermost marked frame, first seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spmd-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * PERIOD + 1)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wait_for_signal(PERIOD)
            if self._stop.is_set():
                return
            self._serve()
            self._check_stacks()

    def _wait_for_signal(self, seconds: float) -> None:
        if self.signal_fd is None:
            self._stop.wait(seconds)
            return
        ready, _, _ = select.select([self.signal_fd], [], [], seconds)
        if ready:
            data = os.read(self.signal_fd, 64)
            if data:
                name = signal.Signals(data[0]).name if data[0] in signal.Signals._value2member_map_ else data[0]
                self.abort(f"spmd_runtime: rank {self.rank} received {name}{self._blocked_at()}; aborting the job")

    def _blocked_at(self) -> str:
        places = [where(f) for t, f in sys._current_frames().items() if t != threading.get_ident()]
        places = [p for p in places if p]
        return f" while waiting at {places[0]}" if places else ""

    def _check_stacks(self) -> None:
        now, me = time.monotonic(), threading.get_ident()
        seen = {}
        for tid, frame in sys._current_frames().items():
            site = None if tid == me else _innermost_site(frame)
            if site is None:
                continue
            held = self._seen.get(tid)
            first = held[1] if held is not None and held[0] is site else now
            seen[tid] = (site, first)
            waited = now - first
            if self.timeout is not None and waited >= self.timeout:
                self._report(frame, waited, f"no peer completed it within SPMD_TIMEOUT={self.timeout:g} s")
        self._seen = seen  # holding the frames keeps their ids from being reused by a later call

    # ------------------------------------------------------------------ control messages
    def _serve(self) -> None:
        """Answer 'where are you?' queries."""
        from mpi4py import MPI  # not at the top: importing it initialises MPI
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            source = status.Get_source()
            kind, payload = self.comm.recv(source=source, tag=TAG)
            if kind == "where?":
                self._send(source, ("here", self._here()))
            elif kind == "here":  # an answer that came after its report gave up waiting
                pass

    def _here(self) -> str:
        now = time.monotonic()
        places = []
        for tid, frame in sys._current_frames().items():
            place = None if tid == threading.get_ident() else where(frame)
            if place:
                held = self._seen.get(tid)
                waited = f" for {now - held[1]:.1f} s" if held else ""
                places.append(f"waits{waited} at {place}")
        return "; ".join(places) or "is not in a collective (computing, or between runs)"

    def _send(self, dest: int, message) -> None:
        request = self.comm.isend(message, dest=dest, tag=TAG)
        _complete(request, 0.5)

    def _report(self, frame, waited: float, why: str) -> None:
        """Ask every peer where it is, then abort with one report."""
        from mpi4py import MPI  # not at the top: importing it initialises MPI
        mine = where(frame)
        for p in range(self.size):
            if p != self.rank:
                self._send(p, ("where?", None))
        answers: dict[int, str] = {}
        deadline = time.monotonic() + ANSWER_WAIT
        status = MPI.Status()
        while len(answers) < self.size - 1 and time.monotonic() < deadline:
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
                source = status.Get_source()
                kind, payload = self.comm.recv(source=source, tag=TAG)
                if kind == "here":
                    answers[source] = payload
                elif kind == "where?":
                    self._send(source, ("here", self._here()))
            else:
                time.sleep(0.01)
        absent = [p for p in range(self.size) if p != self.rank and (p not in answers or mine not in answers[p])]
        lines = [f"spmd_runtime: rank {self.rank} waited {waited:.1f} s at {mine}: {why}; aborting the job.",
                 f"  ranks that never arrived there: {absent}"]
        for p in range(self.size):
            if p == self.rank:
                continue
            if p in answers:
                lines.append(f"  rank {p}: {answers[p]}")
            else:
                lines.append(f"  rank {p}: no answer within {ANSWER_WAIT:g} s (stopped, killed, or blocked "
                             f"outside Python)")
        self.abort("\n".join(lines))


def _complete(request, seconds: float) -> None:
    """Wait for a small control send, but never forever (a stopped peer must not block the watchdog)."""
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)


__all__ = ["collective", "context", "where", "timeout_seconds", "Watchdog", "TAG"]
