"""The watchdog's pieces that need no second process (the protocol itself runs under mpiexec in tests/faults):
which ranks a marked frame waits for, and the exit barrier on a one-rank world."""
from __future__ import annotations

import sys
import time

from mpi4py import MPI

from spmd_runtime.comm import run_simulated, watchdog


@watchdog.collective(lambda frame: "a test site")
def _site_with(comm):
    return watchdog.waited_for(sys._getframe())


@watchdog.collective(lambda frame: "a test site", peers=lambda frame: [frame.f_locals["dest"], 7])
def _site_with_rule(dest):
    return watchdog.waited_for(sys._getframe())


def test_a_frame_waits_for_the_members_of_its_mpi_communicator():
    assert _site_with(MPI.COMM_WORLD) == list(range(MPI.COMM_WORLD.Get_size()))
    assert _site_with(MPI.COMM_SELF) == [MPI.COMM_WORLD.Get_rank()]


def test_a_simulated_communicator_waits_for_no_other_process():
    assert run_simulated(2, _site_with) == [[], []]


def test_a_peers_rule_wins_and_no_communicator_means_every_rank():
    assert _site_with_rule(3) == [3, 7]
    assert _site_with(None) == list(range(MPI.COMM_WORLD.Get_size()))


def test_leaving_answers_exited_and_returns_once_every_rank_is_there():
    aborts = []
    dog = watchdog.Watchdog(MPI.COMM_WORLD.Dup(), aborts.append, None).start()
    assert dog._answer()[0] == "here"
    start = time.monotonic()
    dog.leave()
    assert time.monotonic() - start < 5 and not dog._thread.is_alive() and aborts == []
    assert dog._answer() == ("exited", "exited: its script ended (returned, or called sys.exit) and it waits at "
                                       "the job's exit barrier, so it joins no further collective")
    dog.comm.Free()


def test_raw_mpi_waits_outside_the_runtime_are_watched_sites():
    """scatter_from_root's broadcast and blocks and calibrate's timing rounds call MPI directly: an early exit or a
    hang there must meet the watchdog like any collective."""
    from spmd_runtime import calibrate, darray
    for fn in (darray._from_root, darray._scatter_blocks, calibrate._time):
        assert fn.__code__ in watchdog._SITES, fn.__qualname__
