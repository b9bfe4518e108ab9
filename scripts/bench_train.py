"""Benchmark one partitioned training step of the Transformer LM; prints ONE JSON line on rank 0.

Run under MPI, e.g.:
    mpiexec -n 8 python scripts/bench_train.py --mesh 2,4 --preset megatron_wus
Reference config (the defaults): 2 layers, d 256, 8 heads, ffn 1024, vocab 1024, seq 128, batch 8.

BLAS threads per rank default to (cores / ranks); they are set through threadpoolctl when
it is installed, else through the environment before NumPy is imported. Reported: median
step seconds (max over ranks per step), tokens/s, comm wire bytes per step (cost model),
peak memory per rank (measured max RSS, and the program's peak of live local buffers).

``--moe``: every ``--moe-every``-th block is a GShard mixture of ``--experts`` experts (top-``--top-k``,
hidden ``--ffn`` each); use ``--preset moe`` or ``moe_megatron``. The line then adds the all-to-all wire
bytes, the expert weights held per rank (and globally) and the dropped-token fraction. A dense LM with the
same active parameters per token has ``--ffn`` = top_k x the expert hidden dim:
    mpiexec -n 8 python scripts/bench_train.py --mesh 4,2 --preset moe --moe --experts 8 --ffn 512
    mpiexec -n 8 python scripts/bench_train.py --mesh 4,2 --preset dp --ffn 1024
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 2), ("d", 256), ("heads", 8), ("ffn", 1024), ("vocab", 1024), ("seq", 128),
                          ("batch", 8), ("steps", 10), ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 8 or 2,4 (default: one axis of all ranks)")
    ap.add_argument("--preset", default="dp",
                    help="dp, megatron, wus, seq, megatron_wus, dp_seq, moe, moe_megatron, fsdp, fsdp_megatron")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"],
                    help="compute dtype; 16-bit ones keep float32 master weights and optimizer state")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--embedding", default="auto", choices=["auto", "take", "onehot"])
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads per rank (default: cores / ranks)")
    ap.add_argument("--moe", action="store_true", help="a GShard mixture-of-experts LM")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--scan-layers", action="store_true", help="layers as one sr.scan over stacked parameters")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots"], help="with --scan-layers")
    ap.add_argument("--microbatches", type=int, default=1, help="gradient accumulation over this many slices")
    ap.add_argument("--partition-only", action="store_true",
                    help="only trace and partition: print partition seconds and instruction counts")
    return ap.parse_args(argv)


def launcher_world_size() -> int:
    """Ranks in this job, read from the launcher's environment (MPI is not initialised yet)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def blas_threads(requested) -> tuple[int, object]:
    """Threads per rank, and a threadpoolctl limiter (None: set through the environment, before NumPy loads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = requested or max(1, cores // launcher_world_size())
    if importlib.util.find_spec("threadpoolctl") is not None:
        return threads, "threadpoolctl"
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    return threads, None


ARGS = parse_args()
THREADS, LIMITER = blas_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread count is in the environment)
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spmd_runtime.models.lm import LMConfig  # noqa: E402
from spmd_runtime.optim import make_optimizer  # noqa: E402
from spmd_runtime.train import build_train_step, run_on_root, train_mesh  # noqa: E402


def build(args, comm):
    """Rank 0 traces and partitions (the others wait sleeping); the step is broadcast."""
    moe = dict(moe_every=args.moe_every, experts=args.experts, top_k=args.top_k,
               capacity_factor=args.capacity_factor) if args.moe else {}
    cfg = LMConfig(args.layers, args.d, args.heads, args.ffn, args.vocab, args.seq, args.batch, tied=args.tied,
                   dtype=args.dtype, embedding=args.embedding, scan_layers=args.scan_layers, remat=args.remat, **moe)
    shape = tuple(int(s) for s in args.mesh.split(",")) if args.mesh else (comm.Get_size(),)

    def build_timed():
        t0 = time.perf_counter()
        step = build_train_step(cfg, train_mesh(shape, args.preset), args.preset, make_optimizer(args.optimizer),
                                microbatches=args.microbatches)
        return step, time.perf_counter() - t0
    return comm.bcast(run_on_root(comm, build_timed), root=0)


def timed_steps(ts, local, comm, args):
    """Median seconds per step (max over ranks), and the first and last loss."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        local, loss = ts.step(local, x, y, comm=comm)
        elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
    return float(np.median(times)), losses


