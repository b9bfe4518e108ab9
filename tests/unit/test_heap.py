"""exec/heap.py: after keep_freed_memory(), memory a process frees is reused without faulting pages in again."""
import subprocess
import sys

import pytest

from spmd_runtime.exec import heap

# Four rounds of: 24 arrays of 1 MiB (NumPy asks for huge pages only from 4 MiB) allocated, every page
# touched, all freed (by default glibc trims the freed top of its heap, or unmaps mmap'd chunks); prints the
# minor faults of the last three rounds.
PROBE = """
import resource, sys
import numpy as np
from spmd_runtime.exec.heap import keep_freed_memory
print(keep_freed_memory(), end=" ")
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(1 << 20, np.uint8) for _ in range(24)]
    for x in arrays:
        x[::4096] = 1
    del arrays, x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def probe(keep: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**__import__("os").environ, heap.KEEP_ENV: keep},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's mallopt only")
def test_freed_memory_is_reused_without_page_faults_and_the_switch_turns_it_off():
    kept, faults_kept = probe("1")
    left, faults_default = probe("0")
    assert (kept, left) == ("True", "False")
    assert faults_kept < 100, faults_kept  # the three later rounds reuse the first round's pages
    assert faults_default > 3 * 5000, faults_default  # 6144 pages per round faulted in again


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    assert heap.keep_freed_memory() is False
