"""The cost of recording the user's line on every traced node (``trace.user_line``, JAX's source_info): tracing
CPU time of the LM training step with the capture on and off, in interleaved pairs (a shared machine's drifts
cancel within a pair); prints the minimum of each and the median of the paired ratios.

    python scripts/bench_source_info.py --layers 8 --rounds 15
"""
from __future__ import annotations

import argparse
import sys
import time

import spmd_runtime as sr

from bench_partition import traced

TRACE = sys.modules["spmd_runtime.trace"]  # the module (sr.trace is the function)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    mesh, real = sr.Mesh((2, 4), ("x", "y")), TRACE.user_line
    times: dict = {"on": [], "off": []}
    try:
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 else ("off", "on"):
                TRACE.user_line = real if mode == "on" else (lambda: None)
                times[mode].append(traced(args.layers, "megatron", mesh, time.process_time)[3])
    finally:
        TRACE.user_line = real
    ratios = sorted(a / b for a, b in zip(times["on"], times["off"]))
    print(f"layers {args.layers}: trace CPU s, capture on min {min(times['on']):.4f}, off min "
          f"{min(times['off']):.4f}; median paired overhead {100 * (ratios[len(ratios) // 2] - 1):.1f}%")


if __name__ == "__main__":
    main()
