"""A small ResNet-like conv net's training step here and in PyTorch eager, side by side at 1 rank, 1 thread.

    python scripts/bench_convnet.py                       # 3 interleaved rounds (ours, torch, ours, torch, ...)
    python scripts/bench_convnet.py --rounds 5 --steps 30 --batch 32
    python scripts/bench_convnet.py --profile             # our step's time by op (no torch)

The net (NCHW, float32): a 3x3 stem conv (3 -> 16) with batch norm and ReLU, a 3x3 / stride 2 max-pool, three
basic blocks (two 3x3 convs with batch norm; the second and third halve the size with stride 2 and widen to 32
and 64 with a 1x1 / stride 2 shortcut conv), a global average pool and a linear head (10 classes), softmax
cross-entropy; batch norm in training mode (the batch's statistics, no running averages); one step is
forward + backward + SGD with momentum 0.9. Both sides start from the same weights and batch (written to an
.npz the PyTorch side, scripts/torch_convnet.py, reads under ``--torch-python``, default
/tmp/torchvenv/bin/python: torch is no dependency of spmd_runtime) and run the same number of steps, so the
first losses agree to float32 rounding; the last ones (after 18 steps of lr 0.05) drift apart by ~2e-3 relative,
as batch norm's float32 sums are added in another order (ours: two BLAS products; against a float64 run of the
same step ours is 4e-4 off, PyTorch's 1.6e-3). Each round prints the fastest of ``--steps`` timed
steps, in wall time and in process CPU time (less sensitive to a loaded machine); the summary takes the
minimum over rounds of each side and their ratios. The machine may be shared: read
every round.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import spmd_runtime as sr  # noqa: E402
import spmd_runtime.numpy as snp  # noqa: E402
from spmd_runtime.exec.runner import Runtime, communicator  # noqa: E402

EPS = 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))


def init(rng, batch, size, widths=(16, 32, 64), strides=(1, 2, 2), classes=10):
    """The parameters (PyTorch's names and OIHW layouts), one batch and its labels."""
    def conv(o, c, k):
        return (rng.standard_normal((o, c, k, k)) * np.sqrt(2.0 / (c * k * k))).astype(np.float32)

    def bn(name, c):
        p[name + ".gamma"], p[name + ".beta"] = np.ones(c, np.float32), np.zeros(c, np.float32)
    p = {"stem": conv(widths[0], 3, 3)}
    bn("stem_bn", widths[0])
    c = widths[0]
    for i, (w, s) in enumerate(zip(widths, strides)):
        p[f"b{i}.conv1"], p[f"b{i}.conv2"] = conv(w, c, 3), conv(w, w, 3)
        bn(f"b{i}.bn1", w)
        bn(f"b{i}.bn2", w)
        if s != 1 or w != c:
            p[f"b{i}.down"] = conv(w, c, 1)
            bn(f"b{i}.bnd", w)
        c = w
    p["fc.w"] = (rng.standard_normal((classes, c)) / np.sqrt(c)).astype(np.float32)
    p["fc.b"] = np.zeros(classes, np.float32)
    x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int32)
    return p, x, y


def batch_norm(x, p, name):
    mean = snp.mean(x, axis=(0, 2, 3), keepdims=True)
    centred = x - mean
    var = snp.mean(centred * centred, axis=(0, 2, 3), keepdims=True)
    scale = p[name + ".gamma"].reshape(1, -1, 1, 1) / snp.sqrt(var + EPS)
    return centred * scale + p[name + ".beta"].reshape(1, -1, 1, 1)


def conv(x, w, stride=1):
    pad = (w.shape[-1] - 1) // 2
    return snp.conv(x, w, (stride, stride), ((pad, pad), (pad, pad)))


def block(x, p, name, stride):
    h = sr.nn.relu(batch_norm(conv(x, p[name + ".conv1"], stride), p, name + ".bn1"))
    h = batch_norm(conv(h, p[name + ".conv2"]), p, name + ".bn2")
    skip = x if name + ".down" not in p else batch_norm(conv(x, p[name + ".down"], stride), p, name + ".bnd")
    return sr.nn.relu(h + skip)


