"""Hardware profiles (spmd_runtime/hardware.py) and the step predictor (spmd_runtime/estimate.py)."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.collective_kinds import KINDS
from spmd_runtime.hardware import Hardware, Link, shipped_names

A100 = Hardware.load("dgx-a100-80gb")


def test_shipped_profiles_carry_the_datasheet_values():
    assert shipped_names() == ["dgx-a100-80gb", "dgx-h100", "tpu-v3"]
    assert A100.peak_flops("bfloat16") == 312e12 and A100.peak_flops("float32") == 19.5e12
    assert A100.ranks_per_node == 8 and A100.memory_bytes == 80 * 2**30
    assert A100.intra.bandwidth == 300e9 and A100.inter.bandwidth == 25e9  # NVLink 3 each way; one HDR NIC per GPU
    h100 = Hardware.load("dgx-h100")
    assert h100.peak_flops("bfloat16") == 989.4e12 and h100.inter.bandwidth == 50e9
    assert all(Hardware.load(n).sources.get("device") for n in shipped_names())  # every profile says where from


def test_profile_round_trips_through_its_file(tmp_path):
    path = tmp_path / "hw.json"
    A100.with_nodes(4).save(path)
    again = Hardware.load(path)
    assert again == A100.with_nodes(4) and again.devices == 32 and again.sources == A100.sources


def _doc():
    return json.loads(open(sr.hardware.os.path.join(sr.hardware.SHIPPED, "dgx-a100-80gb.json")).read())


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["device"].pop("memory_bytes"), "device.memory_bytes is required"),
    (lambda d: d["network"].update(bandwidth=-1), "network.bandwidth must be a positive number; got -1.0"),
    (lambda d: d["node"].update(ranks=0), "node.ranks must be a whole number of at least 1; got 0"),
    (lambda d: d["node"].update(cores=-2), "node.cores must be a whole number of at least 1; got -2"),
    (lambda d: d["node"]["link"].update(latency="3us"), "node.link.latency must be a number; got '3us'"),
    (lambda d: d["device"].update(flops={}), "device.flops needs at least one dtype"),
    (lambda d: d.update(format="other"), "has format 'spmd_runtime.hardware'; got 'other'"),
])
def test_bad_profiles_name_the_field(edit, message):
    doc = copy.deepcopy(_doc())
    edit(doc)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Hardware.from_json(doc, "bad.json")


def test_unknown_profile_names_the_shipped_ones():
    with pytest.raises(ValueError, match="dgx-a100-80gb, dgx-h100, tpu-v3"):
        Hardware.load("dgx-a300")


def _program(fn, specs, mesh, **kw):
    return sr.partition(sr.trace(fn, *specs), mesh, **kw)


def test_einsum_and_conv_flops_are_exact():
    mesh = sr.Mesh((1,), ("x",))
    mm = _program(lambda a, b: a @ b, [sr.TensorSpec((8, 16)), sr.TensorSpec((16, 32))], mesh)
    assert mm.estimate(A100).flops == 2 * 8 * 16 * 32
    conv = _program(lambda x, k: snp.conv(x, k), [sr.TensorSpec((2, 3, 10, 10)), sr.TensorSpec((4, 3, 3, 3))], mesh)
    assert conv.estimate(A100).flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)  # outputs x (in channels x taps)


def test_a_matmul_runs_at_the_roofline():
    mesh = sr.Mesh((1,), ("x",))
    n = 4096
    mm = _program(lambda a, b: a @ b, [sr.TensorSpec((n, n), "bfloat16")] * 2, mesh)
    e = mm.estimate(A100)
    want = 2 * n**3 / 312e12 + A100.overhead_s  # compute-bound: FLOPs over the bf16 peak
    assert e.step_s == pytest.approx(want, rel=1e-6) and e.exposed_comm_s == 0


def test_collectives_take_the_link_their_group_spans():
    mesh = sr.Mesh((2, 4), ("d", "m"))
    hw = A100.with_nodes(None)
    hw = Hardware(hw.name, hw.flops, hw.memory_bytes, hw.memory_bandwidth, 4, hw.intra, hw.inter)  # 4 per node

    def over(axis):
        p = _program(lambda x: snp.sum(x, axis=0), [sr.TensorSpec((64, 1024))], mesh,
                     in_specs=[((axis,), None)], overlap=False)
        return [c for c in p.estimate(hw).instrs if c.comm_s > 0]
    within, across = over("m"), over("d")  # ranks 0..3 on node 0; ranks 0 and 4 on two nodes
    assert [c.link for c in within] == ["node"] and [c.link for c in across] == ["network"]
    wire = 2 * (2 - 1) / 2 * 1024 * 4
    assert across[0].comm_s == pytest.approx(2 * hw.inter.latency + wire / hw.inter.bandwidth)
    wire = 2 * (4 - 1) / 4 * 1024 * 4
    # Rabenseifner's all-reduce: log2(4) halving + log2(4) doubling steps, not a ring's 2 (4 - 1)
    assert within[0].comm_s == pytest.approx(4 * hw.intra.latency + wire / hw.intra.bandwidth)


@pytest.mark.parametrize("kind, k, messages", [
    ("all_reduce", 2, 2), ("all_reduce", 8, 6), ("all_reduce", 6, 6), ("all_reduce", 2048, 22),
    ("all_gather", 8, 3), ("reduce_scatter", 3, 2), ("broadcast", 1024, 10), ("all_to_all", 8, 7),
    ("all_to_allv", 4, 3), ("collective_permute", 64, 1), ("all_reduce", 1, 0)])
def test_latency_terms_grow_with_the_log_of_the_group(kind, k, messages):
    assert KINDS[kind].messages(k) == messages


def test_async_collectives_hide_behind_independent_compute():
    mesh = sr.Mesh((2,), ("x",))
    slow = Hardware("slow-link", (("float32", 1e12),), 2**30, 1e12, 1, Link(1e8, 1e-5), Link(1e8, 1e-5))

    def f(x, a, b):
        return snp.sum(x, axis=0), a @ b  # the all-reduce and the matmul do not depend on each other
    specs = [sr.TensorSpec((64, 4096)), sr.TensorSpec((512, 512)), sr.TensorSpec((512, 512))]
    kw = dict(in_specs=[("x", None), None, None])
    blocking = _program(f, specs, mesh, overlap=False, **kw).estimate(slow)
    overlapped = _program(f, specs, mesh, overlap=True, **kw).estimate(slow)
    assert blocking.comm_s == pytest.approx(overlapped.comm_s)
    assert blocking.step_s == pytest.approx(blocking.compute_s + blocking.comm_s, rel=1e-9)
    assert overlapped.step_s < blocking.step_s and overlapped.exposed_comm_s < blocking.exposed_comm_s


def test_scan_bodies_count_once_per_iteration():
    mesh = sr.Mesh((1,), ("x",))

    def f(w, xs):
        return sr.scan(lambda c, x: (c @ w + x, None), xs[0], xs)[0]
    p = _program(f, [sr.TensorSpec((32, 32)), sr.TensorSpec((5, 32, 32))], mesh)
    assert p.estimate(A100).flops >= 5 * 2 * 32 ** 3  # five matmuls (plus the adds)
    assert p.estimate(A100).flops < 6 * 2 * 32 ** 3


def test_the_verdict_says_when_a_program_does_not_fit():
    mesh = sr.Mesh((1,), ("x",))
    tiny = Hardware("tiny", (("float32", 1e12),), 1 << 20, 1e12, 1, Link(1e9, 0), Link(1e9, 0))
    e = _program(lambda a: a * 2.0, [sr.TensorSpec((1024, 1024))], mesh).estimate(tiny)
    assert not e.fits and e.verdict == "does not fit: needs 0.01 GiB of 0.00 GiB"
    assert e.peak_bytes == 2 * 1024 * 1024 * 4


def test_a_mesh_must_match_the_profiles_device_count():
    mesh = sr.Mesh((2, 4), ("d", "m"))
    p = _program(lambda a: a * 2.0, [sr.TensorSpec((8, 8))], mesh)
    with pytest.raises(ValueError, match="2 nodes x 8 ranks = 16 devices; got a mesh of 8"):
        p.estimate(A100.with_nodes(2))
    assert p.estimate(A100.with_nodes(1)).step_s > 0  # 8 = 1 x 8: accepted
    with pytest.raises(ValueError, match="rank must be one of the mesh's 0..7; got 8"):
        p.estimate(A100, rank=8)


def test_throughput_and_mfu_follow_the_step():
    mesh = sr.Mesh((1,), ("x",))
    n = 4096
    e = _program(lambda a, b: a @ b, [sr.TensorSpec((n, n), "bfloat16")] * 2, mesh).estimate(A100.with_nodes(None))
    assert e.tokens_per_s(1000) == pytest.approx(1000 / e.step_s)
    assert e.mfu(2 * n**3 * 8) == pytest.approx(2 * n**3 * 8 / (e.step_s * 312e12 * 8))
    assert np.isfinite(e.mfu(1.0))


CPU = Hardware("two-cores", (("float32", 1e11),), 2**34, 1e12, 2, Link(1e10, 0), Link(1e10, 0), overhead_s=0.0,
               cores_per_node=2)


def _matmul_and_add(mesh):
    def f(a, b):
        return a @ b, a + 1.0
    return _program(f, [sr.TensorSpec((256 * mesh.size, 256)), sr.TensorSpec((256, 256))], mesh,
                    in_specs=[(mesh.axis_names[0], None), None])


def _seconds(e, op):
    return sum(c.compute_s for c in e.instrs if c.op == op)


@pytest.mark.parametrize("ranks, threads, blas, other", [
    (2, 1, 1.0, 1.0),  # one rank per core: the profile's rate
    (8, 1, 4.0, 4.0),  # four ranks take turns on each core: everything 4x slower
    (1, 2, 0.5, 1.0),  # one rank, two BLAS threads: the matmul on both cores, the add on one
    (1, 1, 1.0, 1.0),  # one rank, one thread: the second core idles
])
def test_ranks_sharing_cores_or_threads_spanning_them_scale_compute(ranks, threads, blas, other):
    base = _matmul_and_add(sr.Mesh((2,), ("x",))).estimate(CPU, 0)
    mesh = sr.Mesh((ranks,), ("x",))
    placed = _matmul_and_add(mesh).estimate(CPU.with_placement(ranks, threads), 0)
    assert _seconds(placed, "einsum") == pytest.approx(blas * _seconds(base, "einsum"), rel=1e-9)
    assert _seconds(placed, "add") == pytest.approx(other * _seconds(base, "add"), rel=1e-9)


def test_placement_keeps_the_cores_and_round_trips_them(tmp_path):
    assert CPU.with_placement(8).cores == 2 and CPU.with_placement(8).ranks_per_node == 8
    assert A100.cores == 8 and A100.cores_per_node is None  # a GPU node: one device per rank
    CPU.save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json") == CPU
    with pytest.raises(ValueError, match="at least 1 rank per node and 1 thread per rank; got 0 and 1"):
        CPU.with_placement(0)


def test_ranks_sharing_a_core_copy_their_shared_memory_messages_in_turn():
    def comm_s(ranks):
        mesh = sr.Mesh((ranks,), ("x",))
        p = _program(lambda x: snp.sum(x, axis=0), [sr.TensorSpec((ranks * 4, 4096))], mesh,
                     in_specs=[("x", None)], overlap=False)
        return sum(c.comm_s for c in p.estimate(CPU.with_placement(ranks), 0).instrs)
    k8 = 2 * 7 / 8 * 4096 * 4 / CPU.intra.bandwidth  # the ring all-reduce's wire seconds at 8 (latency 0)
    assert comm_s(8) == pytest.approx(4 * k8, rel=1e-9)  # four ranks per core: four times as long
    k2 = 2 * 1 / 2 * 4096 * 4 / CPU.intra.bandwidth
    assert comm_s(2) == pytest.approx(k2, rel=1e-9)


@pytest.mark.parametrize("ranks, k, want", [
    (1, 1, 0.0),  # one rank: no peer
    (2, 2, 0.0),  # a core per rank: a peer is always running
    (4, 1, 0.0),  # sharing cores, but a group of one waits for nobody
    (3, 3, 1 / 3),  # 1.5 ranks per core: the last peer is off its core a third of the time
    (4, 4, 1 / 2),  # two per core: half the time, then one slice
    (8, 8, 3 / 4),  # four per core
    (8, 2, 3 / 4),  # the group's size does not change it: the peers off their cores come back at one tick
])
def test_a_blocking_collective_waits_for_descheduled_peers_only_when_ranks_share_cores(ranks, k, want):
    hw = CPU.with_placement(ranks)
    assert hw.sync_wait_s(0, ranks, k) == pytest.approx(want * hw.slice_s, rel=1e-12)
    assert A100.sync_wait_s(0, 8, 8) == 0.0  # a GPU per rank


def test_the_wait_grows_with_ranks_per_core():
    waits = [CPU.with_placement(n).sync_wait_s(0, n, n) for n in (2, 3, 4, 8, 16)]
    assert waits[0] == 0 and all(a < b for a, b in zip(waits, waits[1:]))


def _reductions(mesh, count: int, overlap: bool):
    def f(x):
        return tuple(snp.sum(x * float(i + 1), axis=0) for i in range(count))
    return _program(f, [sr.TensorSpec((mesh.size * 4, 64))], mesh, in_specs=[("x", None)], overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_blocking_collective_or_done_pays_the_wait_once(overlap):
    waits = {}
    for ranks in (2, 8):
        mesh = sr.Mesh((ranks,), ("x",))
        for count in (1, 3):
            hw = CPU.with_placement(ranks)
            e = _reductions(mesh, count, overlap).estimate(hw, 0)
            syncs = sum(c.op in KINDS or c.op.endswith("_done") for c in e.instrs if c.wait_s)
            if count > 1:  # each schedule is what it claims (the last reduction is blocking either way)
                assert any(c.op.endswith("_start") for c in e.instrs) == overlap
            waits[ranks, count] = e.wait_s
            if ranks == 8:
                assert syncs == count and e.wait_s == pytest.approx(count * hw.sync_wait_s(0, 8, 8), rel=1e-12)
                assert e.step_s >= e.compute_s + e.wait_s  # the waits are on the rank's critical path
    assert waits[2, 1] == waits[2, 3] == 0.0  # a core per rank: no wait however many collectives
    assert 0 < waits[8, 1] < waits[8, 3]  # more blocking collectives, more waiting


def test_a_profile_keeps_its_measured_slice_and_rejects_a_negative_one(tmp_path):
    measured = dataclasses.replace(CPU, slice_s=0.012)
    measured.save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json").slice_s == 0.012
    assert Hardware.load("dgx-a100-80gb").slice_s == sr.hardware.DEFAULT_SLICE_S  # not in the file: the default
    doc = _doc()
    doc["node"]["slice_s"] = -1
    with pytest.raises(ValueError, match=r"node\.slice_s must be zero or more; got -1\.0"):
        Hardware.from_json(doc, "bad.json")


def test_a_cpu_host_moves_its_messages_itself_and_a_gpu_node_overlaps_them(tmp_path):
    assert A100.overlap and not Hardware.from_json({**_doc(), "node": {**_doc()["node"], "cores": 2}}).overlap
    mesh = sr.Mesh((2,), ("x",))
    program = _reductions(mesh, 3, overlap=True)
    overlapped = program.estimate(CPU, 0)
    in_calls = program.estimate(dataclasses.replace(CPU, overlap=False), 0)
    assert overlapped.comm_s == in_calls.comm_s > 0
    assert in_calls.step_s == pytest.approx(in_calls.compute_s + in_calls.comm_s, rel=1e-9)  # nothing hidden
    assert overlapped.step_s < in_calls.step_s  # the starts' collectives ran behind the next reductions
    dataclasses.replace(CPU, overlap=False).save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json").overlap is False
    doc = _doc()
    doc["node"]["overlap"] = "no"
    with pytest.raises(ValueError, match="node.overlap must be true or false; got 'no'"):
        Hardware.from_json(doc, "bad.json")


NARROW = dataclasses.replace(A100, gemm_efficiency=((32, 0.5), (128, 0.8), (512, 1.0)))


@pytest.mark.parametrize("smallest, want", [(8, 0.5), (32, 0.5), (64, 0.65), (128, 0.8), (256, 0.9), (4096, 1.0)])
def test_a_matmul_with_a_small_dim_runs_at_the_profiles_fraction_of_the_peak(smallest, want):
    assert NARROW.gemm_fraction(smallest) == pytest.approx(want, rel=1e-12)  # log-linear, the ends held
    assert A100.gemm_fraction(smallest) == 1.0  # no points: the peak at every size


@pytest.mark.parametrize("spec, shapes, smallest", [
    ("bqhd,bkhd->bhqk", [(4, 1024, 8, 32), (4, 1024, 8, 32)], 32),  # attention's scores: summed over the head dim
    ("bhqk,bkhd->bqhd", [(4, 8, 1024, 1024), (4, 1024, 8, 32)], 32),  # its values: 32 columns
    ("sd,df->sf", [(4096, 2048), (2048, 128)], 128),  # a narrow weight
    ("sd,sf->df", [(4096, 2048), (4096, 4096)], 2048),  # a weight's gradient, all dims large
])
def test_an_einsums_smallest_matmul_dim_sets_its_rate(spec, shapes, smallest):
    mesh = sr.Mesh((1,), ("x",))
    program = _program(lambda a, b: snp.einsum(spec, a, b), [sr.TensorSpec(s, "bfloat16") for s in shapes], mesh)
    compute_bound = dict(memory_bandwidth=1e18)  # attention at head dim 32 is memory-bound on an A100
    full = _seconds(program.estimate(dataclasses.replace(A100, **compute_bound)), "einsum")
    narrow = _seconds(program.estimate(dataclasses.replace(NARROW, **compute_bound)), "einsum")
    overhead = A100.overhead_s
    assert (narrow - overhead) == pytest.approx((full - overhead) / NARROW.gemm_fraction(smallest), rel=1e-6)


def test_a_product_einsum_is_no_matmul_and_keeps_its_rate():
    mesh = sr.Mesh((1,), ("x",))
    program = _program(lambda a, b: snp.einsum("sd,d->sd", a, b), [sr.TensorSpec((4096, 16)), sr.TensorSpec((16,))],
                       mesh)
    compute_bound = dict(memory_bandwidth=1e18)  # else its bytes price it either way
    assert program.estimate(dataclasses.replace(NARROW, **compute_bound)).step_s == \
        program.estimate(dataclasses.replace(A100, **compute_bound)).step_s


def test_gemm_efficiency_round_trips_and_bad_points_name_the_field(tmp_path):
    NARROW.save(tmp_path / "narrow.json")
    assert Hardware.load(tmp_path / "narrow.json").gemm_efficiency == NARROW.gemm_efficiency
    for points, message in [({"32": 1.5}, r"device\.gemm_efficiency\.32 is a fraction of the peak, at most 1; "
                                           r"got 1\.5"),
                            ({"32": 0}, r"device\.gemm_efficiency\.32 must be a positive number; got 0\.0"),
                            ({"wide": 0.5}, r"keyed by a matmul's smallest dim, a whole number of at least 1; got "
                                            r"key 'wide'")]:
        doc = _doc()
        doc["device"]["gemm_efficiency"] = points
        with pytest.raises(ValueError, match=message):
            Hardware.from_json(doc, "bad.json")


def test_a_wait_measured_per_sharing_is_interpolated_and_replaces_the_one_slice(tmp_path):
    measured = CPU.with_sharing(2, 2e-4).with_sharing(4, 1.6e-3)
    assert measured.slices == ((2.0, ((0.0, 2e-4),)), (4.0, ((0.0, 1.6e-3),)))  # a number: the same after any compute
    assert measured.slice_at(3) == pytest.approx(9e-4) and measured.slice_at(8) == 1.6e-3  # the ends held
    assert CPU.slice_at(4) == CPU.slice_s  # none measured: the one slice
    # four ranks per core (8 ranks on 2 cores) wait 3/4 of the slice measured at four per core, not the default's
    assert measured.with_placement(8).sync_wait_s(0, 8, 8) == pytest.approx(0.75 * 1.6e-3)
    assert measured.with_placement(4).sync_wait_s(0, 4, 4) == pytest.approx(0.5 * 2e-4)
    assert measured.with_sharing(2, 3e-4).slices == ((2.0, ((0.0, 3e-4),)), (4.0, ((0.0, 1.6e-3),)))  # replaced
    measured.save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json").slices == measured.slices


# at four per core the slice grows with the compute since the last sync (calibrate's chunks), at two it is flat
GROWING = CPU.with_sharing(4, ((1e-3, 1e-3), (5e-3, 5e-3), (2e-2, 8e-3))).with_sharing(2, 2e-4)


@pytest.mark.parametrize("per_core, since, want", [
    (4, 0.0, 1e-3),  # before the first point: its value
    (4, 3e-3, 3e-3),  # between points: linear in the compute
    (4, 0.1, 8e-3),  # beyond the last: its value
    (3, 3e-3, (3e-3 + 2e-4) / 2),  # between sharings: each curve at the compute, then linear in the ranks per core
    (2, 0.1, 2e-4),
])
def test_a_slice_measured_after_chunks_of_compute_grows_with_the_compute_since_the_last_sync(per_core, since, want):
    assert GROWING.slice_at(per_core, since) == pytest.approx(want, rel=1e-12)
    assert GROWING.with_placement(int(2 * per_core)).sync_wait_s(0, int(2 * per_core), 2, since) == pytest.approx(
        want * (per_core - 1) / per_core, rel=1e-12)


def test_a_curve_of_slices_survives_its_file(tmp_path):
    GROWING.save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json").slices == GROWING.slices
    assert json.loads((tmp_path / "cpu.json").read_text())["node"]["slice_s_by_ranks_per_core"] == {
        "2": 2e-4, "4": [[1e-3, 1e-3], [5e-3, 5e-3], [2e-2, 8e-3]]}


def _compute_then_reduce(mesh, work: int):
    """``work`` dependent multiplies of each rank's [64, 64] block, then a sum over the mesh: a chunk, a sync."""
    def f(x):
        for _ in range(work):
            x = x * 0.5
        return snp.sum(x, axis=0)
    return _program(f, [sr.TensorSpec((mesh.size * 64, 64))], mesh, in_specs=[("x", None)], fuse=False)


