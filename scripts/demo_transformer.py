"""Main job: a Transformer block forward pass, sharded Megatron-style on a 2x4 mesh.

Traces the block, partitions it from a handful of mesh_split annotations (batch on
"data", heads and MLP hidden dim on "model"), saves the program, loads it on every
rank, runs it, and prints the comm summary, the max abs error against the
reference evaluator, and the time per step. Run: mpiexec -n 8 python scripts/demo_transformer.py
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import spmd_runtime as sr
from spmd_runtime.__main__ import format_comm_summary
from spmd_runtime.exec.backend import array_module_of, to_host
from spmd_runtime.exec.backends import backend_of
from spmd_runtime.models import BlockConfig, block_params, megatron_specs, transformer_block


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mesh", default="2,4", help="data,model mesh shape (product = number of ranks)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="out")
    ap.add_argument("--backend", default=None, choices=["numpy", "cupy", "auto"],
                    help="array backend (default: $SPMD_BACKEND, else auto: CuPy when a GPU is visible)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mesh = sr.Mesh(tuple(int(s) for s in args.mesh.split(",")), ("data", "model"))
    cfg = BlockConfig(dtype=args.dtype)
    inputs = block_params(cfg, seed=0)
    graph = sr.trace(transformer_block(cfg), *inputs)
    path = os.path.join(args.out, "transformer_block.program.json")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        program = sr.partition(graph, mesh, in_specs=megatron_specs("data", "model"))
        program.save(path)
    comm.Barrier()
    program = sr.load_program(path)
    outs = sr.run(program, *inputs, backend=args.backend)  # also warms up the sub-communicators
    seconds = time_steps(program, inputs, comm, args.steps, args.backend)
    if rank == 0:
        report(cfg, mesh, graph, program, inputs, to_host(outs[0]), seconds, path)


def time_steps(program, inputs, comm, steps, backend=None) -> float:
    """Median seconds per step of sr.run (slice inputs, run, gather outputs), max over ranks."""
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        outs = sr.run(program, *inputs, backend=backend)
        backend_of(array_module_of(outs[0])).synchronize()  # the timer must wait for the GPU
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def report(cfg, mesh, graph, program, inputs, out, seconds, path):
    t0 = time.perf_counter()
    ref = sr.evaluate(graph, *inputs)[0]
    ref_seconds = time.perf_counter() - t0
    err = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
    bound = 1e-4 if cfg.dtype == "float32" else 1e-5
    print(f"Transformer block {cfg} on {mesh}, Megatron sharding (batch on data, heads/hidden on model)")
    print(f"program saved to {path} ({len(program.instrs)} instructions, hash {program.hash[:12]})")
    print("comm summary per step:")
    print(format_comm_summary(program))
    print(f"max abs error vs reference evaluator: {err:.3e} (bound {bound:.0e}) -> {'OK' if err < bound else 'FAIL'}")
    print(f"time per step on {mesh.size} ranks: {seconds * 1e3:.2f} ms   (reference, 1 process: "
          f"{ref_seconds * 1e3:.2f} ms)")
    print(f"peak local buffers per rank: {program.peak_bytes() / 2**20:.2f} MiB")
    if err >= bound:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
