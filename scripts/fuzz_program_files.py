"""Fuzz of mutated program files: no file that loads may make the runtime crash (issue 30).

Base programs are the ones the project's own test cases build (``tests/op_cases*.py``: every op family's table
entry partitioned on a 2x3 mesh; ``tests/fuzz_programs.py``: random programs, some with loops; a small training
step). Each mutant is one base saved to JSON, one random edit made (a shape, dtype, attribute, donation,
parameter index, einsum spec, collective receive shape, fusion shapes or an operand) and the content hash
recomputed: what anyone who can write the file can do without the HMAC key. Every mutant then ends as one of

- ``refused``: ``load_program`` raised (the program check, or the file's decoding);
- ``ran correctly``: it ran on simulated ranks (every fusion a compiled C loop, ``SPMD_CPU_KERNEL_MIN=0``) and gave
  the base's outputs;
- ``ran, other result``: it ran and gave other values (a valid program computing something else: ``sum`` edited
  to ``max``);
- ``failed cleanly``: running raised a Python exception;
- ``crashed``: the process died (a segfault, an abort) or hung past ``--hang-s``: never acceptable.

Mutants run in worker subprocesses, a batch each; a worker that dies is restarted after the mutant it was
running, which counts as crashed, so a segfault is counted, not fatal. ``python scripts/fuzz_program_files.py
--count 3000`` prints the counts (and the crashed mutants' numbers: ``--show N`` reprints mutant N's edit).
``tests/unit/test_program_check.py`` runs a few hundred in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUTCOMES = ("refused", "ran correctly", "ran, other result", "failed cleanly", "crashed")
EDITS = ("shape", "dtype", "attribute", "donate", "parameter index", "einsum spec", "receive shape",
         "fusion shapes", "operand")
DTYPES = ("float32", "float64", "int32", "int64", "bool", "int8", "uint8", "complex64")
LETTERS = "abcdefghijklmnopqrstuvwxyzABZ"


# ------------------------------------------------------------------------------------------- the bases


def base_programs(quick: bool = False) -> list:
    """[(name, program)]: programs the project's test cases build (``quick``: fewer, for CI)."""
    sys.path[:0] = [os.path.join(ROOT, "tests")]
    import spmd_runtime as sr
    from fuzz_programs import random_case
    from op_cases import all_cases, partition_case
    mesh = sr.Mesh((2, 3), ("a", "b"))
    cases = all_cases()
    programs = [(f"case {c.name if hasattr(c, 'name') else k}", partition_case(c, c.specs[0], mesh)[1])
                for k, c in enumerate(cases[::4] if quick else cases)]
    for seed in range(6 if quick else 30):
        case = random_case(seed, max_devices=6, loops=seed % 3 == 0)
        programs.append((f"random {seed}", sr.partition(case.graph, case.mesh, in_specs=case.in_specs,
                                                        out_specs=case.out_specs)))
    if not quick:
        cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
        programs.append(("train step", sr.build_train_step(cfg, sr.train_mesh((2, 2), "megatron_wus"),
                                                           "megatron_wus", sr.AdamW(lr=0.1)).program))
    return programs


def inputs_for(program, seed: int = 0) -> list:
    """Global inputs of the program's shapes and dtypes (small integers: valid indices for a gather)."""
    rng = np.random.default_rng(seed)
    out = []
    for io in program.inputs:
        dtype = np.dtype(io.dtype) if io.dtype != "bfloat16" else np.float32
        if dtype.kind in "iu":
            out.append(rng.integers(0, 2, size=io.shape).astype(dtype))
        elif dtype.kind == "b":
            out.append(rng.random(io.shape) < 0.5)
        else:
            out.append(rng.uniform(0.5, 1.5, size=io.shape).astype(io.dtype))
    return out


def run_program(program, inputs) -> list:
    """The program's global outputs on simulated ranks (its mesh's size)."""
    import spmd_runtime as sr
    from spmd_runtime.comm import run_simulated
    return run_simulated(program.mesh.size, lambda comm: sr.run(program, *inputs, comm=comm), timeout=20.0)[0]


# ------------------------------------------------------------------------------------------- mutations


def _instrs(doc) -> list:
    """Every instruction dict of a saved program, loop bodies' included."""
    found = []
    for ins in doc["instrs"]:
        found.append(ins)
        for value in ins["attrs"].values():
            for v in (value if isinstance(value, list) else [value]):
                if isinstance(v, dict) and "program" in v:
                    found += _instrs(v["program"])
    return found


def _edit_shape(rng, shape):
    shape = list(shape)
    choice = rng.integers(4)
    if choice == 0 or not shape:
        shape.insert(int(rng.integers(len(shape) + 1)), int(rng.integers(1, 5)))
    elif choice == 1:
        shape.pop(int(rng.integers(len(shape))))
    else:
        d = int(rng.integers(len(shape)))
        shape[d] = max(0, shape[d] + int(rng.choice([-3, -1, 1, 2, 7, 1000])))
    return shape


