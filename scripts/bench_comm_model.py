"""Predicted vs measured communication time of one training step (the calibrated cost model's check).

    mpiexec -n 8 python scripts/bench_comm_model.py --mesh 2,4 --preset megatron_wus [--profile P.json]

Without --profile it first calibrates (``python -m spmd_runtime calibrate``) into cost_profile.json.
The step is partitioned with that profile; every collective the interpreter binds is wrapped in a timer, so a
step's measured communication time is the sum of its collectives' wall times (slowest rank per step). Prints,
per collective kind, the profile's predicted seconds per step and the measured ones of every round (each
round: --steps steps, the median step), then the totals and their ratio. On a shared, oversubscribed machine
both are noisy: read the rounds, not one figure.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import spmd_runtime as sr  # noqa: E402
from spmd_runtime.calibrate import calibrate, write_profile  # noqa: E402
from spmd_runtime.comm import collectives  # noqa: E402
from spmd_runtime.train import run_on_root  # noqa: E402

SPENT: dict = collections.defaultdict(float)


def timed(kind, fn):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        SPENT[kind] += time.perf_counter() - t0
        return out
    return run


def instrument():
    bind, exchange = collectives.bind, collectives.all_to_allv
    collectives.bind = lambda mc, kind, *a, **k: timed(kind, bind(mc, kind, *a, **k))
    collectives.all_to_allv = timed("all_to_allv", exchange)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--preset", default="megatron_wus")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    profile = args.profile
    if profile is None:
        doc = calibrate(comm, repeats=5)
        profile = "cost_profile.json"
        if comm.Get_rank() == 0:
            write_profile(doc, profile)
        comm.Barrier()
    os.environ["SPMD_COST_PROFILE"] = profile
    shape = tuple(int(s) for s in args.mesh.split(",")) if args.mesh else (comm.Get_size(),)
    cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8)
    step = comm.bcast(run_on_root(comm, lambda: sr.build_train_step(cfg, sr.train_mesh(shape, args.preset),
                                                                      args.preset, sr.AdamW(lr=3e-3))), root=0)
    instrument()
    predicted = collections.defaultdict(float)
    for c in step.program.comm_summary():
        predicted[c["kind"]] += c["predicted_s"]
    local = step.shard_state(step.init(0), comm.Get_rank())
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
    local, _ = step.step(local, tokens[:, :-1], tokens[:, 1:], comm=comm)  # warm-up: binding, buffers
    rounds = []
    for _ in range(args.rounds):
        per_step = []
        for _ in range(args.steps):
            SPENT.clear()
            comm.Barrier()
            local, _ = step.step(local, tokens[:, :-1], tokens[:, 1:], comm=comm)
            per_step.append({k: max(comm.allgather(SPENT.get(k, 0.0))) for k in predicted})
        rounds.append({k: float(np.median([s[k] for s in per_step])) for k in predicted})
    if comm.Get_rank() == 0:
        print(f"preset {args.preset} mesh {step.mesh.shape} profile {profile} ({step.program.cost_model.name}); "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'collective':<19} {'predicted ms':>13} " + " ".join(f"{'round ' + str(i):>10}" for i in
                                                                      range(len(rounds))))
        for k in sorted(predicted):
            print(f"{k:<19} {predicted[k] * 1e3:>13.3f} " + " ".join(f"{r[k] * 1e3:>10.3f}" for r in rounds))
        total_p, totals = sum(predicted.values()), [sum(r.values()) for r in rounds]
        print(f"{'total':<19} {total_p * 1e3:>13.3f} " + " ".join(f"{t * 1e3:>10.3f}" for t in totals))
        print(f"measured/predicted: min {min(totals) / total_p:.2f}, every round "
              f"{[round(t / total_p, 2) for t in totals]}")


if __name__ == "__main__":
    main()
