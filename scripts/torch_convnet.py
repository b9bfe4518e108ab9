"""The PyTorch side of scripts/bench_convnet.py: the same small ResNet-like conv net, the same weights and batch
(read from the .npz the benchmark writes), forward + backward + SGD(momentum) step, eager, 1 thread.

PyTorch is NOT a dependency of spmd_runtime: the benchmark runs this under its own venv
(``--torch-python``, default /tmp/torchvenv/bin/python). Prints one JSON line: the first and last steps' losses,
the fastest of ``--steps`` timed steps in wall time and in this process's CPU time.

    /tmp/torchvenv/bin/python scripts/torch_convnet.py --npz /tmp/convnet.npz --steps 20
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

EPS = 1e-5


def batch_norm(x, p, name):
    return F.batch_norm(x, None, None, p[name + ".gamma"], p[name + ".beta"], training=True, eps=EPS)


def block(x, p, name, stride):
    h = F.relu(batch_norm(F.conv2d(x, p[name + ".conv1"], stride=stride, padding=1), p, name + ".bn1"))
    h = batch_norm(F.conv2d(h, p[name + ".conv2"], padding=1), p, name + ".bn2")
    skip = x if name + ".down" not in p else batch_norm(F.conv2d(x, p[name + ".down"], stride=stride), p,
                                                         name + ".bnd")
    return F.relu(h + skip)


def loss_fn(p, x, y, stages):
    h = F.relu(batch_norm(F.conv2d(x, p["stem"], padding=1), p, "stem_bn"))
    h = F.max_pool2d(h, 3, stride=2, padding=1)
    for i, stride in enumerate(stages):
        h = block(h, p, f"b{i}", stride)
    h = F.avg_pool2d(h, h.shape[-1]).flatten(1)
    return F.cross_entropy(h @ p["fc.w"].T + p["fc.b"], y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = np.load(args.npz)
    stages = [int(s) for s in data["stages"]]
    params = {k[2:]: torch.tensor(data[k], requires_grad=True) for k in data.files if k.startswith("p:")}
    x, y = torch.tensor(data["x"]), torch.tensor(data["y"]).long()
    opt = torch.optim.SGD(list(params.values()), lr=args.lr, momentum=0.9)
    times, cpu, first = [], [], None
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(params, x, y, stages)
        loss.backward()
        opt.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        first = float(loss) if first is None else first
        if i >= args.warmup:
            times.append(dt)
            cpu.append(dc)
    print(json.dumps({"first_loss": first, "last_loss": float(loss), "min_step_s": min(times), "min_cpu_s": min(cpu),
                      "median_step_s": sorted(times)[len(times) // 2]}))


if __name__ == "__main__":
    main()