def loss_fn(p, x, y, strides):
    h = sr.nn.relu(batch_norm(conv(x, p["stem"]), p, "stem_bn"))
    h = snp.reduce_window(h, "max", (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    for i, s in enumerate(strides):
        h = block(h, p, f"b{i}", s)
    side = h.shape[-1]
    h = snp.reduce_window(h, "avg", (1, 1, side, side), (1, 1, side, side)).reshape(h.shape[0], -1)
    return sr.nn.cross_entropy(h @ p["fc.w"].T + p["fc.b"], y)


def make_step(strides, lr):
    opt = sr.SGD(lr=lr, momentum=0.9)

    def step(params, state, x, y):
        loss, grads = sr.value_and_grad(lambda q: loss_fn(q, x, y, strides))(params)
        new_params, new_state = opt.update(params, grads, state)
        return new_params, new_state, loss
    return sr.jit(step, mesh=sr.Mesh((1,), ("data",))), opt


def ours(step, params, state, x, y, warmup, steps):
    """(first loss, last loss, fastest step s, fastest step's CPU s) over warmup + steps steps from ``params``."""
    times, cpu, first = [], [], None
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        params, state, loss = step(params, state, x, y)
        loss = float(np.asarray(loss))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        first = loss if first is None else first
    return first, loss, min(times[warmup:]), min(cpu[warmup:])


def torch_round(python, npz, warmup, steps, lr):
    cmd = [python, os.path.join(HERE, "torch_convnet.py"), "--npz", npz, "--warmup", str(warmup), "--steps",
           str(steps), "--lr", str(lr)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["first_loss"], r["last_loss"], r["min_step_s"], r["min_cpu_s"]


def profile(step, params, state, x, y, reps=5):
    """Our step's instructions timed one by one (this thread's CPU time, less sensitive to a loaded machine; the
    fastest of ``reps`` runs each), summed by op and shape."""
    program = step.lower(params, state, x, y)
    it = Runtime.world().interpreter(program, communicator(program.mesh), np)
    inputs = sr.pytree.flatten((params, state, x, y))[0]
    it.run(inputs)
    best, count = {}, collections.Counter()
    for rep in range(reps):
        env = {out: inputs[index] for out, index, free in it.params}
        for (out, fn, args, free), ins in zip(it.steps, [i for i in program.instrs if i.op != "parameter"]):
            t0 = time.thread_time()
            env[out] = fn(*[env[a] for a in args])
            best[out] = min(best.get(out, np.inf), time.thread_time() - t0)
            count[_key(ins)] += rep == 0
            for s in free:
                del env[s]
    total = collections.Counter()
    for ins in program.instrs:
        if ins.out in best:
            total[_key(ins)] += best[ins.out]
    print(f"{len(program.instrs)} instructions, {sum(total.values()) * 1e3:.2f} ms (sum of per-instruction minima)")
    for key, t in total.most_common(30):
        print(f"{t * 1e3:8.3f} ms {count[key]:4d}x  {key}")


def _key(ins):
    if ins.op in ("conv", "reduce_window"):
        return f"{ins.op} {tuple(ins.shape)} {dict((k, v) for k, v in ins.attrs.items() if k != 'padding')}"
    return ins.op if ins.op != "einsum" else "einsum " + ins.attrs["spec"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round (each round takes the fastest)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=32, help="image side")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", "/tmp/torchvenv/bin/python"))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    strides = (1, 2, 2)
    params, x, y = init(np.random.default_rng(0), args.batch, args.size, strides=strides)
    step, opt = make_step(strides, args.lr)
    state = opt.init_state(params)
    if args.profile:
        return profile(step, params, state, x, y)
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "convnet.npz")
        np.savez(npz, x=x, y=y, stages=np.asarray(strides), **{"p:" + k: v for k, v in params.items()})
        mine, theirs = [], []
        for r in range(args.rounds):
            a = ours(step, params, state, x, y, args.warmup, args.steps)
            b = torch_round(args.torch_python, npz, args.warmup, args.steps, args.lr)
            mine.append(a[2:])
            theirs.append(b[2:])
            print(f"round {r}: ours {a[2] * 1e3:8.2f} ms (cpu {a[3] * 1e3:7.2f})   torch {b[2] * 1e3:8.2f} ms "
                  f"(cpu {b[3] * 1e3:7.2f})   "
                  f"(losses first {a[0]:.6f} / {b[0]:.6f}, after {args.warmup + args.steps} steps {a[1]:.6f} / "
                  f"{b[1]:.6f})", flush=True)
    (wall, cpu), (twall, tcpu) = (np.min(mine, axis=0), np.min(theirs, axis=0))
    print(f"min over {args.rounds} rounds: ours {wall * 1e3:.2f} ms, torch {twall * 1e3:.2f} ms, ratio ours / torch "
          f"{wall / twall:.2f}; CPU time per step ours {cpu * 1e3:.2f} ms, torch {tcpu * 1e3:.2f} ms, ratio "
          f"{cpu / tcpu:.2f}  (batch {args.batch}, {args.size}x{args.size}, 1 thread each; loadavg "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
