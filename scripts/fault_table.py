"""Run every fault-injection case of tests/faults and print the table: fault, exit time, exit status, what
each rank printed.

    python scripts/fault_table.py [-k SUBSTRING] [--width 150]

The cases, the launcher and the timing are those of ``tests/faults/test_faults.py`` (one mpiexec job per
case, run concurrently; exit time counted from the fault). Per rank the table shows that rank's first
``spmd_runtime:`` message in one line (a traceback's exception, a report's indented lines appended; else the
rank's last line), and the launcher's verdict when it printed one; the harness's own
markers (``FAULT ...``, ``rank N has pid ...``) are left out.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))

import test_faults  # noqa: E402  (the cases and their runner)

_RANK_LINE = re.compile(r"^\[(\d+)\] (.*)$")
_MARKERS = re.compile(r"^(FAULT \d|rank \d+ has pid|rank \d+ finished)")
_LAUNCHER = ("BAD TERMINATION", "EXIT STRING", "PID ")


def printed(output: str, n: int, width: int) -> list[str]:
    """One trimmed line per rank, then the launcher's lines that name a process or a signal."""
    by_rank: dict[int, list[str]] = {r: [] for r in range(n)}
    launcher = []
    for line in output.splitlines():
        got = _RANK_LINE.match(line)
        if got and int(got.group(1)) in by_rank:
            text = got.group(2).rstrip()
            if text.strip() and not _MARKERS.match(text):
                by_rank[int(got.group(1))].append(text)
        elif any(word in line for word in _LAUNCHER):
            launcher.append(line.strip(" =\t"))
    cells = [f"r{rank}: " + _trim(_message(rank, lines), width) for rank, lines in by_rank.items()]
    return cells + [f"mpiexec: {_trim(line, width)}" for line in launcher]


def _message(rank: int, lines: list[str]) -> str:
    """A rank's first spmd_runtime message in one line: its header, then the exception a traceback ends
    with, or the report's indented lines; else the rank's last line."""
    start = next((i for i, t in enumerate(lines) if t.startswith("spmd_runtime:")), None)
    if start is None:
        return lines[-1].strip() if lines else "(nothing)"
    block = [lines[start]]
    for t in lines[start + 1:]:
        if t.startswith("spmd_runtime:") or t.startswith("Abort("):
            break
        block.append(t)
    head = re.sub(rf"^spmd_runtime: (rank {rank}: )?", "", block[0])  # the watcher's line keeps its prefix
    if any(t.startswith("Traceback") for t in block):
        return f"{head} … {block[-1].strip()}"
    return " / ".join([head] + [t.strip() for t in block[1:] if t.startswith(" ")])


def _trim(text: str, width: int) -> str:
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= width else text[:width - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the cases whose name contains this")
    parser.add_argument("--width", type=int, default=230, help="characters kept of each printed line")
    args = parser.parse_args()
    cases = [c for c in test_faults.CASES if args.k in c.name]
    with tempfile.TemporaryDirectory(prefix="faults.") as top:
        results = test_faults.run_cases(cases, lambda case: tempfile.mkdtemp(dir=top))
    print("| fault | exit (s) | status | what each rank printed |")
    print("|---|---|---|---|")
    for case in cases:
        r = results[case.name]
        status = "hung (killed)" if r["rc"] is None else str(r["rc"])
        shown = "<br>".join(f"`{cell}`" for cell in printed(r["output"], case.n, args.width))
        ranks = f" ({case.n} ranks)" if case.n != 2 and "ranks" not in case.name else ""
        print(f"| {case.name}{ranks} | {r['seconds']:.1f} | {status} | {shown} |")


if __name__ == "__main__":
    main()
