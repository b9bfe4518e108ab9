"""Watchdog: a collective that no peer joins becomes an abort that says where every rank is.

Zero cost on the hot path: nothing is recorded per call. Functions that block
until peers arrive (the communicator's MPI wrappers, the agreement) are marked
once with ``@collective``; a monitor thread (mpi4py initialises MPI with
THREAD_MULTIPLE and releases the GIL in blocking calls) samples every thread's
Python stack a few times a second, and talks to the peers' monitor threads with
small control messages on a communicator of its own (a duplicate of the world).

- A thread blocked at the same marked frame for ``PROBE_EVERY`` seconds (2)
  asks the peers that frame waits for "where are you?" (again every 2 s,
  except the peers that answered they wait at the same collective). A
  peer whose script ended answers "exited" (see ``leave``); when the thread is
  still blocked ``CONFIRM`` seconds later, the job is aborted with that rank
  named: an early exit ends the job in about 3 s, whatever ``SPMD_TIMEOUT``.
- After ``SPMD_TIMEOUT`` seconds at one frame (default 300; ``0`` or ``off``
  disables) it asks every peer where it is (a stopped rank cannot answer),
  prints one report and aborts the job. Frames marked with ``@context`` (the
  interpreter's run loop) add the instruction being executed.
- At exit (``leave``, from the job guard's atexit, before MPI_Finalize) every
  rank waits at an exit barrier (Ibarrier + test loop) while the thread answers
  "exited"; then every control message still in flight is matched (the ranks
  exchange how many each sent to each), since MPICH kills a job whose ranks
  finalize with unmatched messages. Ranks that finish at different times are
  never aborted: a rank at the exit barrier waits for the others as long as
  they take.

The same thread also ends the job when this rank gets SIGINT/SIGTERM while
blocked inside MPI (the Python handler only runs between bytecodes;
``signal.set_wakeup_fd`` wakes this thread).

API for other modules: ``@collective(describe, peers)`` on any function that
waits for peers (a nonblocking collective's wait, say), ``collective_closures(
binder, describe)`` for closures made at bind time, ``context(fn, describe)``
for a frame that says what is being run. ``describe(frame) -> str`` is only
called when a report is written; ``peers(frame)`` (the world ranks the frame
waits for, or the MPI communicator it waits on) only when a thread has been
blocked for ``PROBE_EVERY`` seconds; without it, the first MPI communicator
among the frame's locals decides, else every rank.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import types

TAG = 31415  # control messages, on the watchdog's own communicator
PERIOD = 0.1  # seconds between samples
ANSWER_WAIT = 1.0  # how long a report waits for the peers' answers
PROBE_EVERY = 2.0  # a thread blocked this long asks its peers whether one of them exited
CONFIRM = 1.0  # ... and ends the job if it is still blocked this long after a peer answered "exited"

_SITES: dict = {}  # code object -> describe(frame): functions that wait for peers
_PEERS: dict = {}  # code object -> peers(frame): the world ranks (or MPI communicator) a site waits for
_CONTEXTS: dict = {}  # code object -> describe(frame): frames that say what is being run


def collective(describe=None, peers=None):
    """Mark a function as one that blocks until its peers arrive. Returns the function itself (no wrapper)."""
    def mark(fn):
        _SITES[fn.__code__] = describe or (lambda frame: fn.__qualname__)
        if peers is not None:
            _PEERS[fn.__code__] = peers
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
    """The monitor thread of one rank (see the module docstring). ``abort(message)`` ends the job.

    ``comm``: a communicator of its own (a duplicate of the world, ranks numbered alike), so its control
    messages and the exit barrier never match the program's traffic.
    """

    def __init__(self, comm, abort, timeout: float | None, signal_fd: int | None = None):
        self.comm, self.abort, self.timeout, self.signal_fd = comm, abort, timeout, signal_fd
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._seen: dict[int, list] = {}  # thread id -> [innermost marked frame, first seen, last probe]
        self._exited: dict[int, tuple] = {}  # peer -> (its 'exited' answer, when it came)
        self._heard: dict[int, tuple] = {}  # peer -> (its last 'here' answer, when it came)
        self._sent, self._received = [0] * self.size, [0] * self.size  # control messages, per peer
        self._sends: list = []  # send requests not yet complete
        self._exiting = threading.Event()  # set once this rank's script ended (see ``leave``)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spmd-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * PERIOD + 1)

    def leave(self) -> None:
        """At exit (before MPI_Finalize): wait at the job's exit barrier, answering 'exited' to any peer that
        asks meanwhile; then stop the thread and match every control message still in flight, so MPI_Finalize
        finds none (MPICH kills a job that finalizes with unmatched messages)."""
        self._exiting.set()
        barrier, pause = self.comm.Ibarrier(), 0.001
        while not barrier.Test():  # a blocking Barrier would hold the ranks that still wait for this one
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        self.stop()
        if self._thread.is_alive():  # cannot happen unless the thread hangs: better leave messages than hang
            return
        self._drain()

    def _drain(self) -> None:
        sent = self.comm.alltoall(self._sent)  # how many control messages each peer sent to this rank
        for peer, count in enumerate(sent):
            while self._received[peer] < count:
                self._receive(peer)
        for request in self._sends:
            request.Wait()
        self._sends.clear()

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
            seen[tid] = held if held is not None and held[0] is site else [site, now, now]
            first = seen[tid][1]
            if self.timeout is not None and now - first >= self.timeout:
                self._report(frame, now - first, f"no peer completed it within SPMD_TIMEOUT={self.timeout:g} s")
            self._check_exits(seen[tid], now)
        self._seen = seen  # holding the frames keeps their ids from being reused by a later call

    def _check_exits(self, held: list, now: float) -> None:
        """A thread blocked PROBE_EVERY seconds asks its peers whether one exited; an exited peer it waits for
        ends the job once the thread is still there CONFIRM seconds after the answer (the collective did
        not just complete)."""
        site, first, probed = held
        if now - first < PROBE_EVERY:  # most waits end sooner: nothing to look up or ask
            return
        peers = [p for p in waited_for(site) if p != self.rank]
        gone = [p for p in peers if p in self._exited and now - max(self._exited[p][1], first) >= CONFIRM]
        if gone:
            self._report_exit(site, now - first, gone)
        if now - probed >= PROBE_EVERY and not self._exiting.is_set():
            held[2] = now
            mine = where(site)
            for p in peers:  # a peer that answered it waits at this same collective cannot leave before us
                heard = self._heard.get(p)
                if p not in self._exited and not (heard and heard[1] >= first and mine in heard[0]):
                    self._send(p, ("where?", None))

    # ------------------------------------------------------------------ control messages
    def _serve(self) -> None:
        """Answer 'where are you?' queries and keep the answers that say a peer exited."""
        self._sends = [r for r in self._sends if not r.Test()]
        while self._receive(None) is not None:
            pass

    def _receive(self, source):
        """Handle one control message (from ``source``, blocking; None: any, only if one is waiting)."""
        from mpi4py import MPI  # not at the top: importing it initialises MPI
        status = MPI.Status()
        if source is None and not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            return None
        kind, payload = self.comm.recv(source=status.Get_source() if source is None else source, tag=TAG,
                                       status=status)
        peer = status.Get_source()
        self._received[peer] += 1
        if kind == "where?" and not self._stop.is_set():
            self._send(peer, self._answer())
        elif kind == "exited":
            self._exited.setdefault(peer, (payload, time.monotonic()))
        elif kind == "here":
            self._heard[peer] = (payload, time.monotonic())
        return peer, kind, payload

    def _answer(self) -> tuple:
        if self._exiting.is_set():
            return "exited", ("exited: its script ended (returned, or called sys.exit) and it waits at the job's "
                              "exit barrier, so it joins no further collective")
        return "here", self._here()

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
        """A small control message, never waited for here (a stopped peer must not block the watchdog)."""
        self._sends.append(self.comm.isend(message, dest=dest, tag=TAG))
        self._sent[dest] += 1

    def _ask_everyone(self, seconds: float) -> dict[int, str]:
        """Every peer's answer to 'where are you?' that comes within ``seconds``."""
        for p in range(self.size):
            if p != self.rank:
                self._send(p, ("where?", None))
        answers: dict[int, str] = {}
        deadline = time.monotonic() + seconds
        while len(answers) < self.size - 1 and time.monotonic() < deadline:
            got = self._receive(None)
            if got is None:
                time.sleep(0.01)
            elif got[1] in ("here", "exited"):
                answers[got[0]] = got[2]
        return answers

    def _report(self, frame, waited: float, why: str) -> None:
        """Ask every peer where it is, then abort with one report."""
        mine = where(frame)
        answers = self._ask_everyone(ANSWER_WAIT)
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

    def _report_exit(self, frame, waited: float, gone: list[int]) -> None:
        answers = self._ask_everyone(min(ANSWER_WAIT, 0.5))
        answers.update({p: self._exited[p][0] for p in gone})
        lines = [f"spmd_runtime: rank {self.rank} waits at {where(frame)} ({waited:.1f} s), which rank(s) {gone} "
                 f"will never join: they exited (their script ended) while this rank still needs them; "
                 f"aborting the job."]
        lines += [f"  rank {p}: {answers.get(p, 'no answer within 0.5 s')}" for p in range(self.size)
                  if p != self.rank]
        self.abort("\n".join(lines))


