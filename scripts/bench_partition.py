"""Partitioning speed: instructions and seconds for growing models (the training step of the LM).

    python scripts/bench_partition.py                       # layers 2 8 32 64, megatron on a (2, 4) mesh, 3 rounds
    python scripts/bench_partition.py --layers 2 8 --preset dp --mesh 8 --rounds 5
    python scripts/bench_partition.py --profile 32          # cProfile of one partition, top 30 by own time
    python scripts/bench_partition.py --cpu                 # CPU seconds of this process (a loaded machine)
    python scripts/bench_partition.py --layers 2 --meshes 64x8 192x8 384x8   # 512, 1536, 3072 ranks

With ``--meshes`` every measurement runs in a fresh process (nothing cached from another mesh or round) and
reports that process's peak RSS; the rounds interleave the meshes, and the closing line gives the ratio of the
slowest mesh's best total to the fastest's (the issue's target: flat within 1.5x from 512 to 3072 ranks, the
3072-rank plan under 10 s and 2 GiB). The model is narrow (d = 256: ``input_specs`` still builds its example
arrays), so what grows with the mesh is the partitioner's own work.

Per model (layers unrolled, so the program grows with the model): graph nodes, program instructions as the
partitioner emits them (``instrs``: before fusion and the async split) and as ``partition()`` returns them
(``final``: fused, collectives split into start/done), then seconds:

- ``trace``: tracing the step (not part of partitioning, shown for scale);
- ``partition``: propagation, partition rules, resharding, dead-code removal (frees and donations are left to
  the fusion pass, which rebuilds the program anyway);
- ``fuse``: the loop-fusion pass (partition/fusion.py) with frees and donations;
- ``schedule``: the async start/done split (partition/schedule.py) with frees and donations redone;
- ``total``: the whole ``partition()`` call with its defaults (what a user pays: all of the above);

and ``ms/instr`` = total / instrs. Every round is printed, then per size the minimum of each column over the
rounds (sizes interleaved within a round). The issue's target: 0.1 ms per instruction or less, linear in size
(ms/instr flat across sizes). ``uptime`` is printed before and after: the machine is shared.

Side by side with an older checkout (its partition() has no ``timings``: total only), interleaved by hand:
``for r in 1 2 3; do python scripts/bench_partition.py --rounds 1; PYTHONPATH=/path/to/old python
scripts/bench_partition.py --rounds 1; done``.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import time

import spmd_runtime as sr
from spmd_runtime.partition import partition
from spmd_runtime.train import input_specs, make_layout, step_specs, train_step_fn, as_preset

PHASES = ("partition", "fuse", "schedule")
COLUMNS = ("trace", *PHASES, "total")


def traced(layers: int, preset_name: str, mesh, clock):
    """(graph, in_specs, out_specs, trace seconds) of the training step with ``layers`` unrolled layers."""
    cfg = sr.LMConfig(layers=layers, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8, scan_layers=False)
    optimizer = sr.AdamW()
    layout = make_layout(cfg, mesh, as_preset(preset_name).on(mesh), optimizer)
    t0 = clock()
    graph = sr.trace(train_step_fn(cfg, optimizer, layout), *input_specs(cfg, optimizer))
    seconds = clock() - t0
    in_specs, out_specs = step_specs(graph, layout)
    return graph, in_specs, out_specs, seconds


def measure(layers: int, preset_name: str, mesh, clock) -> dict:
    graph, in_specs, out_specs, t_trace = traced(layers, preset_name, mesh, clock)
    gc.collect()  # each round starts from the same heap; partition() itself pauses the cycle collector
    laps: dict = {}
    t0 = clock()
    try:
        program = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs, timings=laps)
    except TypeError:  # an older checkout (PYTHONPATH=...) for a side-by-side run: its total only
        t0 = clock()
        program = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs)
    total = clock() - t0
    if not laps:
        plain = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs, fuse=False, overlap=False)
        laps = {"partition_instrs": len(plain.instrs), **{p: math.nan for p in PHASES}}
    elif clock is not time.perf_counter:  # the passes' laps are wall seconds: scale them to the chosen clock
        scale = total / sum(laps[p] for p in PHASES if p in laps)
        laps = {**laps, **{p: laps[p] * scale for p in PHASES if p in laps}}
    return {"nodes": len(graph.nodes), "instrs": laps["partition_instrs"], "final": len(program.instrs),
            "trace": t_trace, **{p: laps.get(p, 0.0) for p in PHASES}, "total": total}


def row(layers: int, m: dict, label: str) -> str:
    return (f"{label:>6} {layers:>6} {m['nodes']:>7} {m['instrs']:>7} {m['final']:>6} "
            + " ".join(f"{m[c]:>9.3f}" for c in COLUMNS) + f" {m['total'] / m['instrs'] * 1e3:>9.4f}")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "loadavg " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def across_meshes(args) -> None:
    """Each (mesh, layers) partitioned in a fresh child process per round; every round printed, then the best."""
    print(f"# {args.preset}, {'CPU' if args.cpu else 'wall'} seconds, {args.rounds} rounds, one fresh process per "
          f"measurement; rss: the child's peak resident set")
    print(f"# before: {uptime()}")
    head = f"{'round':>6} {'mesh':>10} {'ranks':>6} {'layers':>6} {'instrs':>7} {'final':>6} {'partition s':>11} " \
           f"{'total s':>9} {'rss MiB':>8}"
    print(head)
    best: dict = {}
    for r in range(args.rounds):
        for mesh in args.meshes:
            for layers in args.layers:
                m = child_measure(mesh, layers, args)
                print(mesh_row(str(r + 1), mesh, layers, m), flush=True)
                old = best.get((mesh, layers))
                best[(mesh, layers)] = m if old is None else {k: min(old[k], m[k]) for k in m}
    for (mesh, layers), m in best.items():
        print(mesh_row("min", mesh, layers, m))
    for layers in args.layers:
        totals = [best[(mesh, layers)]["total"] for mesh in args.meshes]
        print(f"# layers {layers}: slowest / fastest best total over the meshes = {max(totals) / min(totals):.2f}x")
    print(f"# after: {uptime()}")


def child_measure(mesh: str, layers: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--layers", str(layers), "--mesh",
           *mesh.split("x")] + (["--cpu"] if args.cpu else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def mesh_row(label: str, mesh: str, layers: int, m: dict) -> str:
    return (f"{label:>6} {mesh:>10} {math.prod(int(x) for x in mesh.split('x')):>6} {layers:>6} {m['instrs']:>7} "
            f"{m['final']:>6} {m['partition']:>11.3f} {m['total']:>9.3f} {m['rss'] / 2**20:>8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--preset", default="megatron")
    parser.add_argument("--mesh", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, metavar="LAYERS", help="cProfile one partition of this size")
    parser.add_argument("--cpu", action="store_true", help="time with process CPU time instead of wall time")
    parser.add_argument("--meshes", nargs="+", metavar="AxB", help="compare meshes (e.g. 64x8 192x8 384x8), each "
                        "measurement in a fresh process with its peak RSS")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement, as JSON
    args = parser.parse_args()
    if args.meshes:
        return across_meshes(args)
    clock = time.process_time if args.cpu else time.perf_counter
    mesh = sr.train_mesh(tuple(args.mesh), args.preset)
    if args.child:
        m = measure(args.layers[0], args.preset, mesh, clock)
        print(json.dumps({**m, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
        return
    if args.profile:
        graph, in_specs, out_specs, _ = traced(args.profile, args.preset, mesh, clock)
        profiler = cProfile.Profile()
        profiler.runcall(partition, graph, mesh, in_specs=in_specs, out_specs=out_specs)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return
    print(f"# {args.preset} on {mesh}, {'CPU' if args.cpu else 'wall'} seconds, {args.rounds} rounds")
    print("# partition: propagation, rules, resharding, dead code; fuse / schedule: those passes with frees and"
          " donations; total: the whole partition() call; ms/instr: total / instrs (as emitted, before fusion)")
    print(f"# before: {uptime()}")
    print(f"{'round':>6} {'layers':>6} {'nodes':>7} {'instrs':>7} {'final':>6} "
          + " ".join(f"{c + ' s':>9}" for c in COLUMNS) + f" {'ms/instr':>9}")
    rounds: dict[int, list[dict]] = {n: [] for n in args.layers}
    for r in range(args.rounds):
        for layers in args.layers:
            m = measure(layers, args.preset, mesh, clock)
            rounds[layers].append(m)
            print(row(layers, m, str(r + 1)), flush=True)
    for layers in args.layers:
        ms = rounds[layers]
        best = {**ms[0], **{c: min(m[c] for m in ms) for c in COLUMNS}}
        print(row(layers, best, "min"))
    print(f"# after: {uptime()}")


if __name__ == "__main__":
    main()