def _edit_value(rng, value):
    """A nearby or out-of-range value of the same JSON kind (ints, lists of them, strings)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return int(value + rng.choice([-100, -2, -1, 1, 2, 5, 1 << 40]))
    if isinstance(value, float):
        return float(value * rng.choice([-1.0, 0.0, 1e300]))
    if isinstance(value, str):
        return value[::-1] if rng.random() < 0.5 else value + "x"
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return _edit_shape(rng, value)
    if isinstance(value, list) and value:
        edited = list(value)
        k = int(rng.integers(len(edited)))
        edited[k] = _edit_value(rng, edited[k])
        return edited
    return [0]


def mutate(doc: dict, rng, edit: str):
    """Apply one ``edit`` to a random fitting instruction of ``doc`` (in place); False when none fits."""
    instrs = _instrs(doc)
    fits = {
        "shape": lambda i: True, "dtype": lambda i: True, "attribute": lambda i: bool(i["attrs"]),
        "donate": lambda i: bool(i["args"]), "parameter index": lambda i: i["op"] == "parameter",
        "einsum spec": lambda i: "spec" in i["attrs"],
        "receive shape": lambda i: i["op"].startswith(("all_", "reduce_scatter", "collective_permute", "broadcast")),
        "fusion shapes": lambda i: "shapes" in i["attrs"], "operand": lambda i: bool(i["args"]),
    }[edit]
    chosen = [i for i in instrs if fits(i)]
    if not chosen:
        return False
    ins = chosen[int(rng.integers(len(chosen)))]
    if edit in ("shape", "receive shape"):
        ins["shape"] = _edit_shape(rng, ins["shape"])
    elif edit == "dtype":
        ins["dtype"] = str(rng.choice([d for d in DTYPES if d != ins["dtype"]]))
    elif edit == "attribute":
        name = sorted(ins["attrs"])[int(rng.integers(len(ins["attrs"])))]
        if isinstance(ins["attrs"][name], dict):
            return False
        ins["attrs"][name] = _edit_value(rng, ins["attrs"][name])
    elif edit == "donate":
        ins["donate"] = int(rng.integers(-1, len(ins["args"]) + 1))
    elif edit == "parameter index":
        ins["attrs"]["index"] = int(rng.choice([-1, 1, 2, 5, ins["attrs"]["index"] + 1]))
    elif edit == "einsum spec":
        spec = list(ins["attrs"]["spec"])
        k = int(rng.integers(len(spec)))
        if spec[k] in ",->":
            return False
        spec[k] = str(rng.choice(list(LETTERS)))
        ins["attrs"]["spec"] = "".join(spec)
    elif edit == "fusion shapes":
        shapes = ins["attrs"]["shapes"]
        k = int(rng.integers(len(shapes)))
        shapes[k] = _edit_shape(rng, shapes[k])
    elif edit == "operand":
        earlier = [i["out"] for i in instrs if i["out"] < ins["out"]] or [0]
        ins["args"][int(rng.integers(len(ins["args"])))] = int(rng.choice(earlier))
    return True


def rehash(doc: dict) -> None:
    """Recompute the content hash, as ``SPMDProgram.hash`` does (what an editor without the key can do)."""
    body = {k: doc[k] for k in ("mesh", "inputs", "outputs", "instrs", "notes", "names") if k in doc}
    doc["hash"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def mutant(bases_docs: list, number: int, seed: int):
    """(base index, edit, doc) of mutant ``number``: deterministic in (seed, number)."""
    rng = np.random.default_rng([seed, number])
    while True:
        base = int(rng.integers(len(bases_docs)))
        edit = EDITS[int(rng.integers(len(EDITS)))]
        doc = copy.deepcopy(bases_docs[base])
        if mutate(doc, rng, edit):
            rehash(doc)
            return base, edit, doc


# ------------------------------------------------------------------------------------------- running


def classify(doc: dict, folder: str, inputs, want) -> tuple[str, str]:
    """(outcome, what was raised) of one mutant (OUTCOMES, crashes aside: a crash never returns)."""
    import spmd_runtime as sr
    path = os.path.join(folder, "mutant.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    try:
        program = sr.load_program(path)
    except Exception as e:  # noqa: BLE001  (any refusal: the check's ProgramError, a decoding error)
        return "refused", _said(e)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):  # a failing rank's traceback, printed as the job ends
            got = run_program(program, inputs)
    except Exception as e:  # noqa: BLE001  (a clean failure: a Python exception, whatever its type)
        raised = [ln for ln in printed.getvalue().splitlines() if re.match(r"^\w+(Error|Exception): ", ln)]
        return "failed cleanly", raised[0][:200] if raised else _said(e)
    same = len(got) == len(want) and all(
        np.shape(g) == np.shape(w) and np.asarray(g).dtype == np.asarray(w).dtype
        and np.allclose(np.asarray(g, dtype=complex), np.asarray(w, dtype=complex), equal_nan=True)
        for g, w in zip(got, want))
    return ("ran correctly" if same else "ran, other result"), ""


def _said(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def worker(start: int, stop: int, seed: int, quick: bool) -> None:
    """Classify mutants [start, stop), printing ``<number> <outcome>`` after each (flushed)."""
    warnings.simplefilter("ignore")
    bases = base_programs(quick)
    folder = tempfile.mkdtemp(prefix="fuzz_program_files_")
    docs, inputs, wants = [], [], []
    for _, program in bases:
        program.save(os.path.join(folder, "base.json"))
        with open(os.path.join(folder, "base.json")) as f:
            docs.append(json.load(f))
        inputs.append(inputs_for(program))
        wants.append(run_program(program, inputs[-1]))
    print("ready", flush=True)
    for number in range(start, stop):
        base, edit, doc = mutant(docs, number, seed)
        outcome, said = classify(doc, folder, inputs[base], wants[base])
        print(f"{number}\t{outcome}\t{edit}\t{said}".replace("\n", " "), flush=True)


def fuzz(count: int, seed: int = 0, quick: bool = False, hang_s: float = 120.0, workers: int = 1,
         log=None, verbose=()) -> tuple[Counter, list]:
    """(outcome counts, crashed mutant numbers) of mutants [0, count), each worker a share of them; ``log`` gets a
    line per crash, and per mutant of an outcome in ``verbose`` (what it raised)."""
    with tempfile.TemporaryDirectory(prefix="fuzz_program_files_") as scratch:  # the workers' files, all removed
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=scratch,
                   SPMD_CPU_KERNEL_MIN="0", SPMD_CPU_KERNELS="1", SPMD_TIMEOUT="20", OMP_NUM_THREADS="1")
        return _fuzz(count, seed, quick, hang_s, workers, log, verbose, env)


def _fuzz(count, seed, quick, hang_s, workers, log, verbose, env) -> tuple[Counter, list]:
    shares = np.array_split(np.arange(count), max(1, workers))
    counts, crashed = Counter(), []
    running = [_Worker(int(s[0]), int(s[-1]) + 1, seed, quick, env) for s in shares if len(s)]
    while running:
        for w in list(running):
            line = w.next_line(hang_s)
            if line is None:  # died or hung: the mutant it was on crashed; go on after it
                crashed.append(w.at)
                counts["crashed"] += 1
                if log:
                    log(f"mutant {w.at}: crashed ({w.reason})")
                w.restart(w.at + 1)
            elif line != "ready":
                number, outcome, edit, said = line.split("\t", 3)
                counts[outcome] += 1
                w.at = int(number) + 1
                if log and outcome in verbose:
                    log(f"mutant {number} ({edit}): {outcome}: {said}")
            if w.at >= w.stop:
                w.close()
                running.remove(w)
    return counts, crashed


class _Worker:
    """One worker subprocess over mutants [at, stop); ``at``: the next one it classifies."""

    def __init__(self, start, stop, seed, quick, env):
        self.stop, self.seed, self.quick, self.env = stop, seed, quick, env
        self.restart(start)

    def restart(self, start):
        self.at, self.reason = start, ""
        if start >= self.stop:
            self.proc = None
            return
        args = [sys.executable, os.path.abspath(__file__), "--worker", str(start), str(self.stop), "--seed",
                str(self.seed)] + (["--quick"] if self.quick else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=self.env)
        self.ready = False

    def next_line(self, hang_s):
        """The worker's next line, or None when it died or printed nothing for ``hang_s`` (startup: 10x)."""
        if self.proc is None:
            return "ready"
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(hang_s * (1 if self.ready else 10)):
                self.proc.kill()
                self.proc.wait()
                self.reason = f"no progress in {hang_s:g} s"
                return None
        line = self.proc.stdout.readline()
        if not line:  # end of file: the worker died
            code = self.proc.wait()
            self.reason = f"exit {code}"
            return None
        line = line.rstrip("\n")
        self.ready = self.ready or line == "ready"
        return line

    def close(self):
        if self.proc is not None:
            self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer base programs (CI)")
    parser.add_argument("--hang-s", type=float, default=120.0)
    parser.add_argument("--why", action="append", default=[], choices=OUTCOMES,
                        help="print each mutant of this outcome with what it raised (repeatable)")
    parser.add_argument("--show", type=int, help="print mutant N's base and edit, then exit")
    parser.add_argument("--worker", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.seed, args.quick)
        return 0
    if args.show is not None:
        warnings.simplefilter("ignore")
        bases = base_programs(args.quick)
        folder = tempfile.mkdtemp()
        docs = []
        for _, program in bases:
            program.save(os.path.join(folder, "b.json"))
            docs.append(json.load(open(os.path.join(folder, "b.json"))))
        base, edit, doc = mutant(docs, args.show, args.seed)
        print(f"mutant {args.show}: base {bases[base][0]!r}, edit {edit!r}")
        json.dump(doc, open(os.path.join(folder, "mutant.json"), "w"))
        print(os.path.join(folder, "mutant.json"))
        return 0
    began = time.time()
    counts, crashed = fuzz(args.count, args.seed, args.quick, args.hang_s, args.workers, log=print,
                           verbose=args.why)
    print(f"{args.count} mutants in {time.time() - began:.0f} s: " + ", ".join(f"{o}: {counts[o]}" for o in OUTCOMES))
    if crashed:
        print(f"crashed: {crashed}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