def waited_for(frame) -> list[int]:
    """World ranks a marked frame waits for: from the site's ``peers`` rule, else from an MPI communicator among
    its locals (the frame's own, or the one a bound method belongs to); every rank when none is found.
    A simulated communicator (threads in this process) waits for no other process."""
    rule = _PEERS.get(frame.f_code)
    try:
        found = rule(frame) if rule is not None else _comm_in(frame)
        if found is None:
            return list(range(_world_size()))
        if isinstance(found, (list, tuple, range)):
            return [int(p) for p in found if p is not None]
        return _world_ranks(found)
    except Exception:  # noqa: BLE001 - a frame that changed under us: assume every rank
        return list(range(_world_size()))


def _comm_in(frame):
    for value in list(frame.f_locals.values()):
        for candidate in (value, getattr(value, "__self__", None)):
            if hasattr(candidate, "Get_size") and hasattr(candidate, "Allgather"):
                return candidate
    return None


def _world_size() -> int:
    from mpi4py import MPI  # not at the top: importing it initialises MPI
    return MPI.COMM_WORLD.Get_size()


def _world_ranks(comm) -> list[int]:
    """The world ranks of ``comm``'s members; none for a simulated communicator."""
    from mpi4py import MPI  # not at the top: importing it initialises MPI
    if not isinstance(comm, MPI.Comm):
        return []
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
        return [r for r in ranks if r != MPI.UNDEFINED]
    finally:
        group.Free()
        world.Free()


__all__ = ["collective", "context", "where", "waited_for", "timeout_seconds", "Watchdog", "TAG"]
