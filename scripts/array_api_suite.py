"""The Array API conformance suite (data-apis/array-api-tests) against spmd_runtime.numpy and against NumPy.

    python scripts/array_api_suite.py --suite /path/to/array-api-tests            # one process, then NumPy
    python scripts/array_api_suite.py --suite PATH --ranks 4                      # inputs split on a drawn dim
    python scripts/array_api_suite.py --suite PATH --only spmd -k test_add        # a part of the suite

The suite is not a package and is not copied here: give the path of a checkout (with its ``array-api``
submodule: the spec's signatures). It needs ``hypothesis`` and ``ndindex`` (``pip install -e .[arrayapi]``).
Both namespaces run the same tests with the same settings (``--max-examples``, derandomized, no deadline,
API version 2023.12): spmd_runtime through ``scripts/array_api/spmd_array_api.py`` (eager DArrays on a
mesh over the MPI world; ``--ranks N`` runs the suite under ``mpiexec -n N``, every rank drawing the same
examples, and counts rank 0's report), NumPy as the suite's own reference. Prints passed / failed / skipped
per test file and in all, and spmd_runtime's passes as a share of NumPy's. Each test file runs on its own
(``--file-budget`` seconds at most: a file past it counts nothing, and says so).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADAPTER = HERE / "array_api"
OUTCOMES = ("passed", "failed", "skipped")


def run_suite(namespace: str, suite: Path, args, report: Path, target: str = "array_api_tests") -> None:
    env = dict(os.environ, ARRAY_API_TESTS_MODULE=namespace, ARRAY_API_TESTS_VERSION="2023.12",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ADAPTER), str(HERE.parent), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", "--derandomize",
           "--disable-deadline", f"--max-examples={args.max_examples}", f"--junitxml={report}", "-o",
           "junit_family=xunit1", "--disable-extension", "fft"]
    if args.k:
        cmd += ["-k", args.k]
    if args.timeout:
        cmd += [f"--timeout={args.timeout}"]
    if namespace != "numpy" and args.ranks > 1:
        mpiexec = str(Path(sys.executable).with_name("mpiexec"))
        cmd = [mpiexec, "-n", str(args.ranks), "bash", "-c",
               f'if [ "$PMI_RANK" != 0 ]; then exec "$@" --junitxml=/dev/null >/dev/null 2>&1; else exec "$@"; fi',
               "rank"] + cmd
    print(f"$ ({namespace}) {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        subprocess.run(cmd, cwd=suite, env=env, stdout=subprocess.DEVNULL if not args.verbose else None, check=False,
                       timeout=args.file_budget)
        print(f"  ({namespace}) {target}: {time.perf_counter() - start:.0f} s", flush=True)
    except subprocess.TimeoutExpired:
        print(f"  ({namespace}) {target}: past --file-budget {args.file_budget} s, not counted", flush=True)


def outcomes(report: Path) -> dict[str, collections.Counter]:
    """{test file: Counter(passed/failed/skipped)} from a junit report (errors count as failed)."""
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(report).getroot().iter("testcase"):
        where = (case.get("file") or case.get("classname", "?").replace(".", "/")).split("/")[-1]
        where = where.removesuffix(".py").split("::")[0]
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        by_file[where][outcome] += 1
    return by_file


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
    args = ap.parse_args()
    if not (args.suite / "array-api" / "spec").is_dir():
        sys.exit(f"--suite must be a checkout of data-apis/array-api-tests with its array-api submodule "
                 f"(git submodule update --init); got {args.suite} without array-api/spec")
    results = {}
    files = args.files or sorted(p.name for p in (args.suite / "array_api_tests").glob("test_*.py"))
    with tempfile.TemporaryDirectory(prefix="array_api_") as tmp:
        for name, namespace in (("spmd", "spmd_array_api"), ("numpy", "numpy")):
            if args.only in (None, name):
                results[name] = collections.defaultdict(collections.Counter)
                for f in files:
                    report = Path(tmp) / f"{name}-{f}.xml"
                    run_suite(namespace, args.suite.resolve(), args, report, f"array_api_tests/{f}")
                    for where, counts in (outcomes(report) if report.exists() else {}).items():
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
