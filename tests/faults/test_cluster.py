"""Ranks on different hosts: a cluster of 2 hosts x 2 ranks emulated on this machine (scripts/emulate_cluster.sh:
one network namespace per host with its own address, hostname and SysV IPC; hydra enters them as ssh would).

Skipped, saying why, where the machine cannot make namespaces (not root). Checks what depends on placement:
the launcher's node-local ranks, MPI's shared-memory split, the per-host watcher naming a rank killed on the
second host (by rank and host), and a program whose collectives cross hosts.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from spmd_runtime.hardware import Hardware

from test_faults import HYDRA, ROOT, Case, _launch, _named_by_the_watcher, one_rank_computes

SCRIPT = os.path.join(ROOT, "scripts", "emulate_cluster.sh")
ENV = dict(os.environ, SPMD_CLUSTER_PREFIX="spmdtest", SPMD_CLUSTER_NET="10.78.0",
           SPMD_CLUSTER_DIR=os.path.join("/tmp", f"spmd_cluster_test_{os.getpid()}"))


def _cluster(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], env=ENV, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def cluster_env():
    if not HYDRA:
        pytest.skip("the emulated cluster needs MPICH's mpiexec (hydra); scripts/test.sh installs it")
    can = _cluster("check")
    if can.returncode != 0:
        pytest.skip(can.stderr.strip())
    up = _cluster("up", "--nodes", "2", "--ranks-per-node", "2")
    assert up.returncode == 0, up.stderr
    exports = _cluster("env").stdout.split("export", 1)[1].split()
    yield dict(pair.split("=", 1) for pair in exports)
    _cluster("down")


PLACEMENT = """
    import socket
    from spmd_runtime.comm.affinity import local_rank_and_size
    shared = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    local = local_rank_and_size()
    total, = sr.run(program(), X)  # an all-reduce over the world: across the hosts
    print(f"PLACED {RANK} {socket.gethostname()} {local[0]} {local[1]} {shared} {float(np.asarray(total).sum())}",
          flush=True)
"""


def test_ranks_are_placed_on_their_hosts(cluster_env, tmp_path):
    r = _launch(Case("placement", PLACEMENT, n=4, env=cluster_env, succeeds=True), str(tmp_path))
    assert r["rc"] == 0, r["output"]
    # hydra may glue the ranks' lines together: read each record by its pattern, not by line
    placed = sorted(list(m) for m in re.findall(r"PLACED (\d+) (\S+) (\d+) (\d+) (\d+) ([-\d.e+]+)", r["output"]))
    want_total = placed[0][5] if placed else None
    assert [p[:5] for p in placed] == [["0", "node1", "0", "2", "2"], ["1", "node1", "1", "2", "2"],
                                       ["2", "node2", "0", "2", "2"], ["3", "node2", "1", "2", "2"]], r["output"]
    assert all(p[5] == want_total for p in placed), r["output"]  # every rank has the same reduced value
    # the predictor's placement (rank order, 2 per node) is the launcher's: a collective it prices as between
    # nodes is one whose ranks sit on different hosts here
    hw = Hardware.load("dgx-a100-80gb")
    hw = Hardware(hw.name, hw.flops, hw.memory_bytes, hw.memory_bandwidth, 2, hw.intra, hw.inter)
    assert [f"node{hw.node_of(int(p[0])) + 1}" for p in placed] == [p[1] for p in placed]
    assert hw.link_for([0, 1]) is hw.intra and hw.link_for([0, 2]) is hw.inter


def test_a_rank_killed_on_the_second_host_is_named_by_rank_and_host(cluster_env, tmp_path):
    case = Case("SIGKILL on node2", one_rank_computes(3), n=4, env=cluster_env, send=(3, signal.SIGKILL), victim=3)
    r = _launch(case, str(tmp_path))
    out = r["output"]
    assert r["rc"] not in (None, 0), out
    assert not r["orphans"], f"processes of the job left behind: {r['orphans']}"
    assert _named_by_the_watcher(out) == [3], f"the watcher of node2 must name rank 3 only:\n{out}"
    assert "watcher of the ranks on node2" in out, out
