"""Windowed einsum (partition/windowed.py) on vs off, side by side: the ring of permutes hidden behind the
einsum's steps against the one all-gather / reduce-scatter next to the whole einsum.

    $MPIEXEC -n 2 python scripts/bench_windowed.py                 # 3 rounds
    $MPIEXEC -n 4 python scripts/bench_windowed.py --rounds 5 --reps 5

Cases (float32, 1 BLAS thread per rank, k = world size on one axis):
- ``gather``: sequence-parallel input to a column-parallel matmul: x[s/k, d] gathered, @ w[d, f/k];
- ``scatter``: row-parallel matmul to a sequence-parallel output: h[s, f/k] @ w[f/k, d], reduce-scattered on s;
- ``fsdp``: a weight gathered on its contracted rows: x[b/k, d] @ w[d/k, f];
- ``step seq``: one training step of the reference config (2 layers, d 256, 8 heads, ffn 1024, vocab 1024,
  seq 128, batch 8, AdamW) under the ``seq`` preset (sequence on every rank: its gathers and reduce-scatters
  become rings).
Rounds interleave off and on; each prints the fastest of ``--reps`` runs (the slowest rank's wall time); the
summary takes the minimum over rounds and prints on / off. Read every round: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import spmd_runtime as sr  # noqa: E402
from spmd_runtime.exec.runner import run_local, shard  # noqa: E402

S, D, F = 2048, 1024, 1024


def einsum_cases():
    """name -> (fn, shapes, in_specs, out_spec) on the one-axis mesh ("x",)."""
    return {"gather": (lambda x, w: x @ w, [(S, D), (D, F)], [("x", None), (None, "x")], (None, "x")),
            "scatter": (lambda h, w: h @ w, [(S, F), (F, D)], [(None, "x"), ("x", None)], ("x", None)),
            "fsdp": (lambda x, w: x @ w, [(S, D), (D, F)], [("x", None), ("x", None)], ("x", None))}


def build(world):
    """(name, mode) -> (a callable running one step on this rank, the program's collective kinds)."""
    k, rank = world.size, world.rank
    mesh = sr.Mesh((k,), ("x",))
    runs = {}
    rng = np.random.default_rng(0)
    for name, (fn, shapes, ins, out) in einsum_cases().items():
        args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        graph = sr.trace(fn, *args)
        for mode, threshold in (("off", None), ("on", 0)):
            program = sr.partition(graph, mesh, in_specs=ins, out_specs=[out], windowed_einsum=threshold)
            kinds = sorted({c["kind"] for c in program.comm_summary()})
            runs[name, mode] = (_einsum_runner(program, args, world), kinds)
    cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq))
    for mode, env in (("off", ""), ("on", "0")):
        os.environ["SPMD_WINDOWED_EINSUM"] = env
        ts = sr.build_train_step_on_root(cfg, sr.train_mesh((k,), "seq"), "seq", sr.AdamW(), world)
        state = [ts.shard_state(ts.init(seed=1), rank)]

        def step(ts=ts, state=state):
            state[0], _ = ts.step(state[0], tokens, tokens, comm=world)
        runs["step seq", mode] = (step, sorted({c["kind"] for c in ts.program.comm_summary()}))
    os.environ.pop("SPMD_WINDOWED_EINSUM", None)
    return runs


def _einsum_runner(program, args, world):
    local = [shard(a, io.sharding, program.mesh, world.rank) for a, io in zip(args, program.inputs)]
    return lambda: run_local(program, *local, comm=world)


def timed(fn, world, reps, in_mpi):
    """(wall, mpi) of the fastest of ``reps`` runs: the slowest rank's wall time, and the mean over ranks of the
    time inside MPI (blocking collectives, nonblocking starts, progress tests and waits)."""
    best = (float("inf"), 0.0)
    for _ in range(reps):
        world.Barrier()
        in_mpi[0] = 0.0
        t = time.perf_counter()
        fn()
        wall = world.allreduce(time.perf_counter() - t, op=MPI.MAX)
        best = min(best, (wall, world.allreduce(in_mpi[0]) / world.size))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    from bench_overlap import _time_mpi  # counts time inside MPI (wraps the bound collectives and the waits)
    from spmd_runtime.comm import collectives
    in_mpi = _time_mpi(collectives)
    runs = build(world)
    names = list(dict.fromkeys(n for n, _ in runs))
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"windowed einsum on vs off, {world.size} ranks, {args.rounds} rounds x min of {args.reps} runs (ms)")
    for name in names:
        say(f"  {name}: off {runs[name, 'off'][1]} / on {runs[name, 'on'][1]}")
    for name in names:  # warm-up: binders, receive buffers, compiled kernels
        for mode in ("off", "on"):
            runs[name, mode][0]()
    rows = {key: [] for key in runs}
    for r in range(args.rounds):
        for name in names:
            for mode in ("off", "on"):
                rows[name, mode].append(timed(runs[name, mode][0], world, args.reps, in_mpi))
        say(f"round {r + 1}: " + "  ".join(f"{n} off {rows[n, 'off'][-1][0] * 1e3:.2f} on {rows[n, 'on'][-1][0] * 1e3:.2f}"
                                           for n in names))
    say("wall = the slowest rank's run, mpi = mean time inside MPI in that run (ms), minimum over rounds")
    say(f"{'case':<10} {'off wall':>9} {'off mpi':>8} {'on wall':>9} {'on mpi':>8} {'on/off':>7}   every round off | on")
    ms = lambda rs: " ".join(f"{w * 1e3:.2f}" for w, _ in rs)
    for name in names:
        off, on = min(rows[name, "off"]), min(rows[name, "on"])
        say(f"{name:<10} {off[0] * 1e3:>9.2f} {off[1] * 1e3:>8.2f} {on[0] * 1e3:>9.2f} {on[1] * 1e3:>8.2f} "
            f"{on[0] / off[0]:>7.3f}   {ms(rows[name, 'off'])} | {ms(rows[name, 'on'])}")


if __name__ == "__main__":
    main()
