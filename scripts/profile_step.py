"""Where one training step's time goes: times every interpreter instruction of a 1-rank step, by op.

    python scripts/profile_step.py          # reference config, dp on a (1,) mesh, 1 BLAS thread
    SPMD_FUSE=0 python scripts/profile_step.py    # unfused program (one instruction per elementwise op)
    SPMD_PROFILE_CLOCK=cpu python scripts/profile_step.py  # this thread's CPU time (less sensitive to load)
    python scripts/profile_step.py --batch 4     # half the batch: one rank's share of a 2-rank dp step
    python scripts/profile_step.py --batch 4 --donate --scan-layers --microbatches 2   # memory of a looped step
(Set OMP_NUM_THREADS / OPENBLAS_NUM_THREADS before running to change the BLAS threads.) Two at once, no MPI,
give the compute floor of a 2-rank dp step on this machine:
    python scripts/profile_step.py --batch 4 & python scripts/profile_step.py --batch 4; wait
Each instruction's time is its minimum over REPS runs (a shared machine inflates some of them).
"""
import os
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import argparse
import collections
import time

import numpy as np
import spmd_runtime as sr
from spmd_runtime.exec.runner import Runtime, communicator
# Layers unrolled by default: a per-op profile (scanned layers put the whole stack in one "scan" instruction).
ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--donate", action="store_true", help="the state updated in place (build_train_step(donate=True))")
ap.add_argument("--scan-layers", action="store_true", help="layers as one scan (the profile then shows it as one op)")
ap.add_argument("--microbatches", type=int, default=1, help="gradients accumulated over this many micro-batches")
ARGS = ap.parse_args()
B = ARGS.batch
cfg = sr.LMConfig(layers=2, d=256, heads=8, ffn=1024, vocab=1024, seq=128, batch=B, scan_layers=ARGS.scan_layers)
ts = sr.build_train_step(cfg, sr.train_mesh((1,), "dp"), "dp", sr.AdamW(), donate=ARGS.donate,
                         microbatches=ARGS.microbatches)
prog = ts.program
state = ts.init(0)
rng = np.random.default_rng(0)
tok = rng.integers(0, 1024, (B, 128)).astype(np.int32)
inputs = sr.pytree.flatten((state["params"], state["opt_state"], {"tokens": tok, "labels": tok.copy()}))[0]
mc = communicator(prog.mesh)
it = Runtime.world().interpreter(prog, mc, np)
it.run(inputs)
# Memory a second run allocates: NumPy reports its buffers to tracemalloc. "peak" is the most the run held
# on top of what was live before it; "kept" what is still live after it (its outputs, dropped afterwards).
import tracemalloc
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
outs = it.run(inputs)
after, peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
out_bytes = sum(o.nbytes for o in outs)
print(f"instructions {len(prog.instrs)} ({sum(i.op == 'fusion' for i in prog.instrs)} fusions); second run: "
      f"peak {(peak - before) / 2**20:.1f} MiB above the start, kept {(after - before) / 2**20:.1f} MiB, "
      f"outputs {out_bytes / 2**20:.1f} MiB")
del outs
clock = time.thread_time if os.environ.get("SPMD_PROFILE_CLOCK") == "cpu" else time.perf_counter
REPS = 5
best = {}; n = collections.Counter()
walls = []
for rep in range(REPS):
    start = time.perf_counter()
    env = {}
    for out, index, free in it.params:
        env[out] = inputs[index]
    for (out, fn, args, free), ins in zip(it.steps, [i for i in prog.instrs if i.op != "parameter"]):
        t0 = clock(); env[out] = fn(*[env[a] for a in args]); dt = clock() - t0
        key = ins.op if ins.op != "einsum" else "einsum " + ins.attrs["spec"]
        best[out] = min(best.get(out, dt), dt); n[key] += rep == 0
        for s in free: del env[s]
    walls.append(time.perf_counter() - start)
t = collections.Counter()
for ins in prog.instrs:
    if ins.out in best:
        t[ins.op if ins.op != "einsum" else "einsum " + ins.attrs["spec"]] += best[ins.out]
total = sum(t.values()); print(f"total {total*1e3:.1f} ms/step (sum of per-instruction minima); batch {B}; whole step wall min {min(walls)*1e3:.1f} ms")
for k, v in t.most_common(22): print(f"{v*1e3:8.2f} ms  {n[k]:4d}x  {k}")
def sums(key):  # an einsum that contracts a letter (BLAS); one that sums nothing is a broadcast multiply
    ins, out = key.split()[1].split("->")
    return any(c not in out for c in ins.replace(",", ""))
groups = collections.Counter()
for k, v in t.items():
    g = ("einsum (BLAS)" if sums(k) else "elementwise") if k.startswith("einsum") else "elementwise" if k in ("mul","add","sub","div","exp","tanh","select","neg","sqrt","log","maximum","minimum","pow","convert","eq","gt","lt","ge","le","ne","abs", "fusion") else k
    groups[g] += v
for k, v in groups.most_common(8): print(f"GROUP {v*1e3:8.1f} ms  {k}")
