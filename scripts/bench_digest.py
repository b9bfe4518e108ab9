"""What the digests of values promised the same on every rank cost (issue 30): ``sr.device_put`` of a 64 MiB
global array, and one training step of ``scripts/bench_train.py``'s reference config (2 layers, d 256, 8 heads,
ffn 1024, vocab 1024, seq 128, batch 8; preset dp, AdamW, float32), each with the check on and off
(``check_inputs=``), in interleaved rounds. Prints every round, the minimum of each side and their ratio (on
over off), then one JSON line. Times are the slowest rank's (each call starts after a barrier).

Run under MPI, e.g.:
    mpiexec -n 2 python scripts/bench_digest.py            # --rounds 3 --reps 5 --steps 5 --mib 64
The digest is xxhash's xxh3_64 where xxhash is installed (pip install spmd_runtime[digest]), else zlib's crc32:
the line says which.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread per rank: ranks share the cores

import numpy as np  # noqa: E402  (after the thread count is in the environment)
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import spmd_runtime as sr  # noqa: E402
from spmd_runtime.comm import agreement  # noqa: E402
from spmd_runtime.models.lm import LMConfig  # noqa: E402
from spmd_runtime.optim import AdamW  # noqa: E402
from spmd_runtime.train import build_train_step_on_root, train_mesh  # noqa: E402

REFERENCE = LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=8)  # bench_train's defaults


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each side")
    ap.add_argument("--reps", type=int, default=5, help="device_put calls per round (its fastest counts)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per round (their median counts)")
    ap.add_argument("--mib", type=int, default=64, help="MiB of the device_put array")
    return ap.parse_args(argv)


def slowest(comm, fn) -> float:
    """Seconds of ``fn()`` on the slowest rank, started together."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def interleaved(comm, name: str, rounds: int, measure) -> dict:
    """``measure(check)`` for check on and off, alternating, ``rounds`` times; prints each round."""
    times = {True: [], False: []}
    for r in range(rounds):
        for check in (True, False) if r % 2 == 0 else (False, True):  # alternate which side goes first
            times[check].append(measure(check))
        if comm.Get_rank() == 0:
            print(f"{name} round {r}: check on {times[True][-1] * 1e3:.3f} ms, off {times[False][-1] * 1e3:.3f} ms",
                  flush=True)
    on, off = min(times[True]), min(times[False])
    if comm.Get_rank() == 0:
        print(f"{name}: min on {on * 1e3:.3f} ms, min off {off * 1e3:.3f} ms, ratio on/off {on / off:.3f}, "
              f"added {(on - off) * 1e3:.3f} ms", flush=True)
    return {"on_s": times[True], "off_s": times[False], "min_on_s": on, "min_off_s": off, "ratio": on / off}


def bench_device_put(comm, args) -> dict:
    n = comm.Get_size()
    x = np.random.default_rng(0).standard_normal(((args.mib << 20) // 8 // 1024, 1024))  # float64, the same on all
    mesh = sr.Mesh((n,), ("x",))
    sr.device_put(x, sr.P("x"), mesh, comm=comm)  # the mesh communicator, made once
    digest_alone = min(slowest(comm, lambda: agreement.digest(x)) for _ in range(args.reps))
    if comm.Get_rank() == 0:
        print(f"digest of {x.nbytes >> 20} MiB alone ({agreement.DIGEST}): {digest_alone * 1e3:.3f} ms", flush=True)

    def measure(check):
        return min(slowest(comm, lambda: sr.device_put(x, sr.P("x"), mesh, comm=comm, check_inputs=check))
                   for _ in range(args.reps))
    return {"bytes": x.nbytes, "digest_alone_s": digest_alone,
            **interleaved(comm, f"device_put {x.nbytes >> 20} MiB", args.rounds, measure)}


def bench_train_step(comm, args) -> dict:
    cfg, n = REFERENCE, comm.Get_size()
    ts = build_train_step_on_root(cfg, train_mesh((n,), "dp"), "dp", AdamW(), comm)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    held = {"local": ts.shard_state(ts.init(0), comm.Get_rank())}
    for _ in range(2):  # warm-up: binding, first allocations
        held["local"], _ = ts.step(held["local"], x, y, comm=comm)

    def one(check):
        held["local"], _ = ts.step(held["local"], x, y, comm=comm, check_inputs=check)

    def measure(check):
        return float(np.median([slowest(comm, lambda: one(check)) for _ in range(args.steps)]))
    batch = [np.asarray(b, np.int64) for b in (x, y)]  # what the step digests (its token dtype)
    alone = min(_seconds(lambda: agreement.digests(batch)) for _ in range(200))  # too short for the step's noise
    if comm.Get_rank() == 0:
        print(f"digests of the batch alone ({sum(b.nbytes for b in batch)} bytes): {alone * 1e6:.1f} us", flush=True)
    return {"config": {k: getattr(cfg, k) for k in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch")},
            "preset": "dp", "batch_bytes_digested": sum(b.nbytes for b in batch), "batch_digest_alone_s": alone,
            **interleaved(comm, "TrainStep.step (reference config, dp)", args.rounds, measure)}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    args, comm = parse_args(), MPI.COMM_WORLD
    sr.distributed.initialize()
    load = os.getloadavg()
    put = bench_device_put(comm, args)
    step = bench_train_step(comm, args)
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": comm.Get_size(), "digest": agreement.DIGEST, "device_put": put,
                          "train_step": step, "loadavg_start": list(load), "loadavg_end": list(os.getloadavg())}))


if __name__ == "__main__":
    main()
