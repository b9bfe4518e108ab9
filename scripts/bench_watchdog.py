"""Cost of the job guard's watchdog thread on small collectives: A/B within one job.

Run under MPI:  mpiexec -n 2 python scripts/bench_watchdog.py [--rounds 10] [--iters 2000]

Alternates blocks of ``--iters`` 8-byte all-reduces (our bound collective, as the interpreter runs it) with
the watchdog thread running and stopped, ``--rounds`` times each, interleaved (on, off, on, off, ...), so
both sides see the same machine state. Prints every round's median latency (max over ranks) and the minimum
of each side with their ratio. The hot path itself records nothing (the thread samples stacks 10x a second).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd_runtime.comm import collectives, jobguard, watchdog  # noqa: E402
from spmd_runtime.comm.communicator import MeshCommunicator  # noqa: E402
from spmd_runtime.mesh import Mesh  # noqa: E402

WORLD = MPI.COMM_WORLD


def block(run, x, iters: int) -> float:
    """Median latency over ``iters`` calls in microseconds, max over ranks (as bench_collectives.py)."""
    WORLD.Barrier()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t)
    return WORLD.allreduce(statistics.median(times) * 1e6, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    mesh = Mesh((WORLD.Get_size(),), ("x",))
    mc = MeshCommunicator(mesh, WORLD)
    run = collectives.bind(mc, "all_reduce", np, (1,), np.float64, axes=("x",), op="sum")
    x = np.ones(1)
    dog = jobguard._state.pop("watchdog", None)
    if dog is not None:  # the guard's own thread: stop it, the A/B below starts and stops its own
        dog.stop()
    on, off = [], []
    for r in range(args.rounds):
        d = watchdog.Watchdog(WORLD, jobguard.abort_job, 300.0).start()
        on.append(block(run, x, args.iters))
        d.stop()
        off.append(block(run, x, args.iters))
        if WORLD.Get_rank() == 0:
            print(f"round {r}: watchdog on {on[-1]:.2f} us, off {off[-1]:.2f} us", flush=True)
    if WORLD.Get_rank() == 0:
        print(f"all_reduce 8 B, {WORLD.Get_size()} ranks: min on {min(on):.2f} us, min off {min(off):.2f} us, "
              f"ratio on/off {min(on) / min(off):.3f}")


if __name__ == "__main__":
    main()
