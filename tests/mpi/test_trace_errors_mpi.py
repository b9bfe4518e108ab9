"""A failure while tracing under sr.jit, under real MPI (issue 28): every rank raises the failure's own type,
its message naming the user's file and line, the same on every rank.

Run: ``mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_trace_errors_mpi.py -p no:cacheprovider``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
MESH = sr.Mesh((N,), ("x",))
HERE = os.path.abspath(__file__)


def model(x):
    return snp.tanh(x).no_such_attribute  # the failing line


def failing_line() -> int:
    with open(HERE) as f:
        return next(k + 1 for k, line in enumerate(f) if line.rstrip().endswith("# the failing line"))


def test_trace_error_keeps_its_type_and_names_the_users_line_on_every_rank():
    try:
        sr.jit(model, mesh=MESH)(np.ones(2 * N))
        mine = None
    except AttributeError as e:
        mine = (type(e).__mro__[1].__name__, str(e), e.ranks)
    every = WORLD.allgather(mine)
    assert every[0] is not None and every == [every[0]] * N, every
    kind, message, ranks = every[0]
    assert kind == "AttributeError" and ranks == list(range(N))
    assert f"{HERE}:{failing_line()}" in message and "no_such_attribute" in message


def test_one_rank_failing_raises_its_type_on_every_rank():
    def rank_dependent(x):
        if RANK == N - 1:
            raise LookupError("only the last rank fails")  # the last rank's line
        return x * 2.0
    try:
        sr.jit(rank_dependent, mesh=MESH)(np.ones(2 * N))
        mine = None
    except LookupError as e:
        mine = str(e)
    every = WORLD.allgather(mine)
    assert every[0] is not None and every == [every[0]] * N, every
    assert f"rank {N - 1}: LookupError: only the last rank fails (at {HERE}:" in every[0]
