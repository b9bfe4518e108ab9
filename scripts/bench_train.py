"""Benchmark one partitioned training step of the Transformer LM; prints ONE JSON line on rank 0.

Run under MPI, e.g.:
    mpiexec -n 8 python scripts/bench_train.py --mesh 2,4 --preset megatron_wus
Reference config (the defaults): 2 layers, d 256, 8 heads, ffn 1024, vocab 1024, seq 128, batch 8.

BLAS threads per rank default to (cores / ranks), set through threadpoolctl (a dependency). Reported: median
step seconds (max over ranks per step), tokens/s, comm wire bytes per step (cost model),
peak memory per rank (measured max RSS, and the program's peak of live local buffers).

``--moe``: every ``--moe-every``-th block is a GShard mixture of ``--experts`` experts (top-``--top-k``,
hidden ``--ffn`` each); use ``--preset moe`` or ``moe_megatron``. The line then adds the all-to-all wire
bytes, the expert weights held per rank (and globally) and the dropped-token fraction. A dense LM with the
same active parameters per token has ``--ffn`` = top_k x the expert hidden dim:
    mpiexec -n 8 python scripts/bench_train.py --mesh 4,2 --preset moe --moe --experts 8 --ffn 512
    mpiexec -n 8 python scripts/bench_train.py --mesh 4,2 --preset dp --ffn 1024

``--preset pipeline`` (meshes stage[,data[,model]], ``--microbatches`` M = the pipeline's micro-batches): the
line adds a "pipeline" object: S, M, the GPipe bubble (S-1)/(M+S-1), and the MEASURED bubble: every
iteration of the pipeline loops (forward and backward) is timed on every rank, and the time of the
iterations in which the rank's stage holds no micro-batch (stage s is busy at iterations s..s+M-1) over
the time of all of them, per rank; also the shift's collective_permute wire bytes and the layer parameter
bytes per rank vs in all. In the vectorised GSPMD schedule a bubble iteration computes on zeros, so the
bubble costs compute time rather than idle waiting.
    mpiexec -n 8 python scripts/bench_train.py --mesh 2,2,2 --preset pipeline --layers 8 --microbatches 4
``--layers L --partition-only`` prints partition seconds and instruction counts (layers scanned by default).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

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
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                    help="layers as one sr.scan over stacked parameters (default: dense models scan, MoE unroll)")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots", "full_save_all_to_all"])
    ap.add_argument("--microbatches", type=int, default=1,
                    help="gradient accumulation over this many slices (pipeline preset: its micro-batches)")
    ap.add_argument("--donate", action="store_true",
                    help="update the parameters and optimizer state in place (build_train_step(donate=True))")
    ap.add_argument("--predict", default=None, metavar="HARDWARE",
                    help="also print the step program.estimate predicts on this hardware profile (a file, or a "
                         "shipped name), the slowest rank's")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="with --predict: ranks per node (default: this job's; --partition-only: all on one)")
    ap.add_argument("--partition-only", action="store_true",
                    help="only trace and partition: print partition seconds and instruction counts")
    return ap.parse_args(argv)


def launcher_world_size() -> int:
    """Ranks in this job, read from the launcher's environment (MPI is not initialised yet)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


ARGS = parse_args()
THREADS = ARGS.threads or max(1, cores() // launcher_world_size())  # BLAS threads per rank

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spmd_runtime.exec import loops  # noqa: E402
from spmd_runtime.hardware import Hardware  # noqa: E402
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
                                microbatches=args.microbatches, donate=args.donate)
        return step, time.perf_counter() - t0
    return comm.bcast(run_on_root(comm, build_timed), root=0)


