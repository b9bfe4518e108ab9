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


HOLDER = """
import sys, time
from spmd_runtime.comm import deathwatch
lifelines, index, heap_mb = (int(a) for a in sys.stdin.readline().split())
deathwatch.hold(lifelines, index)
heap = bytearray(b"x" * (heap_mb << 20))  # every page touched: the kernel frees it before the files close
print("held", flush=True)
time.sleep(60)
"""


def _holder():
    return subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_only_the_rank_that_ended_first_is_named_not_the_bystanders_the_launcher_killed_after_it(capfd):
    """Ranks holding their lifelines (as jobguard makes every rank do): the victim frees a large heap before its
    files close; once they have (the launcher's cue: its stdout), the "launcher" kills the bystander, which ends
    first. The watcher names the victim only, with its signal, and removes the semaphore set."""
    victim, bystander = _holder(), _holder()
    try:
        watcher = deathwatch.start({0: victim.pid, 1: bystander.pid}, "host-d")
        assert watcher.lifelines is not None, "no SysV semaphores here: the watcher fell back to the pidfds"
        for index, (proc, heap_mb) in enumerate([(victim, 400), (bystander, 1)]):
            proc.stdin.write(f"{watcher.lifelines} {index} {heap_mb}\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "held\n"
        victim.kill()
        victim.stdout.read()  # EOF: the victim's files are closed, what a launcher reacts to
        bystander.kill()
        assert watcher.wait(timeout=20) == 0
        err = capfd.readouterr().err
        assert f"rank 0 (pid {victim.pid}): killed by signal SIGKILL; it ended before the job's exit barrier" in err
        assert "rank 1" not in err and "together with others" not in err, err
        with pytest.raises(OSError):  # the set is gone: the kernel object does not outlive the job
            deathwatch._semop(watcher.lifelines, (0, 1, 0))
    finally:
        for p in (victim, bystander):
            p.kill()
            p.wait()


def test_without_lifelines_ranks_ending_just_after_the_first_are_named_too(capfd):
    """Ranks that never held a lifeline (no SysV semaphores): the rank killed first can finish exiting after the
    launcher has already killed a bystander (a rank killed while writing a file), so the watcher names every
    rank that ends within its grace time, not only the first pidfd it saw."""
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
