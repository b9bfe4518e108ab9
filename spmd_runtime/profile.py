"""Timelines of runs in the Chrome trace event format (open in Perfetto or chrome://tracing).

``sr.run(..., profile=DIR)``, ``sr.jit(fn, profile=DIR)`` or ``SPMD_PROFILE=DIR``
record one span per instruction ("X" events: op name, local shape, bytes, the user's source line where
the program was partitioned in this process; for
collectives also the mesh axes of the group, its size and the bytes on the
wire) plus one span per run, and write ``DIR/rank<r>.trace.json`` for each
rank (rewritten after every run, so the file always parses).
``python -m spmd_runtime profile DIR`` merges the ranks into
``DIR/merged.trace.json`` and prints the top ops and the time in MPI per rank.

Instrumenting wraps the bound instruction callables of a copy of the
interpreter, so a run without profiling pays nothing.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import time
from pathlib import Path

from .collective_kinds import BY_DONE
from .cost import collective_kind, group_size, wire_bytes

_active = threading.local()  # per thread: the simulated world runs one rank per thread
_recorders: dict = {}  # (directory, rank) -> Recorder, kept for the whole process
_lock = threading.Lock()


class Recorder:
    """The events of one rank, written to ``directory/rank<r>.trace.json``."""

    def __init__(self, directory: Path, rank: int):
        self.path, self.rank, self.events = directory / f"rank{rank}.trace.json", rank, []
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def span(self, name, cat, start_ns, stop_ns, args):
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                            "ts": start_ns / 1e3, "dur": max(stop_ns - start_ns, 0) / 1e3, "args": args})

    def write(self):
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)


@contextlib.contextmanager
def profiling(directory, label: str = "run"):
    """Within the block, interpreter runs on this thread are recorded under ``directory`` (default:
    ``$SPMD_PROFILE``; neither: nothing is recorded)."""
    directory = directory or os.environ.get("SPMD_PROFILE")
    if not directory or (directory == os.environ.get("SPMD_PROFILE") and getattr(_active, "session", None)):
        yield None
        return
    previous, _active.session = getattr(_active, "session", None), (Path(directory), label)
    try:
        yield _active.session
    finally:
        _active.session = previous


def instrument(interpreter):
    """``interpreter`` itself, or (while profiling) a copy whose steps record their spans."""
    session = getattr(_active, "session", None) or \
        ((Path(os.environ["SPMD_PROFILE"]), "run") if os.environ.get("SPMD_PROFILE") else None)
    if session is None:
        return interpreter
    directory, label = session
    rank = interpreter.mc.rank
    with _lock:
        rec = _recorders.get((directory, rank)) or _recorders.setdefault((directory, rank), Recorder(directory, rank))
    program = interpreter.program
    timed = copy.copy(interpreter)
    timed.steps = [(out, _timed(fn, program.instrs[out], program, rec), args, free)
                   for out, fn, args, free in interpreter.steps]
    run = timed.run

    def run_and_record(local_inputs):
        start = time.time_ns()
        outs = run(local_inputs)
        rec.span(label, "run", start, time.time_ns(), {"program": program.hash[:12],
                                                         "instructions": len(timed.steps)})
        rec.write()
        return outs
    timed.run = run_and_record
    return timed


def _timed(fn, ins, program, rec):
    args = {"slot": ins.out, "shape": list(ins.shape), "dtype": ins.dtype, "bytes": ins.nbytes}
    if ins.source:  # the user's line that made it (a loaded program has none)
        args["source"] = f"{ins.source[0]}:{ins.source[1]}"
    cat, kind = "compute", collective_kind(ins.op)
    if kind:
        cat, k = "comm", group_size(kind, ins.attrs, program.mesh)
        axes = ins.attrs.get("axes", program.mesh.axis_names)
        b_in = program.instrs[ins.args[0]].nbytes
        args.update(group=list(axes), group_size=k,
                    wire_bytes=wire_bytes(kind, k, b_in, ins.nbytes))
    elif ins.op in BY_DONE:
        cat = "comm"  # the wait of a nonblocking collective (partition/schedule.py)

    def step(*xs):
        start = time.time_ns()
        out = fn(*xs)
        rec.span(ins.op, cat, start, time.time_ns(), args)
        return out
    return step


# ---------------------------------------------------------------- merge and summarise
def load_traces(directory) -> dict[int, list[dict]]:
    """rank -> its "X" events, from every ``rank<r>.trace.json`` in ``directory``."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.trace.json")):
        doc = json.loads(path.read_text())
        events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        out[int(path.name[4:].split(".")[0])] = events
    if not out:
        raise FileNotFoundError(f"a profile directory holds rank<r>.trace.json files; got none in {directory}")
    return out


def summarize(directory, top: int = 10) -> str:
    """Merge the ranks into ``merged.trace.json``; a table of the top ops and the time in MPI per rank."""
    traces = load_traces(directory)
    merged = [e for events in traces.values() for e in events]
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in traces]
    (Path(directory) / "merged.trace.json").write_text(json.dumps({"traceEvents": meta + merged}))
    per_op: dict = {}
    for e in merged:
        if e["cat"] in ("compute", "comm"):
            t = per_op.setdefault(e["name"], [0.0, 0, 0])
            t[0] += e["dur"]
            t[1] += 1
            t[2] += e["args"].get("bytes", 0)
    lines = [f"profile of {len(traces)} rank(s) in {directory} (merged: {Path(directory) / 'merged.trace.json'})",
             f"{'op':<22}{'calls':>8}{'total ms':>12}{'mean us':>10}{'MB out':>10}"]
    for name, (dur, n, nbytes) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{name:<22}{n:>8}{dur / 1e3:>12.3f}{dur / n:>10.1f}{nbytes / 1e6:>10.2f}")
    lines.append(f"{'rank':<6}{'runs':>6}{'run ms':>10}{'compute ms':>12}{'MPI ms':>10}{'MPI %':>8}{'wire MB':>10}")
    for r, events in sorted(traces.items()):
        run = sum(e["dur"] for e in events if e["cat"] == "run")
        comp = sum(e["dur"] for e in events if e["cat"] == "compute")
        comm = sum(e["dur"] for e in events if e["cat"] == "comm")
        wire = sum(e["args"].get("wire_bytes", 0) for e in events if e["cat"] == "comm")
        runs = sum(1 for e in events if e["cat"] == "run")
        pct = 100 * comm / run if run else 0.0
        lines.append(f"{r:<6}{runs:>6}{run / 1e3:>10.3f}{comp / 1e3:>12.3f}{comm / 1e3:>10.3f}{pct:>8.1f}"
                     f"{wire / 1e6:>10.3f}")
    return "\n".join(lines)


def step_breakdown(directory) -> dict[int, dict]:
    """rank -> {"compute": ms, "comm": ms, "runs": n}: for the per-step bar chart."""
    out = {}
    for r, events in load_traces(directory).items():
        out[r] = {"compute": sum(e["dur"] for e in events if e["cat"] == "compute") / 1e3,
                  "comm": sum(e["dur"] for e in events if e["cat"] == "comm") / 1e3,
                  "runs": sum(1 for e in events if e["cat"] == "run")}
    return out