def test_the_wait_at_a_sync_follows_the_compute_before_it():
    mesh = sr.Mesh((8,), ("x",))
    hw = CPU.with_sharing(4, ((0.0, 0.0), (1e-4, 1e-3))).with_placement(8)  # 10 x the compute, to 0.1 ms of it
    estimates = [_compute_then_reduce(mesh, work).estimate(hw, 0) for work in (1, 40)]
    for e in estimates:  # each wait is the curve's at the compute since the start (the first sync)
        assert e.wait_s == pytest.approx(hw.sync_wait_s(0, 8, 8, e.compute_s), rel=1e-9)
    assert 0 < estimates[0].wait_s < estimates[1].wait_s
    flat = CPU.with_sharing(4, 1e-3).with_placement(8)  # a number: the same wait after any compute
    assert [_compute_then_reduce(mesh, w).estimate(flat, 0).wait_s for w in (1, 40)] == [0.75e-3] * 2


@pytest.mark.parametrize("points, message", [
    ({"1": 1e-3}, r"keyed by ranks per core, a number above 1; got key '1'"),
    ({"two": 1e-3}, r"keyed by ranks per core, a number above 1; got key 'two'"),
    ({"1.5": -1}, r"slice_s_by_ranks_per_core\['1\.5'\] must be zero or more seconds, or a list .*; got -1"),
    ({"4": [[1e-3, 1e-4], [1e-4, 2e-4]]}, r"\['4'\] .* the compute ascending; got \[\[0\.001, 0\.0001\], \[0\.0001"),
    ({"4": [[1e-3, -1]]}, r"pairs of zero or more, .*; got \[\[0\.001, -1\]\]"),
    ({"4": []}, r"got \[\]"),
    ({"4": [[1e-3]]}, r"got \[\[0\.001\]\]"),
])
def test_bad_waits_per_sharing_name_the_field(points, message):
    doc = _doc()
    doc["node"]["slice_s_by_ranks_per_core"] = points
    with pytest.raises(ValueError, match=message):
        Hardware.from_json(doc, "bad.json")


