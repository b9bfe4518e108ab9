"""Interleaved timing rounds, ours against a PyTorch side process, shared by the *_vs_torch.py scripts here."""
from __future__ import annotations

import json
import subprocess


def interleaved_rounds(torch_cmd: list, env: dict, time_ours, rounds: int, steps: int) -> None:
    """``rounds`` rounds of (PyTorch, ours): the torch side is ``torch_cmd + ["--time-only", "--steps=N"]``, a
    process whose last stdout line is JSON with ``seconds``; ``time_ours(steps)`` returns our seconds. Prints
    every round and the ratio of the minima (the machine may be shared: a single round is not a figure)."""
    torch_times, our_times = [], []
    for r in range(rounds):
        out = subprocess.run(torch_cmd + ["--time-only", f"--steps={steps}"], check=True, env=env,
                             capture_output=True, text=True).stdout
        torch_times.append(json.loads(out.strip().splitlines()[-1])["seconds"])
        our_times.append(time_ours(steps))
        print(f"    round {r + 1}: PyTorch {torch_times[-1] * 1e3:8.2f} ms   ours {our_times[-1] * 1e3:8.2f} ms   "
              f"ours / PyTorch {our_times[-1] / torch_times[-1]:.2f}")
    print(f"    min ours / min PyTorch over the rounds: {min(our_times) / min(torch_times):.2f}")
