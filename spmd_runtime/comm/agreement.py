"""The ranks' agreement: a failure on some ranks becomes the same error on every rank, before any collective.

``capture`` keeps a rank-local failure as a message instead of raising it on that rank alone (the others would
wait for it in their next collective); ``agree`` exchanges every rank's message and raises on EVERY rank if any
rank has one. ``AgreedError`` is what it raises by default: the job guard (jobguard.py) prints it as one line
per rank, no traceback, since every rank raised it alike.

Values promised to be the same on every rank (a global array given to ``device_put``, jit's NumPy arguments,
``sr.run``'s inputs, a training step's global batch) are compared by digest: ``digests`` is what a rank puts
in the allgather its call makes anyway, ``check_same`` raises ``DifferentValuesError`` on every rank where the
ranks' digests differ, naming the value and which ranks hold which. ``plain_data_error`` is the rule for
what such a value may hold.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

try:  # optional (pip install spmd_runtime[digest]): xxh3 reads ~26 GB/s here, zlib's crc32 ~6 GB/s
    import xxhash
except ImportError:
    xxhash = None

from spmd_runtime.comm import watchdog
from spmd_runtime.devices import to_host
from spmd_runtime.dtypes import FLOATING


class AgreedError(RuntimeError):
    """Raised alike on EVERY rank after the ranks agreed that some rank failed (see ``agree``).

    ``ranks``: the failing ranks; ``messages``: rank -> its error message, when ``agree`` raised it. Uncaught, it
    prints one line per rank and the job exits with status 1.
    """

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)
        self.messages: dict = {}


class DifferentValuesError(AgreedError, ValueError):
    """Raised alike on EVERY rank when a value promised the same on every rank differs between ranks (a
    ValueError too: the input is wrong, not the run)."""


def _typed(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def capture(fn, *args, catch=Exception, describe=_typed) -> tuple:
    """``(fn(*args), None)``, or ``(None, describe(exception))`` when it raises one of ``catch``: the error is
    agreed on (``agree``), not raised on this rank alone. ``describe`` default: "<type name>: <message>"."""
    try:
        return fn(*args), None
    except catch as e:  # noqa: BLE001 - whatever fails here must be agreed on, not raised on one rank
        return None, describe(e)


def sleep_until_every_rank_arrives(comm, limit: float | None = None) -> bool:
    """Collective: wait SLEEPING (an MPI wait spins, and with more ranks than cores the spinners take the cores
    the late ranks need) until every rank of ``comm`` calls this too; False if ``limit`` seconds pass first."""
    request, pause = comm.Ibarrier(), 1e-4
    deadline = None if limit is None else time.monotonic() + limit
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.002)
    return True


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
    by_message = ranks_by_value({rank: message for rank, (message, _) in enumerate(gathered) if message is not None})
    if by_message:
        failed = sorted(r for ranks in by_message.values() for r in ranks)
        message = (f"{rule or what + ' must succeed on every rank'}; got errors on rank(s) {failed}: "
                   f"{_details(by_message, gathered, rule is not None)}")
        if not issubclass(error_type, AgreedError):
            raise error_type(message)
        error = error_type(message, failed)
        error.messages = {rank: m for rank, (m, _) in enumerate(gathered) if m is not None}  # each failing rank's
        raise error
    return [p for _, p in gathered]


def _details(by_message: dict, gathered: list, each_rank: bool) -> str:
    if each_rank:
        return "; ".join(f"rank {r}: {message}" for r, (message, _) in enumerate(gathered) if message is not None)
    return "; ".join(message if len(by_message) == 1 else f"{_ranks(ranks)}: {message}"
                     for message, ranks in by_message.items())


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


# ------------------------------------------------------------------ values promised the same on every rank
DIGEST = "xxh3_64" if xxhash is not None else "crc32"  # the digest this rank makes (ranks must make the same)


def digest(x) -> int:
    """A digest of an array's dtype, shape and bytes in C order: 64-bit xxh3 with xxhash installed, else
    zlib's 32-bit crc32. Equal bytes give equal digests (NaNs of one bit pattern, -0.0 alike), whatever the
    strides: a non-contiguous array is copied to C order first. A device array is copied to the host first.
    Costs one pass over the bytes: per 64 MiB on this machine ~2.6 ms with xxhash and ~11 ms with crc32 in one
    process, ~4 and ~25 ms with 2 ranks sharing its 2 cores (scripts/bench_digest.py)."""
    x = np.ascontiguousarray(to_host(x))
    header = zlib.crc32(f"{x.dtype.name}{x.shape}".encode())
    data = x.reshape(-1).view(np.uint8) if x.size else b""
    return xxhash.xxh3_64_intdigest(data, seed=header) if xxhash is not None else zlib.crc32(data, header)


def digests(values) -> tuple:
    """What a rank contributes to a check of values promised the same everywhere: ``(DIGEST, digest of each
    value, None for a value not promised)``."""
    return (DIGEST, *(None if x is None else digest(x) for x in values))


def check_same(gathered: list, names, rule: str, skip: str) -> None:
    """Raise ``DifferentValuesError`` when the ranks' ``digests`` (``gathered``: every rank's, or None where the
    rank skipped the check) differ. Every rank holds the same ``gathered``, so every rank raises alike with no
    further collective. The message: "<rule>; got different contents for 'x': ranks [0, 2] vs [1, 3] (digests
    ...)<skip>" (``skip``: how to skip the check). A rank that skipped the check while others made it gets a
    message of its own, the same on every rank (it may not know the others' ``rule``)."""
    ranks = list(range(len(gathered)))
    skipped = [r for r, g in enumerate(gathered) if g is None]
    if skipped and len(skipped) < len(gathered):
        raise DifferentValuesError(
            f"every rank must make the same choice of checking the values it promises are the same everywhere "
            f"(check_inputs=, $SPMD_CHECK_INPUTS); got the check on ranks "
            f"{[r for r in ranks if r not in skipped]} and none on ranks {skipped}", ranks)
    message = None if skipped else _difference(gathered, list(names))
    if message is not None:
        raise DifferentValuesError(f"{rule}; got {message}{skip}", ranks)


def _difference(gathered: list, names: list) -> str | None:
    kinds = ranks_by_value([g[0] for g in gathered])
    if len(kinds) > 1:
        return (f"digests of different kinds ({'; '.join(f'{k}: ranks {r}' for k, r in kinds.items())}): "
                f"install xxhash on every rank or on none")
    differing = []
    for k, name in enumerate(names, start=1):
        by_digest = ranks_by_value({r: g[k] for r, g in enumerate(gathered) if g[k] is not None})
        if len(by_digest) > 1:
            differing.append(f"{name!r}: ranks {' vs '.join(map(str, by_digest.values()))} (digests "
                             f"{' vs '.join(f'{d:x}' for d in by_digest)})")
    if not differing:
        return None
    shown = "; ".join(differing[:4]) + (f"; and {len(differing) - 4} more" if len(differing) > 4 else "")
    return f"different contents for {shown}"


def ranks_by_value(by_rank) -> dict:
    """value -> the ranks holding it, in rank order; ``by_rank``: a list (rank k's value at k) or a dict."""
    groups: dict = {}
    for rank, value in (by_rank.items() if isinstance(by_rank, dict) else enumerate(by_rank)):
        groups.setdefault(value, []).append(rank)
    return groups


def plain_data_error(x, name: str, what: str) -> str | None:
    """Why ``x`` cannot be a value the ranks share (None if it can): arrays of numbers or booleans only. An
    object array holds pointers to Python objects, which are no data, differ on every rank and cannot be sent;
    strings, dates and records have no ops."""
    dt = np.dtype(x.dtype)
    if dt.kind in "biufc" or dt.name in FLOATING:
        return None
    why = (" (its elements are pointers to Python objects: not data, different on every rank)" if dt.kind == "O"
           else "")
    return f"{what} takes arrays of numbers or booleans; got dtype {dt} for {name}{why}"


__all__ = ["AgreedError", "DIGEST", "DifferentValuesError", "agree", "capture", "check_same", "digest", "digests",
           "plain_data_error", "ranks_by_value", "sleep_until_every_rank_arrives"]
