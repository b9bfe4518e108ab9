"""sr.autotune under real MPI: autoshard's front-runners timed on the job's ranks, the same table on every rank."""
import pytest
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.hardware import Hardware

WORLD = MPI.COMM_WORLD.Get_size()
CFG = sr.LMConfig(1, 32, 2, 64, 64, 16, 6 if WORLD == 3 else 8)  # a batch every data axis divides


@pytest.mark.mpi
def test_autotune_times_each_presets_best_and_sorts_by_the_measured_step():
    comm = MPI.COMM_WORLD
    hw = Hardware.load("dgx-a100-80gb").with_placement(WORLD)
    found = sr.autoshard(CFG, WORLD, hw, presets=["dp", "fsdp", "megatron"], verbose=False)
    timed = sr.autotune(found, CFG, comm, rounds=2, steps=1, warmup=0, verbose=False)
    assert 1 <= len(timed) <= 3 and len({t.candidate.preset for t in timed}) == len(timed)
    assert all(len(t.rounds) == 2 and min(t.rounds) > 0 for t in timed)
    assert [t.best_s for t in timed] == sorted(t.best_s for t in timed)  # the fastest measured first
    # every rank took the slowest rank's step: the same figures, the same order
    assert comm.allgather([(t.candidate.preset, t.rounds) for t in timed]) == \
        [[(t.candidate.preset, t.rounds) for t in timed]] * WORLD
