"""The Array API conformance suite (data-apis/array-api-tests) against spmd_runtime.numpy and against NumPy.

    python scripts/array_api_suite.py --suite /path/to/array-api-tests            # one process, then NumPy
    python scripts/array_api_suite.py --suite PATH --ranks 4                      # inputs split on a drawn dim
    python scripts/array_api_suite.py --suite PATH --only spmd -k test_add        # a part of the suite

The suite is not a package and is not copied here: give the path of a checkout (with its ``array-api``
submodule: the spec's signatures). It needs ``hypothesis`` and ``ndindex`` (``pip install -e .[arrayapi]``).
Both namespaces run the same tests with the same settings (``--max-examples``, derandomized, no deadline,
API version 2023.12): spmd_runtime through ``scripts/array_api/spmd_array_api.py`` (eager DArrays on a
mesh over the MPI world; ``--ranks N`` runs the suite under ``mpiexec -n N``, every rank drawing the same
examples, and counts rank 0's outcomes), NumPy as the suite's own reference. Prints passed / failed / skipped
per test file and in all, and spmd_runtime's passes as a share of NumPy's. Each test file runs on its own
(``--file-budget`` seconds at most: the tests it did not reach are not counted, and it says so); outcomes are
logged test by test (``scripts/array_api/spmd_suite_plugin.py``), so a run that dies in a test (at N ranks a
per-test ``--timeout`` aborts the MPI job) counts that one failed and goes on with the rest.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADAPTER = HERE / "array_api"
OUTCOMES = ("passed", "failed", "skipped")


def run_suite(namespace: str, suite: Path, args, log: Path, target: str = "array_api_tests") -> None:
    """``target``'s tests, each outcome appended to ``log`` (scripts/array_api/spmd_suite_plugin.py). A run that
    dies in a test (at N ranks a per-test timeout aborts the MPI job) counts that test failed and goes on after
    it, in a new run of the rest, until the file is done or past ``--file-budget`` seconds in all."""
    env = dict(os.environ, ARRAY_API_TESTS_MODULE=namespace, ARRAY_API_TESTS_VERSION="2023.12",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ADAPTER), str(HERE.parent), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", SPMD_SUITE_LOG=str(log),
               SPMD_SUITE_RANKS=str(args.ranks if namespace != "numpy" else 1))
    # A rank waiting in a collective yields its core (MPICH; else it spins): the suite runs N ranks, often more
    # than the cores, and an eager call is a few small collectives. ~2x per eager call at 4 ranks on 2 cores.
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", "-p", "spmd_suite_plugin",
           "--derandomize", "--hypothesis-seed=0", "--disable-deadline", f"--max-examples={args.max_examples}", "--disable-extension", "fft"]
    if args.k:
        cmd += ["-k", args.k]
    if args.timeout:
        cmd += [f"--timeout={args.timeout}"]
    if namespace != "numpy" and args.ranks > 1:
        mpiexec = str(Path(sys.executable).with_name("mpiexec"))
        cmd = [mpiexec, "-n", str(args.ranks), "bash", "-c",
               'if [ "$PMI_RANK" != 0 ]; then exec "$@" >/dev/null 2>&1; else exec "$@"; fi', "rank"] + cmd
    print(f"$ ({namespace}) {' '.join(cmd)}", flush=True)
    start, done = time.perf_counter(), set()
    while True:
        left = args.file_budget - (time.perf_counter() - start)
        finished = left > 0 and _run(cmd + [f"--deselect={t}" for t in sorted(done)], suite, env, args, left)
        outcomes, died_in = read_log(log)
        done = set(outcomes) | set(died_in)
        for test in died_in:
            print(f"  ({namespace}) {test}: the run died in it (counted failed)", flush=True)
            with open(log, "a") as f:
                f.write(f"failed\t{test}\n")
        if not died_in or not finished:
            break
    elapsed = time.perf_counter() - start
    print(f"  ({namespace}) {target}: {elapsed:.0f} s" + ("" if finished else
          f", past --file-budget {args.file_budget} s: the tests not run are not counted"), flush=True)


def _run(cmd, suite: Path, env, args, budget: float) -> bool:
    """Whether ``cmd`` ended within ``budget`` seconds (else it is stopped: SIGTERM, which mpiexec passes on to
    the ranks, then SIGKILL to its process group)."""
    proc = subprocess.Popen(cmd, cwd=suite, env=env, stdout=None if args.verbose else subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=budget)
        return True
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return False


def read_log(log: Path) -> tuple[dict[str, str], list[str]]:
    """({test id: outcome}, the tests started and never finished) from a plugin log."""
    outcomes, started = {}, {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        outcome, _, test = line.partition("\t")
        if outcome == "started":
            started[test] = True
        else:
            outcomes[test] = outcome
            started.pop(test, None)
    return outcomes, [t for t in started if t not in outcomes]


def by_file(log: Path) -> dict[str, collections.Counter]:
    """{test file: Counter(passed/failed/skipped)} from a plugin log."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for test, outcome in read_log(log)[0].items():
        counts[test.split("::")[0].split("/")[-1].removesuffix(".py")][outcome] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", type=Path, required=True, help="a checkout of data-apis/array-api-tests")
    ap.add_argument("--ranks", type=int, default=1, help="MPI ranks for spmd_runtime's run (default 1)")
    ap.add_argument("--max-examples", type=int, default=20)
    ap.add_argument("--only", choices=("spmd", "numpy"))
    ap.add_argument("-k", help="pytest's -k expression: a part of the suite")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    ap.add_argument("--verbose", action="store_true", help="show pytest's output")
    ap.add_argument("--files", nargs="+", default=None, help="test files of the suite (default: every one), each run "
                    "on its own so one slow file costs only itself")
    ap.add_argument("--file-budget", type=int, default=1800, help="seconds per test file and namespace")
    ap.add_argument("--logs", type=Path, help="a directory to keep the per-test outcome logs in (default: none kept)")
    args = ap.parse_args()
    if not (args.suite / "array-api" / "spec").is_dir():
        sys.exit(f"--suite must be a checkout of data-apis/array-api-tests with its array-api submodule "
                 f"(git submodule update --init); got {args.suite} without array-api/spec")
    results = {}
    files = args.files or sorted(p.name for p in (args.suite / "array_api_tests").glob("test_*.py"))
    with tempfile.TemporaryDirectory(prefix="array_api_") as tmp:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        tmp = args.logs or tmp
        for name, namespace in (("spmd", "spmd_array_api"), ("numpy", "numpy")):
            if args.only in (None, name):
                results[name] = collections.defaultdict(collections.Counter)
                for f in files:
                    log = Path(tmp) / f"{name}-{f}.log"
                    log.unlink(missing_ok=True)
                    run_suite(namespace, args.suite.resolve(), args, log, f"array_api_tests/{f}")
                    for where, counts in by_file(log).items():
                        results[name][where] += counts
    print_table(results, args)


def print_table(results, args) -> None:
    files = sorted({f for r in results.values() for f in r})
    print(f"\nArray API suite, {args.max_examples} examples per test, spmd_runtime on {args.ranks} rank(s)")
    print(f"{'file':45s}" + "".join(f"{name + ' ' + o[:4]:>13s}" for name in results for o in OUTCOMES))
    totals = {name: collections.Counter() for name in results}
    for f in files:
        row = f"{f:45s}"
        for name, r in results.items():
            totals[name] += r.get(f, collections.Counter())
            row += "".join(f"{r.get(f, {}).get(o, 0):13d}" for o in OUTCOMES)
        print(row)
    print(f"{'all':45s}" + "".join(f"{totals[name][o]:13d}" for name in results for o in OUTCOMES))
    if "spmd" in totals and "numpy" in totals and totals["numpy"]["passed"]:
        share = totals["spmd"]["passed"] / totals["numpy"]["passed"]
        print(f"spmd_runtime passes {totals['spmd']['passed']} of the {totals['numpy']['passed']} tests NumPy "
              f"passes: {share:.1%}")


if __name__ == "__main__":
    main()
