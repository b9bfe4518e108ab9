"""What scanning the layers costs: one rank's training step with its layers unrolled and as one scan under
each remat policy, in interleaved rounds.

    python scripts/bench_scan.py                  # reference config, batch 4 (one rank's share of 2-rank dp)
    python scripts/bench_scan.py --batch 8 --rounds 7 --policies cheap_recomputed everything_saveable

Each round runs every configuration ``--reps`` times and keeps its fastest run: this thread's CPU time (less
sensitive to a shared machine than wall time) and wall time. Printed: every round, the minimum over rounds,
each configuration's ratio to the unrolled step, and the bytes the forward scan stacks for the backward per
layer (the residuals its policy saves). Every configuration must give the same gradients: checked before timing.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import spmd_runtime as sr  # noqa: E402
from spmd_runtime.exec.runner import Runtime, communicator  # noqa: E402
from spmd_runtime.ops import control  # noqa: E402


def build(cfg: sr.LMConfig, policy: str | None):
    """(interpreter, inputs, stacked residual bytes per layer) of the dp step on one rank; ``policy`` None:
    layers unrolled."""
    if policy is not None:
        control.DEFAULT_POLICY, default = policy, control.DEFAULT_POLICY  # the policy of a scan given none
    try:
        ts = sr.build_train_step(dataclasses.replace(cfg, scan_layers=policy is not None), sr.train_mesh((1,), "dp"),
                                 "dp", sr.AdamW())
    finally:
        if policy is not None:
            control.DEFAULT_POLICY = default
    state = ts.init(0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    inputs = sr.pytree.flatten((state["params"], state["opt_state"], {"tokens": tokens, "labels": tokens}))[0]
    interp = Runtime.world().interpreter(ts.program, communicator(ts.program.mesh), np)
    return interp, inputs, stacked_bytes(ts.program)


def stacked_bytes(program) -> int:
    """Bytes per iteration the first forward scan stacks beyond its carries (its ys: residuals)."""
    scans = [i for i in program.instrs if i.op == "scan" and not i.attrs["reverse"]]
    if not scans:
        return 0
    body, nc = scans[0].attrs["body"], scans[0].attrs["num_carry"]
    return sum(int(np.prod(o.sharding.local_shape(o.shape, program.mesh))) * np.dtype(o.dtype).itemsize
               for o in body.outputs[nc:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=["cheap_recomputed", "everything_saveable"],
                    choices=control.POLICIES)
    args = ap.parse_args()
    cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=args.batch)
    runs = {"unrolled": build(cfg, None), **{f"scan {p}": build(cfg, p) for p in args.policies}}
    first = {name: [o.copy() for o in interp.run(inputs)] for name, (interp, inputs, _) in runs.items()}
    scanned = [name for name in runs if name != "unrolled"]
    for name in scanned[1:]:  # same program shape: outputs compare one to one, to the bit
        for got, want in zip(first[name], first[scanned[0]]):
            np.testing.assert_array_equal(got, want, err_msg=f"{name} vs {scanned[0]}")
    print(f"bench_scan: batch {args.batch}, {args.rounds} rounds x {args.reps} reps, load {os.getloadavg()[0]:.1f}; "
          f"the scanned steps' outputs agree to the bit")
    cpu = {name: [] for name in runs}
    wall = {name: [] for name in runs}
    for rnd in range(args.rounds):
        for name, (interp, inputs, _) in runs.items():
            best_cpu = best_wall = float("inf")
            for _ in range(args.reps):
                c0, w0 = time.thread_time(), time.perf_counter()
                interp.run(inputs)
                best_cpu, best_wall = min(best_cpu, time.thread_time() - c0), min(best_wall, time.perf_counter() - w0)
            cpu[name].append(best_cpu)
            wall[name].append(best_wall)
            print(f"round {rnd}  {name:<28} cpu {best_cpu * 1e3:7.1f} ms  wall {best_wall * 1e3:7.1f} ms", flush=True)
    print(f"\n{'run':<28}{'cpu min':>9}{'wall min':>10}{'cpu / unrolled':>16}{'stacked/layer':>15}")
    for name, (_, _, stacked) in runs.items():
        print(f"{name:<28}{min(cpu[name]) * 1e3:9.1f}{min(wall[name]) * 1e3:10.1f}"
              f"{min(cpu[name]) / min(cpu['unrolled']):16.3f}{stacked / 2**20:12.2f} MiB")


if __name__ == "__main__":
    main()
