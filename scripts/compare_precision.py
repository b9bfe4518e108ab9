"""bfloat16 + fsdp beside float32 + dp (or any two bench_train.py configurations), interleaved rounds.

    python scripts/compare_precision.py -n 2 --rounds 3 [--all] [-- --steps 5 ...bench_train.py args]

Runs ``scripts/bench_train.py`` under ``$MPIEXEC`` (default mpiexec) alternately for each configuration
(ours, peer, ours, peer, ...), prints every round, then the minimum step time of each, their ratio, and
the wire bytes and memory per rank of each (deterministic: the program's, not measured). The machine
may be shared: ``uptime`` is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

CONFIGS = {"bf16_fsdp": ["--dtype", "bfloat16", "--preset", "fsdp"],
           "f32_dp": ["--dtype", "float32", "--preset", "dp"],
           # with --all: which of the two changes costs the time
           "f32_fsdp": ["--dtype", "float32", "--preset", "fsdp"],
           "bf16_dp": ["--dtype", "bfloat16", "--preset", "dp"]}


def run(n, extra, config) -> dict:
    cmd = [*shlex.split(os.environ.get("MPIEXEC", "mpiexec")), "-n", str(n), sys.executable,
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_train.py"), *CONFIGS[config], *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="MPI ranks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--all", action="store_true", help="also float32 fsdp and bfloat16 dp")
    ap.add_argument("extra", nargs="*", help="passed to bench_train.py (after --)")
    args = ap.parse_args()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    results = {c: [] for c in (CONFIGS if args.all else list(CONFIGS)[:2])}
    for r in range(args.rounds):
        for config in results:
            res = run(args.n, args.extra, config)
            results[config].append(res)
            print(f"round {r + 1} {config:<10} step {res['median_step_s']:.3f} s  loss {res['loss_first']:.3f} -> "
                  f"{res['loss_last']:.3f}  load {res['loadavg_start'][0]:.1f}", flush=True)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    best = {c: min(x["median_step_s"] for x in rs) for c, rs in results.items()}
    ours, peer = list(CONFIGS)[:2]
    for c in results:
        print(f"min step time {c:<10} {best[c]:.3f} s  ratio to {peer} {best[c] / best[peer]:.2f}")
    for c, rs in results.items():
        m = rs[0]["memory_per_rank"]
        print(f"{c:<10} wire bytes/step/rank {rs[0]['wire_bytes_per_step']:>12.0f}  per rank: params {m['params']:>10}"
              f"  opt_state {m['opt_state']:>10}  activations {m['activations']:>10}  peak {m['peak']:>10}  "
              f"max RSS {rs[0]['max_rss_bytes_per_rank']:>10}")
    w = {c: rs[0]["wire_bytes_per_step"] for c, rs in results.items()}
    print(f"wire bytes ratio {ours}/{peer}: {w[ours] / w[peer]:.3f}")
    return best


if __name__ == "__main__":
    main()
