#!/usr/bin/env python
"""llama2.c's PyTorch Llama (its ``model.py``) against ``spmd_runtime.models.llama`` on the same weights: the
max-abs difference of the logits, the loss and every gradient, at 1 rank and on simulated meshes under presets.

    /work/main/.venv/bin/python scripts/llama_vs_torch.py --llama2c /work/scratch/llama2.c \\
        [--torch-python /tmp/torchvenv/bin/python] [--meshes 1:dp,2x2:megatron,4:megatron,2x2:fsdp]

The PyTorch half runs under ``--torch-python`` (a venv with torch; llama2.c's model.py imported from the
``--llama2c`` checkout, e.g. ``git --git-dir=<fetched llama2.c> show HEAD:model.py > DIR/model.py``): it builds
the model with llama2.c's init (the output layer untied unless ``--tied``: a matrix of its own, drawn the same
way), saves its state dict, tokens, logits, loss and gradients as .npy files in ``--workdir``. This half (the
project's venv) loads them, runs our model on every mesh and prints the differences (float32 rounding expected:
~1e-6 of the logits' scale). ``--torch-only`` runs only the PyTorch half (it is what the subprocess runs).
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

from side_by_side import interleaved_rounds  # this directory (scripts/): the interleaved timing rounds

CONFIG_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama2c", required=True, help="a directory holding llama2.c's model.py")
    ap.add_argument("--torch-python", default="/tmp/torchvenv/bin/python", help="an interpreter with torch")
    ap.add_argument("--workdir", default=None, help="where the weights and PyTorch's results go (default: a temp dir)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--multiple-of", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tied", action="store_true", help="keep llama2.c's tied output layer")
    ap.add_argument("--meshes", default="1:dp,2x2:megatron,4:megatron,2x2:fsdp",
                    help="comma-separated SHAPE:PRESET (shape like 4 or 2x2) to run ours on")
    ap.add_argument("--rounds", type=int, default=0,
                    help="then time forward + backward: this many interleaved rounds (torch, ours, torch, ...)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (after one warm-up step)")
    ap.add_argument("--generate", type=int, default=16,
                    help="greedy tokens to generate from the first half of each sequence (0: none): llama2.c's "
                         "generate (no cache) against ours (KV cache), tokens and tokens/s")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def config(a) -> dict:
    return {k: getattr(a, k) for k in CONFIG_KEYS}


# ================================================================ the PyTorch half (run under --torch-python)
def torch_half(a) -> None:
    import torch
    sys.path.insert(0, os.path.abspath(a.llama2c))
    from model import ModelArgs, Transformer  # llama2.c's model.py

    if a.time_only:
        return torch_timing(a, torch, ModelArgs, Transformer)
    torch.manual_seed(a.seed)
    model = Transformer(ModelArgs(**config(a), dropout=0.0))
    if not a.tied:  # a matrix of its own, drawn as llama2.c draws every Linear
        model.output.weight = torch.nn.Parameter(torch.empty_like(model.output.weight).normal_(0.0, 0.02))
    model.eval()
    gen = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(0, a.vocab_size, (a.batch, a.max_seq_len), generator=gen)
    targets = torch.randint(0, a.vocab_size, (a.batch, a.max_seq_len), generator=gen)
    logits = model(tokens, targets)
    model.last_loss.backward()
    params = dict(model.named_parameters())  # a tied output layer appears once, as tok_embeddings.weight
    for name, p in params.items():
        np.save(os.path.join(a.workdir, f"weight.{name}.npy"), p.detach().numpy())
        np.save(os.path.join(a.workdir, f"grad.{name}.npy"), p.grad.numpy())
    np.save(os.path.join(a.workdir, "tokens.npy"), tokens.numpy().astype(np.int32))
    np.save(os.path.join(a.workdir, "targets.npy"), targets.numpy().astype(np.int32))
    np.save(os.path.join(a.workdir, "logits.npy"), logits.detach().numpy())
    loss, seconds = model.last_loss.item(), 0.0  # generate's forwards reset last_loss
    if a.generate:
        start = time.perf_counter()
        with torch.no_grad():
            generated = model.generate(tokens[:, :prompt_length(a)], a.generate, temperature=0.0)
        seconds = time.perf_counter() - start
        np.save(os.path.join(a.workdir, "generated.npy"), generated.numpy().astype(np.int32))
    with open(os.path.join(a.workdir, "torch.json"), "w") as f:
        json.dump({"generate_seconds": seconds, "loss": loss, "names": list(params), "torch": torch.__version__,
                   "flash": bool(model.layers[0].attention.flash)}, f)


def torch_timing(a, torch, ModelArgs, Transformer) -> None:
    """Seconds per forward + backward (min over ``steps``), printed as JSON: the weights saved by the first run."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = Transformer(ModelArgs(**config(a), dropout=0.0))
    with open(os.path.join(a.workdir, "torch.json")) as f:
        names = json.load(f)["names"]
    if not a.tied:
        model.output.weight = torch.nn.Parameter(torch.empty_like(model.output.weight))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.load(os.path.join(a.workdir, f"weight.{n}.npy"))))
    assert sorted(n for n, _ in model.named_parameters()) == sorted(names)
    tokens = torch.from_numpy(np.load(os.path.join(a.workdir, "tokens.npy")).astype(np.int64))
    targets = torch.from_numpy(np.load(os.path.join(a.workdir, "targets.npy")).astype(np.int64))
    times = []
    for _ in range(a.steps + 1):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(tokens, targets)
        model.last_loss.backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": min(times[1:])}))


