"""Partitioning speed: instructions and seconds for growing models (the training step of the LM).

    python scripts/bench_partition.py                       # layers 2 8 32, megatron on a (2, 4) mesh
    python scripts/bench_partition.py --layers 2 8 --preset dp --mesh 8 --rounds 3
    python scripts/bench_partition.py --profile 8           # cProfile of one partition, top 25 by own time
    python scripts/bench_partition.py --cpu                 # CPU seconds of this process (a loaded machine)

Per model: graph nodes, program instructions before fusion (SPMD_FUSE=0 form) and after, seconds to trace,
to partition (propagation, partition rules, resharding, fusion) and ms per instruction; the minimum over
--rounds rounds, interleaved across sizes. The issue's target is 0.1 ms per instruction, linear in size.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import spmd_runtime as sr
from spmd_runtime.partition import partition
from spmd_runtime.partition.partitioner import fused_program
from spmd_runtime.train import input_specs, make_layout, step_specs, train_step_fn, _preset


CLOCK = time.perf_counter


def build(layers: int, preset_name: str, mesh):
    # Layers unrolled (scan_layers=False): the program grows with the model. Scanned, it stays one loop body.
    cfg = sr.LMConfig(layers=layers, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8, scan_layers=False)
    optimizer = sr.AdamW()
    preset = _preset(preset_name).on(mesh)
    layout = make_layout(cfg, mesh, preset, optimizer)
    t0 = time.perf_counter()
    graph = sr.trace(train_step_fn(cfg, optimizer, layout), *input_specs(cfg, optimizer))
    t1 = time.perf_counter()
    in_specs, out_specs = step_specs(graph, layout)
    plain = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs, fuse=False)
    t2 = time.perf_counter()
    fused = fused_program(plain)
    t3 = time.perf_counter()
    return len(graph.nodes), len(plain.instrs), len(fused.instrs), t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--preset", default="megatron")
    parser.add_argument("--mesh", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", type=int, metavar="LAYERS", help="cProfile one partition of this size")
    parser.add_argument("--cpu", action="store_true", help="time with process CPU time instead of wall time")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu else time.perf_counter
    mesh = sr.train_mesh(tuple(args.mesh), args.preset)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(build, args.profile, args.preset, mesh)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    print(f"# {args.preset} on {mesh}, {'CPU' if args.cpu else 'wall'} seconds, loadavg {os.getloadavg()[0]:.2f} at start")
    print(f"{'layers':>6} {'nodes':>7} {'instrs':>7} {'fused':>7} {'trace s':>9} {'partition s':>12} "
          f"{'fuse s':>8} {'ms/instr':>9}")
    best: dict[int, tuple] = {}
    for _ in range(args.rounds):
        for layers in args.layers:
            row = build(layers, args.preset, mesh)
            if layers not in best or row[4] + row[5] < best[layers][4] + best[layers][5]:
                best[layers] = row
    for layers in args.layers:
        nodes, instrs, fused, t_trace, t_part, t_fuse = best[layers]
        print(f"{layers:>6} {nodes:>7} {instrs:>7} {fused:>7} {t_trace:>9.3f} {t_part:>12.3f} {t_fuse:>8.3f} "
              f"{(t_part + t_fuse) / instrs * 1e3:>9.3f}")
    print(f"# loadavg {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
