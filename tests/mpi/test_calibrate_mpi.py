"""calibrate under real MPI: one fit per collective and group size dividing the world, the same on every rank,
and the CLI writes a profile the partitioner loads."""
import os

import pytest
from mpi4py import MPI

from spmd_runtime.calibrate import KINDS, calibrate

WORLD = MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi
def test_calibrate_fits_every_collective_per_group_size():
    doc = calibrate(MPI.COMM_WORLD, sizes=(256, 8192), repeats=2)
    ks = [k for k in range(2, WORLD + 1) if WORLD % k == 0]
    assert [(f["op"], f["k"]) for f in doc["fits"]] == [(op, k) for k in ks for op in KINDS]
    assert all(f["alpha"] >= 0 and f["beta"] >= 0 for f in doc["fits"])
    assert MPI.COMM_WORLD.allgather(doc["fits"]) == [doc["fits"]] * WORLD


@pytest.mark.mpi
def test_the_hardware_profile_counts_the_nodes_cores_and_leaves_blas_threads_as_they_were():
    from threadpoolctl import threadpool_info

    from spmd_runtime.calibrate import hardware_profile
    from spmd_runtime.exec.runner import Runtime
    Runtime.world()  # the process pinned as its first runtime pins it (comm/affinity.py; calibrate's fit between
    before = [i["num_threads"] for i in threadpool_info()]  # hosts makes one): calibrate's own moves are checked
    mask = os.sched_getaffinity(0)
    comm = MPI.COMM_WORLD
    hw = hardware_profile(calibrate(comm, sizes=(256, 8192), repeats=1), comm, repeats=1)
    assert [i["num_threads"] for i in threadpool_info()] == before  # one thread only while the GEMMs ran
    hosts = len(set(comm.allgather(MPI.Get_processor_name())))  # 2 on the emulated cluster (scripts/test.sh)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    assert hw.ranks_per_node == local and hw.nodes == (None if hosts == 1 else hosts)
    assert 1 <= hw.cores <= os.cpu_count() and hw.cores_per_node is not None  # the ranks' masks together, not one's
    assert comm.allgather((hw.flops, hw.cores)) == [(hw.flops, hw.cores)] * WORLD  # every rank has the same
    assert all(rate > 0 for _, rate in hw.flops)
    assert os.sched_getaffinity(0) == mask  # the slice's timing moved ranks onto one core and back
    assert comm.allgather(hw.slice_s) == [hw.slice_s] * WORLD and 0 <= hw.slice_s < 1  # 0: ranks on one core wait for nothing
    dims = [d for d, _ in hw.gemm_efficiency]
    assert dims == sorted(dims) and hw.gemm_efficiency[-1] == (512, 1.0)  # relative to the 512^3 rate
    assert all(0 < f <= 1 for _, f in hw.gemm_efficiency)
    cores = hw.cores_per_node
    if WORLD > 1:  # the wait timed as the job placed its ranks where they share cores, else two on one core
        [(per_core, curve)] = hw.slices
        assert per_core == (local / cores if local > cores else 2.0)
        from spmd_runtime.calibrate import SLICE_CHUNKS_S
        computes = [since for since, _ in curve]  # a point per chunk, each's compute per round its own
        assert len(curve) == len(SLICE_CHUNKS_S) and computes == sorted(set(computes)) and computes[0] > 0
        assert all(0 <= s < 1 for _, s in curve) and hw.slice_s == curve[-1][1]  # the longest chunk's as slice_s
    else:
        assert hw.slices == ()
    assert hw.overlap is False  # shared-memory MPI: messages move in the ranks' calls
    # per compute unit: the copy's bandwidth as one rank alone on a core measures it (the others sleeping), not
    # divided by the ranks taking turns on the cores (8 ranks on 2 cores measured 4.0 GB/s a rank, alone 15)
    from spmd_runtime.calibrate import COPY_BYTES, _best, _copy
    from spmd_runtime.train import run_on_root
    alone = comm.bcast(run_on_root(comm, lambda: 2 * COPY_BYTES / _best(_copy(), 3)), root=0)
    # (hosts emulated on one machine, scripts/emulate_cluster.sh, share its cores: a copy gets 1 / hosts more)
    assert 1 / (3 * hosts) < hw.memory_bandwidth / alone < 3


@pytest.mark.mpi
@pytest.mark.skipif(WORLD < 2, reason="the wait of ranks sharing cores needs two ranks")
def test_calibrate_sharing_only_adds_this_placements_costs_to_a_profile(tmp_path_factory):
    from spmd_runtime.__main__ import main
    from spmd_runtime.hardware import Hardware
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path_factory.mktemp("wait") / "hw.json") if comm.Get_rank() == 0 else None)
    if comm.Get_rank() == 0:
        Hardware.load("dgx-a100-80gb").with_sharing(9, 1.0, 2e-5).save(path)  # one measured before, at nine per core
    comm.Barrier()
    assert main(["calibrate", "--hardware", path, "--sharing-only", "--repeats", "1"]) == 0
    comm.Barrier()
    hw = Hardware.load(path)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # this host's ranks (2 of 4 on the emulated cluster)
    local, cores = node.Get_size(), len(set().union(*node.allgather(os.sched_getaffinity(0))))
    node.Free()
    per_core = local / cores if local > cores else 2.0
    assert [q for q, _ in hw.slices] == sorted([per_core, 9.0]) and dict(hw.slices)[9.0] == ((0.0, 1.0),)  # kept
    assert all(0 <= s < 1 for _, s in dict(hw.slices)[per_core])
    # the overhead per instruction is a placement's only where its ranks share cores as placed
    assert [q for q, _ in hw.overheads] == sorted([9.0] + ([per_core] if local > cores else []))
    assert main(["calibrate", "--hardware", path + ".missing", "--sharing-only"]) == 2  # every rank refuses alike