def timed_steps(ts, local, comm, args, clock=None):
    """Seconds per step (max over ranks): the median wall time and {min, median} of the process's CPU time (on
    a loaded machine CPU time moves less than wall time: the figure to compare changes by), and the losses.
    ``clock``: cleared after the warm-up steps, so it times the measured steps only."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses, times, cpu = [], [], []
    for i in range(args.warmup + args.steps):
        comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        local, loss = ts.step(local, x, y, comm=comm)
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        elapsed, cpu_s = comm.allreduce(wall, op=MPI.MAX), comm.allreduce(cpu_s, op=MPI.MAX)
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
            cpu.append(cpu_s)
        elif clock and i == args.warmup - 1:
            clock.clear()
    return float(np.median(times)), {"min": float(min(cpu)), "median": float(np.median(cpu))}, losses


def count_instructions(program) -> int:
    """Instructions including each loop body once."""
    bodies = [b for ins in program.instrs for v in ins.attrs.values()
              for b in (v if isinstance(v, tuple) else (v,)) if hasattr(b, "instrs")]
    return len(program.instrs) + sum(count_instructions(b) for b in bodies)


def predict(ts, ranks_per_node: int, ranks, threads: int) -> float:
    """The slowest of ``ranks``' predicted steps (``program.estimate``) on ``--predict``'s hardware with
    ``--ranks-per-node`` (default ``ranks_per_node``: the job's own placement) ranks on each node, each with
    ``threads`` BLAS threads."""
    hardware = Hardware.load(ARGS.predict).with_placement(ARGS.ranks_per_node or ranks_per_node, threads)
    return max(ts.program.estimate(hardware, r).step_s for r in ranks)


def blas_in_use() -> int:
    """The BLAS threads NumPy's BLAS runs (threadpoolctl; the environment caps what a limit can raise)."""
    return max([i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"] or [1])


def main():
    comm = MPI.COMM_WORLD
    threadpool_limits(THREADS)
    ts, build_seconds = build(ARGS, comm)
    if ARGS.partition_only:
        if comm.Get_rank() == 0:
            threads = ARGS.threads or max(1, cores() // ts.mesh.size)  # what each rank of a real run gets
            predicted = ({"predicted_step_s": predict(ts, ts.mesh.size, range(ts.mesh.size), threads)}
                         if ARGS.predict else {})
            print(json.dumps({"layers": ARGS.layers, "scan_layers": ts.cfg.scanned, "preset": ARGS.preset,
                              "mesh": list(ts.mesh.shape), "partition_s": build_seconds,
                              "instructions": len(ts.program.instrs),
                              "instructions_with_bodies": count_instructions(ts.program), **predicted}))
        return
    if ts.mesh.size != comm.Get_size():
        raise SystemExit(f"--mesh {ARGS.mesh} needs {ts.mesh.size} ranks; got {comm.Get_size()}")
    local = ts.shard_state(ts.init(0), comm.Get_rank())
    load_start = os.getloadavg()
    clock = LoopClock() if ts.preset.stage else None
    median, cpu, losses = timed_steps(ts, local, comm, ARGS, clock)
    rss = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)  # KiB on Linux
    pipeline = pipeline_report(ts, clock, comm, ARGS.steps) if clock else None
    if ARGS.predict:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        predicted = comm.allreduce(predict(ts, node.Get_size(), [comm.Get_rank()], blas_in_use()), op=MPI.MAX)
        node.Free()
    if comm.Get_rank() == 0:
        cfg = ts.cfg
        print(json.dumps({
            "preset": ARGS.preset, "mesh": list(ts.mesh.shape), "axes": list(ts.mesh.axis_names),
            "ranks": comm.Get_size(), "threads_per_rank": THREADS, "optimizer": ARGS.optimizer,
            "config": {k: getattr(cfg, k) for k in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch", "tied",
                                                  "dtype", "embedding")},
            "steps": ARGS.steps, "median_step_s": median, "tokens_per_s": cfg.tokens_per_step / median,
            "cpu_step_s": cpu,
            "wire_bytes_per_step": ts.program.wire_bytes, "collectives_per_step": len(ts.program.comm_summary()),
            "max_rss_bytes_per_rank": rss * 1024, "program_peak_bytes_per_rank": ts.program.peak_bytes(),
            "memory_per_rank": ts.memory_report(), "instructions": len(ts.program.instrs),
            "instructions_with_bodies": count_instructions(ts.program), "scan_layers": cfg.scanned,
            "remat": ARGS.remat, "microbatches": ARGS.microbatches, "donate": ARGS.donate, "build_s": build_seconds,
            "loss_first": losses[0], "loss_last": losses[-1],
            "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
            **({"moe": moe_report(ts)} if cfg.moe_every else {}),
            **({"pipeline": pipeline} if clock else {}),
            **({"predicted_step_s": predicted, "hardware": ARGS.predict} if ARGS.predict else {}),
        }))


class LoopClock:
    """Seconds of every run of every loop body bound from now on, by body program (``exec.loops`` binds each
    body once per rank; its ``run`` is wrapped here, so the other runs pay nothing)."""

    def __init__(self):
        self.seconds: dict[int, list[float]] = {}
        original = loops._bound

        def bound(interp, program, *options):
            body = original(interp, program, *options)
            record, run = self.seconds.setdefault(id(program), []), body.run

            def timed(inputs, *steps):
                t0 = time.perf_counter()
                out = run(inputs, *steps)
                record.append(time.perf_counter() - t0)
                return out
            body.run = timed
            return body
        loops._bound = bound

    def clear(self):
        for record in self.seconds.values():
            record.clear()


def pipeline_report(ts, clock: LoopClock, comm, steps: int) -> dict:
    """GPipe bubble in theory and measured per rank from the per-iteration times of the pipeline loops (the
    scans whose body shifts by a collective_permute), wire bytes of the shifts, layer bytes per rank."""
    axis = ts.preset.stage[0]
    s, m = ts.mesh.axis_size(axis), ARGS.microbatches
    stage = ts.mesh.coords(comm.Get_rank())[axis]
    idle = busy = 0.0
    for ins in ts.program.instrs:
        body = ins.attrs.get("body") if ins.op == "scan" else None
        if body is None or not any(c["kind"] == "collective_permute" for c in body.comm_summary()):
            continue
        n = ins.attrs["length"]
        for k, sec in enumerate(clock.seconds.get(id(body), [])):  # `steps` runs of n iterations
            t = k % n if not ins.attrs["reverse"] else n - 1 - k % n
            if stage <= t < stage + m:
                busy += sec
            else:
                idle += sec
    per_rank = comm.gather((idle, busy), root=0)
    if comm.Get_rank() != 0:
        return None
    fractions = [i / (i + b) if i + b else float("nan") for i, b in per_rank]
    layers = [io for io in ts.program.inputs[:len(ts.param_names)] if io.name.startswith("params.layers_")]
    item = lambda io: np.dtype(io.dtype).itemsize
    return {"stages": s, "microbatches": m, "bubble_theory": (s - 1) / (m + s - 1),
            "bubble_measured_per_rank": fractions, "bubble_measured_mean": float(np.mean(fractions)),
            "pipeline_loop_s_per_step_per_rank": [(i + b) / steps for i, b in per_rank],
            "permute_wire_bytes_per_step": sum(g["wire_bytes"] for g in ts.comm_summary()
                                               if g["kind"] == "collective_permute"),
            "layer_param_bytes_per_rank": sum(int(np.prod(io.sharding.local_shape(io.shape, ts.mesh))) * item(io)
                                              for io in layers),
            "layer_param_bytes_global": sum(int(np.prod(io.shape)) * item(io) for io in layers)}


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
