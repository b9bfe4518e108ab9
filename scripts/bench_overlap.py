"""Overlap of communication with computation: per training step, time in compute, time in MPI, wall time.

    python scripts/bench_overlap.py                      # 2 and 8 ranks, 3 rounds, 4 timed steps each
    python scripts/bench_overlap.py --ranks 2 --rounds 5 --steps 6
    python scripts/bench_overlap.py --prefetch 3670016   # no MPI: FSDP's weight all-gathers in the listing
    python scripts/bench_overlap.py --ranks 2 --presets dp wus   # any training preset on one axis of all ranks
    python scripts/bench_overlap.py --ranks 2 --presets fsdp --scan-prefetch   # + the scans' next-layer gathers

For each world size it starts one MPI job per progress setting (MPICH_ASYNC_PROGRESS=0, then 1: MPICH reads it
at MPI_Init). Inside a job, rank 0 partitions each preset twice, with the scheduler's start/done pairs
(partition/schedule.py) and without (blocking collectives), and the configurations then run in interleaved
rounds (off, on, on without MPI_Test progress, off, ...), each a warm-up step plus ``--steps`` timed steps of
the reference config (2 layers, d 256, 8 heads, ffn 1024, vocab 1024, seq 128, batch 8, AdamW, float32;
1 BLAS thread per rank).

Per step: ``wall`` = the slowest rank's interpreter run; ``mpi`` = time inside MPI per rank (blocking
collectives, the starts of nonblocking ones, the progress tests and the waits; mean over ranks); ``compute`` = run - mpi
(mean over ranks). Each round prints its fastest step; the summary takes the minimum over rounds and the
ratio overlap-on / overlap-off. The machine is shared and noisy: read every round, not one figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

PRESETS = ("megatron", "megatron_wus")  # the default --presets
CONFIGS = (("off", "test"), ("on", "test"), ("on", "none"))  # (SPMD_ASYNC, SPMD_PROGRESS)


def mesh_shape(preset: str, n: int) -> tuple:
    """megatron_wus: data 2 x model n/2 (weight update over data); any other preset: one axis of all ranks."""
    return (2, n // 2) if preset == "megatron_wus" else (n,)


# ---------------------------------------------------------------- the MPI job
def job(rounds: int, steps: int, presets, scan_prefetch: bool = False) -> None:
    import numpy as np
    from mpi4py import MPI

    import spmd_runtime as sr
    from spmd_runtime.comm import collectives
    from spmd_runtime.exec import Runtime
    from spmd_runtime.train import build_train_step_on_root

    world, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    in_mpi = _time_mpi(collectives)
    cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8)
    built = {}
    overlaps = ("off", "on", "prefetch") if scan_prefetch else ("off", "on")
    for preset in presets:
        for overlap in overlaps:  # "prefetch": on, and each scan starts its next iteration's gathers early
            os.environ["SPMD_ASYNC"] = "0" if overlap == "off" else "1"
            os.environ["SPMD_SCAN_PREFETCH"] = "1" if overlap == "prefetch" else "0"
            built[preset, overlap] = build_train_step_on_root(cfg, sr.train_mesh(mesh_shape(preset, world.size),
                                                                                 preset), preset, sr.AdamW(), world)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)) for _ in range(steps + 1)]
    runtime = Runtime.world()
    for rnd in range(rounds):
        for preset in presets:
            for overlap, progress in CONFIGS + ((("prefetch", "test"),) if scan_prefetch else ()):
                ts = built[preset, overlap]
                os.environ["SPMD_PROGRESS"] = progress
                runtime.unbind()  # bound anew: the progress setting is read when binding
                local = ts.shard_state(ts.init(0), rank)
                records = []
                for k, x in enumerate(tokens):
                    world.Barrier()
                    in_mpi[0] = 0.0
                    t0 = time.perf_counter()
                    local, _ = ts.step(local, x, x, comm=world)
                    wall = time.perf_counter() - t0
                    if k:  # the first step binds and allocates
                        records.append((in_mpi[1], in_mpi[0], wall))
                every = world.gather(records, root=0)
                if rank == 0:
                    split = sum(i.op.endswith("_start") for i in ts.program.instrs)
                    print(json.dumps({"round": rnd, "preset": preset, "overlap": overlap, "progress": progress,
                                      "split": split, "steps": _steps(every)}), flush=True)


def _steps(every) -> list[dict]:
    """Per step: the slowest rank's run, and the mean over ranks of MPI and compute time."""
    out = []
    for step in zip(*every):
        runs, mpis = [r[0] for r in step], [r[1] for r in step]
        out.append({"wall": max(runs), "mpi": sum(mpis) / len(mpis),
                    "compute": sum(r - m for r, m in zip(runs, mpis)) / len(step)})
    return out


