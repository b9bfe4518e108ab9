"""Hardware profiles (spmd_runtime/hardware.py) and the step predictor (spmd_runtime/estimate.py)."""
from __future__ import annotations

import copy
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