def test_an_instruction_costs_its_overhead_as_measured_at_the_ranks_sharing(tmp_path):
    measured = dataclasses.replace(CPU, overhead_s=5e-6).with_sharing(4, 0.0, 1.4e-5)
    assert measured.overhead_at(1) == 5e-6 and measured.overhead_at(0.5) == 5e-6  # a core or more: alone
    assert measured.overhead_at(2.5) == pytest.approx(9.5e-6) and measured.overhead_at(8) == 1.4e-5
    assert measured.with_sharing(2, 0.0).overheads == measured.overheads  # a slice alone leaves them
    mesh = sr.Mesh((8,), ("x",))
    program = _program(lambda x: x + 1.0, [sr.TensorSpec((8, 2))], mesh, in_specs=[("x", None)], fuse=False)
    adds = lambda hw: [c.compute_s for c in program.estimate(hw.with_placement(8), 0).instrs if c.op == "add"]  # noqa
    base, shared = adds(dataclasses.replace(CPU, overhead_s=5e-6)), adds(measured)
    # eight ranks on two cores: four turns per core, each instruction's turn costing the overhead measured so
    assert shared[0] - base[0] == pytest.approx(4 * (1.4e-5 - 5e-6), rel=1e-9)
    measured.save(tmp_path / "cpu.json")
    assert Hardware.load(tmp_path / "cpu.json").overheads == ((4.0, 1.4e-5),)
