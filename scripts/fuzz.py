"""Differential fuzzing driver: random programs partitioned on random meshes vs the reference evaluator.

    python scripts/fuzz.py --seeds 0:2000            # in-process simulated ranks
    python scripts/fuzz.py --seeds 0:2000 --donate   # every input donated
    python scripts/fuzz.py --seeds 0:2000 --loops    # each case ending in one or two scans / while loops
    mpiexec -n 4 python scripts/fuzz.py --mpi --seeds 0:300

Prints each failing seed with its error; a failing seed reproduces exactly with
``random_case(seed)`` (``loops=True`` with --loops) in tests/fuzz_programs.py (add it to tests/unit/test_fuzz_regressions.py).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import spmd_runtime as sr  # noqa: E402
from fuzz_programs import check_case, random_case  # noqa: E402


def simulated(program, inputs):
    from spmd_runtime.comm import run_simulated
    return run_simulated(program.mesh.size, lambda comm: sr.run(program, *inputs, comm=comm))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0:500", help="start:stop")
    ap.add_argument("--mpi", action="store_true", help="run under the real MPI world (same seeds on every rank)")
    ap.add_argument("--donate", action="store_true", help="every input donated (partition(donate=...))")
    ap.add_argument("--loops", action="store_true", help="each case ends in one or two loops (scan, while)")
    args = ap.parse_args()
    start, stop = (int(v) for v in args.seeds.split(":"))
    warnings.simplefilter("ignore")
    world, rank = 8, 0
    if args.mpi:
        from mpi4py import MPI
        world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    run = (lambda p, x: sr.run(p, *x)) if args.mpi else simulated
    failures, t0 = [], time.perf_counter()
    for seed in range(start, stop):
        case = random_case(seed, devices=world if args.mpi else None, loops=args.loops)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                check_case(case, run, donate=range(len(case.inputs)) if args.donate else ())
        except Exception as e:  # noqa: BLE001 - report every kind of failure
            failures.append(seed)
            if rank == 0:
                print(f"seed {seed}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if rank == 0:
        print(f"{stop - start} seeds, {len(failures)} failures, {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
