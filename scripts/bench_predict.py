"""Predicted against measured training steps on this machine (issue 27): the predictor's error per layout.

    mpiexec -n 2 python -m spmd_runtime calibrate --hardware hw.json      # this machine's profile, once
    mpiexec -n 4 python -m spmd_runtime calibrate --hardware hw.json --sharing-only  # what ranks sharing cores
    mpiexec -n 8 python -m spmd_runtime calibrate --hardware hw.json --sharing-only  # cost, at 2 and 4 per core
    python scripts/bench_predict.py --hardware hw.json                    # the table below, 3 rounds
    python scripts/bench_predict.py --hardware hw.json --ranks 1 2 --presets dp megatron --scale 1 10
    python scripts/bench_predict.py --hardware hw.json --measured OLD_LOG   # re-predict an earlier run's rows

Per (config, preset, ranks): ``scripts/bench_train.py --predict`` in ``--rounds`` rounds (the rows interleaved
within a round), each round's median step, then the minimum over rounds next to the prediction (the slowest
rank's ``program.estimate``) and their ratio. ``--scale 10`` is the reference config with ~10x the FLOPs
(d 512, ffn 2048, seq 256, 4 layers). Every round is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = {"dp": lambda n: f"{n}", "fsdp": lambda n: f"{n}", "megatron": lambda n: f"1,{n}",
          "megatron_wus": lambda n: f"{max(n // 2, 1)},{min(n, 2)}", "pipeline": lambda n: f"{n}",
          "moe": lambda n: f"{n}"}
SCALES = {1: [], 10: ["--d", "512", "--ffn", "2048", "--seq", "256", "--layers", "4"]}


def command(preset: str, ranks: int, scale: int, hardware: str, steps: int) -> list[str]:
    extra = {"pipeline": ["--layers", str(max(ranks, 2)), "--microbatches", "4"],
             "moe": ["--moe", "--experts", str(max(ranks, 2))]}.get(preset, [])
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return [mpiexec, "-n", str(ranks), sys.executable, os.path.join(HERE, "bench_train.py"), "--preset", preset,
            "--mesh", MESHES[preset](ranks), "--steps", str(steps), "--predict", hardware, *SCALES[scale], *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True, help="a profile (calibrate --hardware) of this machine")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--presets", nargs="+", default=list(MESHES))
    ap.add_argument("--scale", type=int, nargs="+", default=[1], choices=sorted(SCALES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--measured", default=None, metavar="LOG",
                    help="take the measured steps from this earlier run's output (its 'round ...' lines) and only "
                         "predict, from plans (bench_train.py --partition-only): for a changed predictor")
    args = ap.parse_args()
    if args.measured:
        return replan(args)
    rows = [(s, p, n) for s in args.scale for p in args.presets for n in args.ranks]
    measured: dict = {row: [] for row in rows}
    predicted: dict = {}
    for r in range(args.rounds):
        for row in rows:
            out = subprocess.run(command(row[1], row[2], row[0], args.hardware, args.steps), capture_output=True,
                                 text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                print(f"round {r + 1} {row}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            result = json.loads(lines[-1])
            measured[row].append(result["median_step_s"])
            predicted[row] = result["predicted_step_s"]
            print(f"round {r + 1} scale {row[0]:>2} {row[1]:13s} {row[2]} ranks: measured {result['median_step_s']:.4f} "
                  f"s, predicted {result['predicted_step_s']:.4f} s", flush=True)
    print(f"\n{'scale':>5} {'preset':13s} {'ranks':>5} {'measured min':>13} {'predicted':>10} {'pred/meas':>9}")
    for row in rows:
        if measured[row]:
            m, p = min(measured[row]), predicted[row]
            print(f"{row[0]:>5} {row[1]:13s} {row[2]:>5} {m:13.4f} {p:10.4f} {p / m:9.2f}")


def replan(args) -> None:
    """The table of an earlier run's measured rounds (``--measured``) against predictions planned now."""
    measured: dict = {}
    for line in open(args.measured):
        m = ROUND.match(line)
        if m:
            measured.setdefault((int(m["scale"]), m["preset"], int(m["ranks"])), []).append(float(m["seconds"]))
    print(f"measured: {args.measured} ({max(map(len, measured.values()))} rounds); predicted now on {args.hardware}")
    print(f"{'scale':>5} {'preset':13s} {'ranks':>5} {'measured min':>13} {'predicted':>10} {'pred/meas':>9}")
    for (scale, preset, ranks), seconds in measured.items():
        cmd = command(preset, ranks, scale, args.hardware, args.steps)[3:] + ["--partition-only"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        p = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["predicted_step_s"]
        print(f"{scale:>5} {preset:13s} {ranks:>5} {min(seconds):13.4f} {p:10.4f} {p / min(seconds):9.2f}", flush=True)


ROUND = re.compile(r"round \d+ scale +(?P<scale>\d+) (?P<preset>\S+) +(?P<ranks>\d+) ranks: measured "
                   r"(?P<seconds>[\d.]+) s")


if __name__ == "__main__":
    main()
