"""The per-host watcher (comm/deathwatch.py) on real processes: it names a rank that ends without a word,
stays quiet when the rank said 'bye' or 'abort' first, and never outlives its ranks."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from spmd_runtime.comm import deathwatch

pytestmark = pytest.mark.skipif(not deathwatch.available(), reason="the watcher needs Linux pidfds")


@pytest.fixture
def victim():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_rank_killed_without_a_word_is_named_with_its_pid(victim, capfd):
    watcher = deathwatch.start({3: victim.pid}, "host-a")
    victim.kill()
    victim.wait()
    assert watcher.wait(timeout=20) == 0
    err = capfd.readouterr().err
    assert f"spmd_runtime (watcher of the ranks on host-a): rank 3 (pid {victim.pid}): killed" in err
    assert "it ended before the job's exit barrier, and the job cannot complete without it" in err


@pytest.mark.parametrize("word", ["bye", "abort"])
def test_a_rank_that_said_why_it_ends_gets_no_report(victim, capfd, word):
    watcher = deathwatch.start({0: victim.pid, 1: os.getpid()}, "host-a")
    deathwatch.tell(os.getpid(), word)  # the watcher's address is keyed by the pid of the rank that started it
    assert watcher.wait(timeout=20) == 0  # it leaves at once, before any rank ends
    victim.kill()
    assert capfd.readouterr().err == ""


def test_a_rank_gone_before_the_watcher_starts_is_reported(capfd):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watcher = deathwatch.start({5: gone.pid}, "host-b")
    assert watcher.wait(timeout=20) == 0
    assert f"rank 5 (pid {gone.pid}): it was gone when the watcher started" in capfd.readouterr().err


def test_ranks_ending_just_after_the_first_are_named_too(capfd):
    """The rank killed first can finish exiting after the launcher has already killed a bystander (a rank
    killed while writing a file): the watcher names every rank that ends within its grace time, not only
    the first pidfd it saw."""
    first, second = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    try:
        watcher = deathwatch.start({0: first.pid, 1: second.pid}, "host-c")
        first.kill()
        first.wait()
        time.sleep(getattr(deathwatch, "GRACE_S", 0.2) / 4)
        second.kill()
        second.wait()
        assert watcher.wait(timeout=20) == 0
        err = capfd.readouterr().err
        assert f"rank 0 (pid {first.pid}): killed" in err and f"rank 1 (pid {second.pid}): killed" in err, err
        assert "together with others" in err
    finally:
        for p in (first, second):
            p.kill()
            p.wait()