def _time_mpi(collectives):
    """Count time inside MPI: blocking collectives, nonblocking starts, progress tests and waits; and each
    interpreter run.
    Returns [mpi seconds since reset, seconds of the last top-level run]."""
    from spmd_runtime.exec import interpreter

    acc = [0.0, 0.0]
    bind, exchange, wait, test, run = collectives.bind, collectives.all_to_allv, collectives.Pending.wait, \
        collectives.Pending.test, interpreter.Interpreter.run

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - t0
        return call

    depth = [0]

    def timed_run(self, inputs, steps=None):  # Interpreter.run's signature (a scan passes its body's steps)
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return run(self, inputs, steps)
        finally:
            depth[0] -= 1
            if depth[0] == 0:  # loop bodies run inside: only the whole program counts
                acc[1] = time.perf_counter() - t0

    collectives.bind = lambda *a, **k: timed(bind(*a, **k))
    collectives.all_to_allv = timed(exchange)
    collectives.Pending.wait = timed(wait)
    collectives.Pending.test = timed(test)  # with SPMD_PROGRESS=test the transfers advance in these
    interpreter.Interpreter.run = timed_run
    return acc


# ---------------------------------------------------------------- FSDP prefetch in the listing
def prefetch(budget: int) -> None:
    """Each weight all-gather of the fsdp step (4 ranks): where its start and done sit in the program."""
    import spmd_runtime as sr
    from spmd_runtime.train import build_train_step

    os.environ["SPMD_ASYNC_BUDGET"] = str(budget)
    # Layers unrolled: each layer's weights are gathered where that layer starts. With scan_layers each layer's
    # slice is gathered inside the loop body where it is used (prefetch across loop iterations is not done).
    cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8, scan_layers=False)
    p = build_train_step(cfg, sr.train_mesh((4,), "fsdp"), "fsdp", sr.AdamW()).program
    dones = {i.args[0]: i for i in p.instrs if i.op.endswith("_done")}
    users: dict = {}
    for i in p.instrs:
        for a in i.args:
            users.setdefault(a, i.out)
    compute = [i.out for i in p.instrs if i.op != "parameter" and not i.op.endswith(("_start", "_done"))]
    names = {io.slot: io.name for io in p.inputs}
    print(f"fsdp (layers unrolled), 4 ranks, budget {budget} B: {len(p.instrs)} instructions, first compute instruction %{compute[0]}")
    flight, peak = {}, 0
    for i in p.instrs:
        if i.op.endswith("_done"):
            flight.pop(i.args[0], None)
        if i.op != "all_gather_start":
            continue
        flight[i.out] = i.nbytes
        peak = max(peak, sum(flight.values()))
        done = dones[i.out]
        hidden = sum(i.out < c < done.out for c in compute)
        print(f"  %{i.out:<4} all_gather_start({names.get(i.args[0], f'%{i.args[0]}'):<22}) {i.nbytes / 2**20:5.2f} MiB"
              f"   done %{done.out:<4} first use %{users.get(done.out)}   {hidden} compute instructions between")
    print(f"  peak bytes of all-gathers in flight: {peak} (budget {budget})")


