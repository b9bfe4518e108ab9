"""Where one GPT-2 training step's time goes, per rank: every interpreter instruction of the step that
``scripts/bench_gpt2.py`` times (same model, preset, AdamW, one BLAS thread per rank), timed alone, the minimum
over ``--reps`` runs, in this thread's CPU time and in wall time, summed by op kind and by the user's source
line that made it.

    python scripts/profile_gpt2.py --layers 4                       # 1 rank, GPT-2 124M's width, 4 layers
    mpiexec -n 2 python scripts/profile_gpt2.py --preset megatron   # each rank's share at 2 ranks

At 2 ranks a done's wall time is the wait for its collective (CPU time too where MPI polls).
"""
import os
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
import argparse  # noqa: E402
import collections  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpt2  # noqa: E402

import spmd_runtime as sr  # noqa: E402
import spmd_runtime.random as srandom  # noqa: E402
from spmd_runtime.exec.runner import Runtime, communicator  # noqa: E402
from spmd_runtime.models import gpt2  # noqa: E402


def key_of(ins) -> str:
    return ins.op if ins.op != "einsum" else "einsum " + ins.attrs["spec"]


def where(ins) -> str:
    return f"{os.path.basename(ins.source[0])}:{ins.source[1]}" if ins.source else "?"


def main():
    ap = argparse.ArgumentParser()
    bench_gpt2.add_side_by_side_args(ap, 2, layers=12, d=768, heads=12, vocab=50304, batch=4, seq=256)
    ap.add_argument("--preset", default="dp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--show", default="", help="list each instruction made at this source line (file:line)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="donated input")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = gpt2.GPTConfig(**bench_gpt2.gpt_config(args))
    optimizer = bench_gpt2.adamw()
    step, place, batch, layout, mesh, preset = bench_gpt2.build_step(cfg, args.preset, comm.Get_size(), optimizer)
    weights = gpt2.init_params(cfg, 0)
    params, state = place(weights, optimizer.init_state(weights))
    idx, targets = batch(*bench_gpt2.batch_of(args, 1))
    key = srandom.key(0)
    params, state, loss = step(params, state, idx, targets, key)  # compile + bind
    program = step.lower(params, state, idx, targets, key)
    leaves = sr.pytree.flatten((params, state, idx, targets, key))[0]
    inputs = [x.local if hasattr(x, "local") else np.asarray(x) for x in leaves]
    it = Runtime.world().interpreter(program, communicator(program.mesh), np)
    instrs = {i.out: i for i in program.instrs}
    cpu, wall, walls, cpus = {}, {}, [], []
    for _ in range(args.reps):
        comm.Barrier()
        env, c0, w0 = {}, time.process_time(), time.perf_counter()
        for out, index, free in it.params:
            env[out] = inputs[index]
        for out, fn, a, free in it.steps:
            t0, w = time.thread_time(), time.perf_counter()
            env[out] = fn(*[env[x] for x in a])
            dc, dw = time.thread_time() - t0, time.perf_counter() - w
            cpu[out], wall[out] = min(cpu.get(out, dc), dc), min(wall.get(out, dw), dw)
            for s in free:
                del env[s]
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        del env
    by_kind, by_line, n = collections.Counter(), collections.Counter(), collections.Counter()
    by_kind_w = collections.Counter()
    for out, t in cpu.items():
        ins = instrs[out]
        by_kind[key_of(ins)] += t
        by_kind_w[key_of(ins)] += wall[out]
        by_line[f"{ins.op:14s} {where(ins)}"] += t
        n[key_of(ins)] += 1
    lines = [f"rank {comm.Get_rank()} of {comm.Get_size()} ({args.preset}), {cfg}, batch {args.batch} x {args.seq}: "
             f"{len(program.instrs)} instructions; step wall min {min(walls):.3f} s, process CPU min {min(cpus):.3f} s;"
             f" sum of per-instruction minima: CPU {sum(cpu.values()):.3f} s, wall {sum(wall.values()):.3f} s"]
    lines.append("  by op kind (CPU s, wall s, count):")
    for k, v in by_kind.most_common(args.top):
        lines.append(f"  {v:8.3f} {by_kind_w[k]:8.3f} {n[k]:5d}x  {k}")
    lines.append("  by op and source line (CPU s):")
    for k, v in by_line.most_common(args.top):
        lines.append(f"  {v:8.3f}  {k}")
    for ins in program.instrs:
        if args.show and where(ins) == args.show and ins.out in cpu:
            code = ins.attrs.get("code", ins.attrs.get("spec", ""))
            lines.append(f"  {cpu[ins.out]:8.4f}  %{ins.out} {ins.op} {ins.dtype}{list(ins.shape)} "
                         f"<- {[tuple(instrs[a].shape) for a in ins.args]} {code} {ins.attrs.get('axes', '')}")
    text = "\n".join(lines)
    for r in range(comm.Get_size()):
        comm.Barrier()
        if r == comm.Get_rank():
            print(text, flush=True)


if __name__ == "__main__":
    main()