def prompt_length(a) -> int:
    """The prompt generation starts from: the first half of each sequence, leaving room for the new tokens."""
    return max(1, min(a.max_seq_len // 2, a.max_seq_len - a.generate))


# ================================================================ our half
def load(workdir: str, kind: str, names) -> dict:
    return {n: np.load(os.path.join(workdir, f"{kind}.{n}.npy")) for n in names}


def ours_on_mesh(args, params, tokens, targets, shape, preset):
    """(logits, loss, grads) of our model on a simulated mesh under ``preset``: rank 0's, each rank having
    partitioned and run the same program on its blocks."""
    # spmd_runtime is imported here, not at the top: the PyTorch half runs this file under a venv without it
    import spmd_runtime as sr
    from spmd_runtime.comm import run_simulated
    from spmd_runtime.models import llama
    from spmd_runtime.train import model_layout, train_mesh

    mesh = train_mesh(shape, preset)
    layout = model_layout(mesh, preset, llama.param_shapes(args), llama.param_roles(args))
    specs, batch = {n: sr.P(*s) for n, s in layout.param_specs().items()}, sr.P(*layout.specs["batch.tokens"])

    def forward_and_grads(p, x, y):
        def loss(p):
            logits, value = llama.transformer(args, layout.used(p), x, y, annotate=layout.activation)
            return value, logits
        (value, logits), grads = sr.value_and_grad(loss, has_aux=True)(p)
        return logits, value, grads

    def body(comm):
        f = sr.jit(forward_and_grads, mesh=mesh, in_specs=(specs, batch, batch), comm=comm)
        logits, value, grads = f(params, tokens, targets)
        return np.asarray(logits), float(np.asarray(value)), {n: np.asarray(g) for n, g in grads.items()}
    return run_simulated(mesh.size, body)[0]


def time_ours(args, params, tokens, targets, steps: int) -> float:
    """Seconds per forward + backward at 1 rank (min over ``steps``, after a warm-up that compiles)."""
    import spmd_runtime as sr
    from spmd_runtime.models import llama
    mesh = sr.Mesh((1,), ("data",))
    f = sr.jit(sr.value_and_grad(lambda p, x, y: llama.loss(args, p, x, y)), mesh=mesh)
    with mesh:
        params = {n: sr.device_put(w, sr.P()) for n, w in params.items()}
        tokens, targets = sr.device_put(tokens, sr.P()), sr.device_put(targets, sr.P())
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            value, grads = f(params, tokens, targets)
            for g in grads.values():
                g.local  # the step ran: every local block is there
            times.append(time.perf_counter() - start)
    return min(times[1:])


def mesh_list(text: str):
    out = []
    for item in text.split(","):
        shape, _, preset = item.partition(":")
        out.append((tuple(int(s) for s in shape.split("x")), preset or "dp"))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.torch_only:
        torch_half(a)
        return 0
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="llama_vs_torch.")
    os.makedirs(a.workdir, exist_ok=True)
    cmd = [a.torch_python, os.path.abspath(__file__), "--torch-only", "--workdir", a.workdir,
           "--llama2c", a.llama2c, "--batch", str(a.batch), "--seed", str(a.seed)] + \
        [f"--{k.replace('_', '-')}={v}" for k, v in config(a).items()] + (["--tied"] if a.tied else []) + \
        [f"--generate={a.generate}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)  # the torch venv needs nothing of ours
    subprocess.run(cmd, check=True, env=env)

    from spmd_runtime.models import llama
    with open(os.path.join(a.workdir, "torch.json")) as f:
        info = json.load(f)
    params = load(a.workdir, "weight", info["names"])
    torch_grads = load(a.workdir, "grad", info["names"])
    tokens, targets = (np.load(os.path.join(a.workdir, f"{n}.npy")) for n in ("tokens", "targets"))
    torch_logits = np.load(os.path.join(a.workdir, "logits.npy"))
    args = llama.ModelArgs(**config(a), tie_embeddings=a.tied)
    missing = set(llama.param_shapes(args)) ^ set(params)
    if missing:
        raise SystemExit(f"llama2.c's state dict and ours differ in names: {sorted(missing)}")
    print(f"llama2.c model.py (PyTorch {info['torch']}, float32, flash attention {info['flash']}) vs "
          f"spmd_runtime.models.llama on the same weights")
    print(f"  {args}\n  batch {a.batch} x seq {a.max_seq_len}; torch loss {info['loss']:.7f}; "
          f"max|logit| {np.abs(torch_logits).max():.3f}; weights in {a.workdir}")
    for shape, preset in mesh_list(a.meshes):
        logits, value, grads = ours_on_mesh(args, params, tokens, targets, shape, preset)
        worst = max(grads, key=lambda n: np.abs(grads[n] - torch_grads[n]).max())
        gdiff = np.abs(grads[worst] - torch_grads[worst]).max()
        print(f"  mesh {'x'.join(map(str, shape)):>4} {preset:<9} logits max|diff| "
              f"{np.abs(logits - torch_logits).max():.2e}"
              f"   loss |diff| {abs(value - info['loss']):.2e}   grads max|diff| {gdiff:.2e} "
              f"(of max|grad| {np.abs(torch_grads[worst]).max():.2e}, {worst})")
    if a.generate:
        import spmd_runtime as sr
        want = np.load(os.path.join(a.workdir, "generated.npy"))
        with sr.Mesh((1,), ("data",)):
            llama.generate(args, params, tokens[:, :prompt_length(a)], a.generate, temperature=0.0)  # compiles
            start = time.perf_counter()
            got = llama.generate(args, params, tokens[:, :prompt_length(a)], a.generate, temperature=0.0)
            seconds = time.perf_counter() - start
        new = a.batch * a.generate
        print(f"  greedy generation of {a.generate} tokens x batch {a.batch} from {prompt_length(a)}-token prompts: "
              f"{'the same tokens' if np.array_equal(got, want) else 'DIFFERENT tokens'} "
              f"({int((got != want).sum())} differ); llama2.c generate (no cache) {new / info['generate_seconds']:.0f} "
              f"tokens/s, ours (KV cache, 1 rank, compiled) {new / seconds:.0f} tokens/s")
    if a.rounds:
        print(f"  forward + backward at 1 rank, {os.environ.get('OMP_NUM_THREADS', '1')} thread(s), min of "
              f"{a.steps} steps per round, interleaved rounds:")
        interleaved_rounds(cmd, env, lambda steps: time_ours(args, params, tokens, targets, steps), a.rounds,
                           a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
