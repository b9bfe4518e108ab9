"""The ranks' agreement: a failure on some ranks becomes the same error on every rank, before any collective.

``capture`` keeps a rank-local failure as a message instead of raising it on that rank alone (the others would
wait for it in their next collective); ``agree`` exchanges every rank's message and raises on EVERY rank if any
rank has one. ``AgreedError`` is what it raises by default: the job guard (jobguard.py) prints it as one line
per rank, no traceback, since every rank raised it alike.
"""
from __future__ import annotations

from spmd_runtime.comm import watchdog


class AgreedError(RuntimeError):
    """Raised alike on EVERY rank after the ranks agreed that some rank failed (see ``agree``).

    ``ranks``: the failing ranks. Uncaught, it prints one line per rank and the job exits with status 1.
    """

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


def _typed(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def capture(fn, *args, catch=Exception, describe=_typed) -> tuple:
    """``(fn(*args), None)``, or ``(None, describe(exception))`` when it raises one of ``catch``: the error is
    agreed on (``agree``), not raised on this rank alone. ``describe`` default: "<type name>: <message>"."""
    try:
        return fn(*args), None
    except catch as e:  # noqa: BLE001 - whatever fails here must be agreed on, not raised on one rank
        return None, describe(e)


def _subject(frame) -> str:
    """What a blocked agreement is about, for the watchdog: the quoted action, or a caller's rule's subject."""
    what = frame.f_locals.get("what")
    return repr(what) if frame.f_locals.get("rule") is None else str(what)


@watchdog.collective(lambda frame: f"the ranks' agreement on {_subject(frame)} (an allgather)")
def agree(comm, error: str | None, what: str, payload=None, error_type=AgreedError, rule: str | None = None) -> list:
    """Collective: raise ``error_type`` (an AgreedError, given the failing ranks, or any exception type taking a
    message) on EVERY rank if any rank passed an error; returns every rank's payload.

    The one place where a rank-local failure becomes a job-wide one: call it before
    the first collective that depends on the local check, so a rank that failed
    does not leave the others blocked. The error reads "<what> must succeed on every rank; got errors on
    rank(s) [...]: ..." with ranks failing alike sharing one message; a caller's ``rule`` replaces the
    sentence before "; got errors" and names each failing rank with its message ("rank 1: ...; rank 3: ...").
    """
    gathered = comm.allgather((None if error is None else str(error), payload))
    by_message: dict[str, list[int]] = {}
    for rank, (message, _) in enumerate(gathered):
        if message is not None:
            by_message.setdefault(message, []).append(rank)
    if by_message:
        failed = sorted(r for ranks in by_message.values() for r in ranks)
        message = (f"{rule or what + ' must succeed on every rank'}; got errors on rank(s) {failed}: "
                   f"{_details(by_message, gathered, rule is not None)}")
        raise error_type(message, failed) if issubclass(error_type, AgreedError) else error_type(message)
    return [p for _, p in gathered]


def _details(by_message: dict, gathered: list, each_rank: bool) -> str:
    if each_rank:
        return "; ".join(f"rank {r}: {message}" for r, (message, _) in enumerate(gathered) if message is not None)
    return "; ".join(message if len(by_message) == 1 else f"{_ranks(ranks)}: {message}"
                     for message, ranks in by_message.items())


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


__all__ = ["AgreedError", "agree", "capture"]