def count_instructions(program) -> int:
    """Instructions including each loop body once."""
    bodies = [b for ins in program.instrs for v in ins.attrs.values()
              for b in (v if isinstance(v, tuple) else (v,)) if hasattr(b, "instrs")]
    return len(program.instrs) + sum(count_instructions(b) for b in bodies)


def main():
    comm = MPI.COMM_WORLD
    if LIMITER:
        from threadpoolctl import threadpool_limits
        threadpool_limits(THREADS)
    ts, build_seconds = build(ARGS, comm)
    if ARGS.partition_only:
        if comm.Get_rank() == 0:
            print(json.dumps({"layers": ARGS.layers, "scan_layers": ARGS.scan_layers, "preset": ARGS.preset,
                              "mesh": list(ts.mesh.shape), "partition_s": build_seconds,
                              "instructions": len(ts.program.instrs),
                              "instructions_with_bodies": count_instructions(ts.program)}))
        return
    if ts.mesh.size != comm.Get_size():
        raise SystemExit(f"--mesh {ARGS.mesh} needs {ts.mesh.size} ranks; got {comm.Get_size()}")
    local = ts.shard_state(ts.init(0), comm.Get_rank())
    load_start = os.getloadavg()
    median, losses = timed_steps(ts, local, comm, ARGS)
    rss = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)  # KiB on Linux
    if comm.Get_rank() == 0:
        cfg = ts.cfg
        print(json.dumps({
            "preset": ARGS.preset, "mesh": list(ts.mesh.shape), "axes": list(ts.mesh.axis_names),
            "ranks": comm.Get_size(), "threads_per_rank": THREADS, "optimizer": ARGS.optimizer,
            "config": {k: getattr(cfg, k) for k in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch", "tied",
                                                  "dtype", "embedding")},
            "steps": ARGS.steps, "median_step_s": median, "tokens_per_s": cfg.tokens_per_step / median,
            "wire_bytes_per_step": ts.program.wire_bytes, "collectives_per_step": len(ts.program.comm_summary()),
            "max_rss_bytes_per_rank": rss * 1024, "program_peak_bytes_per_rank": ts.program.peak_bytes(),
            "memory_per_rank": ts.memory_report(), "instructions": len(ts.program.instrs),
            "instructions_with_bodies": count_instructions(ts.program), "scan_layers": ARGS.scan_layers,
            "remat": ARGS.remat, "microbatches": ARGS.microbatches, "build_s": build_seconds,
            "loss_first": losses[0], "loss_last": losses[-1],
            "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
            **({"moe": moe_report(ts)} if cfg.moe_every else {}),
        }))


def moe_report(ts) -> dict:
    """All-to-all wire bytes per step, expert weight bytes per rank vs in all, the last dropped fraction."""
    cfg, held, whole = ts.cfg, 0, 0
    for io in ts.program.inputs[:len(ts.param_names)]:
        if io.name.endswith(("_we1", "_we2")):
            item = np.dtype(io.dtype).itemsize
            held += int(np.prod(io.sharding.local_shape(io.shape, ts.mesh))) * item
            whole += int(np.prod(io.shape)) * item
    return {"experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
            "moe_every": cfg.moe_every,
            "all_to_all_wire_bytes_per_step": sum(g["wire_bytes"] for g in ts.comm_summary()
                                                  if g["kind"] == "all_to_all"),
            "all_to_alls_per_step": sum(g["count"] for g in ts.comm_summary() if g["kind"] == "all_to_all"),
            "expert_weight_bytes_per_rank": held, "expert_weight_bytes_global": whole,
            "dropped_fraction_last": ts.metrics.get("dropped_fraction")}


if __name__ == "__main__":
    main()
