"""Ranks pinned to their share of a node's cores (comm/affinity.py): which cores, and when left alone."""
import os

import pytest

from spmd_runtime.comm import affinity


@pytest.mark.parametrize("rank, size, allowed, online, want", [
    (0, 2, [0, 1], 2, [0]), (1, 2, [0, 1], 2, [1]),  # one core each
    (1, 2, [0, 1, 2, 3], 4, [2, 3]),  # two each: a rank's BLAS threads keep theirs
    (2, 3, list(range(8)), 8, [4, 5]),  # 8 // 3 = 2 each, the last two cores left over
    (0, 1, [0, 1], 2, None),  # alone: the whole node
    (3, 8, [0, 1], 2, None),  # oversubscribed: the scheduler balances
    (0, 2, [1], 2, None),  # the launcher or the user already narrowed the CPU set
    (2, 2, [0, 1], 2, None),  # a rank outside the count it was given: left alone
])
def test_each_local_rank_takes_its_contiguous_share(rank, size, allowed, online, want):
    assert affinity.cores_for(rank, size, allowed, online) == want


@pytest.mark.parametrize("environ, want", [
    ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2)),  # MPICH's hydra
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (3, 4)),  # Open MPI
    ({"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "8"}, (0, 8)),
    ({"MPI_LOCALRANKID": "1"}, None),  # no count: nothing to divide by
    ({}, None),
])
def test_the_local_rank_and_count_come_from_the_launchers_environment(environ, want):
    assert affinity.local_rank_and_size(environ) == want


def test_a_process_without_a_launcher_is_left_alone_and_a_bad_setting_is_refused(monkeypatch):
    for rank_var, size_var in affinity.LOCAL_VARS:
        monkeypatch.delenv(rank_var, raising=False)
        monkeypatch.delenv(size_var, raising=False)
    before = os.sched_getaffinity(0)
    assert affinity.bind_to_cores() is None and os.sched_getaffinity(0) == before
    monkeypatch.setenv(affinity.BIND_ENV, "socket")
    with pytest.raises(ValueError, match="SPMD_BIND must be 'core' or 'none'; got 'socket'"):
        affinity.bind_to_cores()
