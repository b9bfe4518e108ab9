#!/usr/bin/env python
"""``spmd_runtime.models.resnet`` against the same BasicBlock ResNet in PyTorch (torch.nn, torchvision's module
names; written below, torchvision itself is not needed) on the same weights: logits, loss, every gradient and
the updated batch-norm running statistics in training mode, at 1 rank and on simulated meshes (batch split,
channels split, images split spatially), and optionally the step time side by side.

    /work/main/.venv/bin/python scripts/resnet_vs_torch.py [--torch-python /tmp/torchvenv/bin/python] \\
        [--meshes 1:dp,2x2:dp,2x2:megatron,2x2:spatial] [--rounds 3]

The PyTorch half runs under ``--torch-python`` and writes .npy files to ``--workdir``; this half (the project's
venv) loads them (float32 rounding expected). A ReLU input within float32 rounding of 0 can flip its
derivative between meshes (the batch statistics are summed in another order): with ``--seed 0`` one of the
16384 inputs of layer2's last ReLU is 2e-6, and on 2 or 4 ranks the gradients of everything below it move by
~1e-2 of their scale, while logits, loss and statistics agree to rounding. The default seed has no such input.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_vs_torch import load, mesh_list  # noqa: E402  (this directory's sibling script)
from side_by_side import interleaved_rounds  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-python", default="/tmp/torchvenv/bin/python")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--widths", default="16,32,64")
    ap.add_argument("--blocks", default="1,1,1")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--meshes", default="1:dp,2x2:dp,2x2:megatron,2x2:spatial",
                    help="SHAPE:PRESET items; preset 'spatial' splits the batch on data and the image rows on model")
    ap.add_argument("--rounds", type=int, default=0, help="then time forward + backward: interleaved rounds")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


# ================================================================ the PyTorch half
def torch_model(a):
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.downsample = None
            if stride != 1 or c_in != c_out:
                self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet(nn.Module):
        def __init__(self, widths, blocks, classes):
            super().__init__()
            self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(widths[0])
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            c_in = widths[0]
            for s, (width, count) in enumerate(zip(widths, blocks)):
                layer = []
                for b in range(count):
                    layer.append(BasicBlock(c_in, width, 2 if s > 0 and b == 0 else 1))
                    c_in = width
                setattr(self, f"layer{s + 1}", nn.Sequential(*layer))
            self.depth = len(widths)
            self.fc = nn.Linear(widths[-1], classes)

        def forward(self, x):
            x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
            for s in range(self.depth):
                x = getattr(self, f"layer{s + 1}")(x)
            return self.fc(x.mean(dim=(2, 3)))

    torch.manual_seed(a.seed)
    return torch, ResNet(ints(a.widths), ints(a.blocks), a.classes)


def torch_half(a) -> None:
    torch, model = torch_model(a)
    path = lambda name: os.path.join(a.workdir, name)
    if a.time_only:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        with torch.no_grad():
            for n, p in model.state_dict().items():
                if os.path.exists(path(f"state.{n}.npy")):
                    p.copy_(torch.from_numpy(np.load(path(f"state.{n}.npy"))))
        images, labels = torch.from_numpy(np.load(path("images.npy"))), torch.from_numpy(np.load(path("labels.npy")))
        times = []
        for _ in range(a.steps + 1):
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(images), labels.long()).backward()
            times.append(time.perf_counter() - start)
        print(json.dumps({"seconds": min(times[1:])}))
        return
    model.train()
    gen = torch.Generator().manual_seed(a.seed + 1)
    images = torch.randn((a.batch, 3, a.size, a.size), generator=gen)
    labels = torch.randint(0, a.classes, (a.batch,), generator=gen)
    state = {n: p.detach().clone() for n, p in model.state_dict().items() if "num_batches" not in n}
    logits = model(images)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    for n, t in state.items():
        np.save(path(f"state.{n}.npy"), t.numpy())
    params = dict(model.named_parameters())
    for n, p in params.items():
        np.save(path(f"grad.{n}.npy"), p.grad.numpy())
    stats = [n for n in state if "running" in n]
    for n in stats:
        np.save(path(f"new.{n}.npy"), model.state_dict()[n].numpy())
    np.save(path("images.npy"), images.numpy())
    np.save(path("labels.npy"), labels.numpy().astype(np.int32))
    np.save(path("logits.npy"), logits.detach().numpy())
    with open(path("torch.json"), "w") as f:
        json.dump({"loss": loss.item(), "params": list(params), "stats": stats, "torch": torch.__version__}, f)


# ================================================================ our half
def ours_on_mesh(cfg, params, stats, images, labels, shape, preset):
    # spmd_runtime is imported here, not at the top: the PyTorch half runs this file under a venv without it
    import spmd_runtime as sr
    import spmd_runtime.nn as snn
    from spmd_runtime.comm import run_simulated
    from spmd_runtime.models import resnet
    from spmd_runtime.train import model_layout, train_mesh

    spatial = preset == "spatial"
    mesh = sr.Mesh(shape, ("data", "model")) if spatial else train_mesh(shape, preset)
    layout = model_layout(mesh, "dp" if spatial else preset, resnet.param_shapes(cfg), resnet.param_roles(cfg))
    image_spec = sr.P("data", None, "model", None) if spatial else sr.P(layout.preset.batch or None)
    annotate = (lambda x, role: sr.mesh_split(x, image_spec)) if spatial else resnet.no_annotation

    def fn(p, s, x, y):
        def loss(p):
            logits, new_stats = resnet.resnet(cfg, layout.used(p), s, x, True, annotate)
            return snn.cross_entropy(logits, y), (logits, new_stats)
        return sr.value_and_grad(loss, has_aux=True)(p)

    specs = ({n: sr.P(*v) for n, v in layout.param_specs().items()}, sr.P(), image_spec,
             sr.P(*layout.specs["batch.tokens"][:1]))

    def body(comm):
        (value, (logits, new_stats)), grads = sr.jit(fn, mesh=mesh, in_specs=specs, comm=comm)(params, stats,
                                                                                             images, labels)
        return (float(np.asarray(value)), np.asarray(logits), {n: np.asarray(v) for n, v in new_stats.items()},
                {n: np.asarray(g) for n, g in grads.items()})
    return run_simulated(mesh.size, body)[0]


def time_ours(cfg, params, stats, images, labels, steps: int) -> float:
    import spmd_runtime as sr
    from spmd_runtime.models import resnet
    mesh = sr.Mesh((1,), ("data",))
    f = sr.jit(sr.value_and_grad(lambda p, s, x, y: resnet.loss(cfg, p, s, x, y), has_aux=True), mesh=mesh)
    with mesh:
        put = lambda d: {n: sr.device_put(v, sr.P()) for n, v in d.items()}
        params, stats = put(params), put(stats)
        images, labels = sr.device_put(images, sr.P()), sr.device_put(labels, sr.P())
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            _, grads = f(params, stats, images, labels)
            for g in grads.values():
                g.local
            times.append(time.perf_counter() - start)
    return min(times[1:])


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.torch_only:
        torch_half(a)
        return 0
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="resnet_vs_torch.")
    cmd = [a.torch_python, os.path.abspath(__file__), "--torch-only", "--workdir", a.workdir, "--widths", a.widths,
           "--blocks", a.blocks, "--classes", str(a.classes), "--batch", str(a.batch), "--size", str(a.size),
           "--seed", str(a.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)
    subprocess.run(cmd, check=True, env=env)

    from spmd_runtime.models import resnet
    with open(os.path.join(a.workdir, "torch.json")) as f:
        info = json.load(f)
    state = load(a.workdir, "state", info["params"] + info["stats"])
    params, stats = {n: state[n] for n in info["params"]}, {n: state[n] for n in info["stats"]}
    torch_grads, torch_stats = load(a.workdir, "grad", info["params"]), load(a.workdir, "new", info["stats"])
    images, labels = (np.load(os.path.join(a.workdir, f"{n}.npy")) for n in ("images", "labels"))
    torch_logits = np.load(os.path.join(a.workdir, "logits.npy"))
    cfg = resnet.ResNetConfig(widths=ints(a.widths), blocks=ints(a.blocks), num_classes=a.classes)
    if set(resnet.param_shapes(cfg)) != set(params) or set(resnet.stats_shapes(cfg)) != set(stats):
        raise SystemExit(f"names differ: ours {sorted(resnet.param_shapes(cfg))}, PyTorch's {sorted(params)}")
    print(f"BasicBlock ResNet in PyTorch {info['torch']} (train mode, float32) vs spmd_runtime.models.resnet on the "
          f"same weights\n  {cfg}\n  images {images.shape}; torch loss {info['loss']:.7f}; max|logit| "
          f"{np.abs(torch_logits).max():.3f}; files in {a.workdir}")
    for shape, preset in mesh_list(a.meshes):
        value, logits, new_stats, grads = ours_on_mesh(cfg, params, stats, images, labels, shape, preset)
        worst = max(grads, key=lambda n: np.abs(grads[n] - torch_grads[n]).max())
        sdiff = max(np.abs(new_stats[n] - torch_stats[n]).max() for n in stats)
        print(f"  mesh {'x'.join(map(str, shape)):>4} {preset:<9} logits max|diff| "
              f"{np.abs(logits - torch_logits).max():.2e}   loss |diff| {abs(value - info['loss']):.2e}   "
              f"running stats max|diff| {sdiff:.2e}   grads max|diff| "
              f"{np.abs(grads[worst] - torch_grads[worst]).max():.2e} (of max|grad| "
              f"{np.abs(torch_grads[worst]).max():.2e}, {worst})")
    if a.rounds:
        print(f"  forward + backward at 1 rank, {env['OMP_NUM_THREADS']} thread(s), min of {a.steps} steps per round:")
        interleaved_rounds(cmd, env, lambda steps: time_ours(cfg, params, stats, images, labels, steps), a.rounds,
                           a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