# ---------------------------------------------------------------- the driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), help="training presets to run")
    parser.add_argument("--scan-prefetch", action="store_true",
                        help="also run each preset with $SPMD_SCAN_PREFETCH=1 (the scans prefetch their gathers)")
    parser.add_argument("--async-progress", choices=["both", "0", "1"], default="both",
                        help="MPICH_ASYNC_PROGRESS settings to run (one MPI job each)")
    parser.add_argument("--prefetch", type=int, metavar="BUDGET",
                        help="print where the fsdp preset's (4 ranks) weight all-gathers start and are waited for "
                             "with BUDGET bytes in flight, then exit")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.rounds, args.steps, args.presets, args.scan_prefetch)
        return
    if args.prefetch is not None:
        prefetch(args.prefetch)
        return
    mpiexec = os.environ.get("MPIEXEC", "mpiexec")
    print(f"bench_overlap: rounds {args.rounds}, {args.steps} timed steps each; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores (a shared machine: figures are noisy)")
    results = []
    for n in args.ranks:
        for ap in (["0", "1"] if args.async_progress == "both" else [args.async_progress]):
            env = {**os.environ, "MPICH_ASYNC_PROGRESS": ap}
            cmd = [*mpiexec.split(), "-n", str(n), sys.executable, __file__, "--job", "--rounds", str(args.rounds),
                   "--steps", str(args.steps), "--presets", *args.presets,
                   *(["--scan-prefetch"] if args.scan_prefetch else [])]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
            for line in proc.stdout:
                if not line.startswith("{"):
                    print(line, end="")
                    continue
                r = {**json.loads(line), "ranks": n, "async_progress": ap}
                best = min(r["steps"], key=lambda s: s["wall"])
                r["best"] = best
                results.append(r)
                print(f"round {r['round']}  {n} ranks  {r['preset']:<13} overlap {r['overlap']:<3} progress "
                      f"{_progress(r):<22} wall {best['wall'] * 1e3:7.1f} ms  compute {best['compute'] * 1e3:7.1f} ms"
                      f"  mpi {best['mpi'] * 1e3:7.1f} ms   (steps: "
                      + ", ".join(f"{s['wall'] * 1e3:.0f}" for s in r["steps"]) + f"; {r['split']} pairs)", flush=True)
            if proc.wait():
                sys.exit(f"bench_overlap: {' '.join(cmd)} failed with status {proc.returncode}")
    _summary(results)


def _progress(r) -> str:
    if r["overlap"] == "off":
        return "blocking" + (" +async thread" if r["async_progress"] == "1" else "")
    return ("scan prefetch, " if r["overlap"] == "prefetch" else "") + {"test": "MPI_Test", "none": "waits only"}[
        r["progress"]] + (" +async thread" if r["async_progress"] == "1" else "")


def _summary(results) -> None:
    print("\nminimum over rounds (ms); ratio = wall / wall of overlap off in the same job")
    print(f"{'ranks':>5}  {'preset':<13} {'progress':<26}{'wall':>8}{'compute':>9}{'mpi':>8}{'ratio':>7}")
    keys = sorted({(r["ranks"], r["preset"], r["async_progress"], r["overlap"], r["progress"]) for r in results},
                  key=lambda k: (k[0], k[1], k[2], k[3] != "off", k[4]))
    for key in keys:
        rows = [r for r in results if (r["ranks"], r["preset"], r["async_progress"], r["overlap"], r["progress"]) == key]
        base = [r for r in results if (r["ranks"], r["preset"], r["async_progress"], r["overlap"]) == key[:3] + ("off",)]
        wall = min(r["best"]["wall"] for r in rows)
        ratio = wall / min(r["best"]["wall"] for r in base)
        print(f"{key[0]:>5}  {key[1]:<13} {_progress(rows[0]):<26}{wall * 1e3:8.1f}"
              f"{min(r['best']['compute'] for r in rows) * 1e3:9.1f}{min(r['best']['mpi'] for r in rows) * 1e3:8.1f}"
              f"{ratio:7.2f}")


if __name__ == "__main__":
    main()
