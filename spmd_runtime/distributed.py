"""``sr.distributed``: start this process's part of an MPI job explicitly (JAX's ``jax.distributed``).

Importing ``spmd_runtime`` changes nothing in the process: no signal handler, no excepthook, no thread, no
communicator. The job guard (comm/jobguard.py: a fault on one rank ends the whole job, naming the rank) is
installed by ``initialize()`` or, failing that, by the runtime's first use of MPI. Call ``initialize()`` first
thing in a script run under ``mpiexec``, so that a fault before the first run (an exception, a rank that exits
or is killed) ends the job too.
"""
from __future__ import annotations

from .comm import jobguard


def initialize() -> None:
    """Collective (every rank of the job calls it): install the job guard when this is an MPI job of more than
    one process (``SPMD_ABORT_ON_ERROR=0``: not); later calls, or calls after the runtime already used MPI, do
    nothing."""
    jobguard.install()


def is_initialized() -> bool:
    """Whether ``initialize()`` (or the runtime's first use of MPI) already ran in this process."""
    return jobguard.decided()


__all__ = ["initialize", "is_initialized"]
