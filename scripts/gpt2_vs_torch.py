"""GPT-2 generation here (``spmd_runtime.models.gpt2``, KV-cache decode) against nanoGPT's own ``model.py`` in
PyTorch (its ``GPT.generate``, no cache), on the same weights: the greedy tokens must be equal; decode tokens/s
side by side, rounds interleaved (ours, torch, ours, torch, ...), every round printed and the min of each.

    python scripts/gpt2_vs_torch.py --nanogpt /work/scratch/nanogpt [--torch-python /tmp/torchvenv/bin/python]

``--nanogpt``: a directory holding nanoGPT's ``model.py`` (a checkout; never copied here). Our side runs in this
interpreter (the project's venv), the torch side in ``--torch-python`` (a venv with torch and numpy) as a
subprocess of this same file with ``--torch-side``; the weights travel as one .npy file per nanoGPT parameter
name. nanoGPT samples with ``torch.multinomial``; with ``top_k=1`` that is the argmax, so both sides are greedy.
The default config is nanoGPT's shakespeare-char model (6 layers, 6 heads, d 384, block 256, vocab 65).
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

CONFIG_KEYS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", required=True, help="directory with nanoGPT's model.py")
    p.add_argument("--torch-python", default="/tmp/torchvenv/bin/python")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=65)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=8, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (ours: one rank, BLAS threads "
                                                          "as OMP_NUM_THREADS / OPENBLAS_NUM_THREADS say)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-side", metavar="DIR", help=argparse.SUPPRESS)  # internal: run nanoGPT on DIR's files
    return p.parse_args(argv)


def config_of(args) -> dict:
    return {k: getattr(args, k) for k in CONFIG_KEYS}


# ---------------------------------------------------------------- the torch side (its own interpreter)
def torch_side(args) -> None:
    """Load DIR's weights into nanoGPT's GPT, generate greedily once to warm up, then time one generate; write
    DIR/torch_tokens.npy and DIR/torch_time.json."""
    # torch and nanoGPT exist only in the torch interpreter, where spmd_runtime does not: imported here
    import torch
    sys.path.insert(0, args.nanogpt)
    import model as nanogpt

    torch.set_num_threads(args.threads)
    folder = args.torch_side
    with open(os.path.join(folder, "names.json")) as f:
        names = json.load(f)
    cfg = nanogpt.GPTConfig(**config_of(args), dropout=0.0, bias=True)
    net = nanogpt.GPT(cfg)
    state = {n: torch.from_numpy(np.load(os.path.join(folder, f"{k}.npy"))) for k, n in enumerate(names)}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: nanoGPT's state_dict names it twice
    net.load_state_dict(state, strict=True)
    net.eval()
    prompt = torch.from_numpy(np.load(os.path.join(folder, "prompt.npy")).astype(np.int64))
    with torch.no_grad():
        net.generate(prompt, 2, temperature=1.0, top_k=1)
        start, cpu = time.perf_counter(), time.process_time()
        out = net.generate(prompt, args.new_tokens, temperature=1.0, top_k=1)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    np.save(os.path.join(folder, "torch_tokens.npy"), out.numpy())
    with open(os.path.join(folder, "torch_time.json"), "w") as f:
        json.dump({"seconds": seconds, "cpu": cpu}, f)


# ---------------------------------------------------------------- our side
def our_side(args, params, prompt):
    """(tokens, wall seconds, CPU seconds of the timed generate) on one rank; a first call compiles."""
    import spmd_runtime as sr  # noqa: F401  (the project: only in our interpreter)
    from spmd_runtime.models import gpt2

    cfg = gpt2.GPTConfig(**config_of(args), dropout=0.0, bias=True)
    with sr.Mesh((1,), ("data",)):
        gpt2.generate(cfg, params, prompt, args.new_tokens, temperature=0.0)  # compile prefill and decode
        start, cpu = time.perf_counter(), time.process_time()
        tokens = gpt2.generate(cfg, params, prompt, args.new_tokens, temperature=0.0)
        return tokens, time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.torch_side:
        torch_side(args)
        return 0
    from spmd_runtime.models import gpt2  # the project's interpreter from here on

    cfg = gpt2.GPTConfig(**config_of(args), dropout=0.0, bias=True)
    params = gpt2.init_params(cfg, args.seed)
    prompt = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (args.batch, args.prompt))
    new = args.batch * args.new_tokens
    print(f"config {config_of(args)}, batch {args.batch}, prompt {args.prompt}, new tokens {args.new_tokens}, "
          f"torch threads {args.threads}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    ours_s, torch_s, ours_cpu, torch_cpu, mismatches = [], [], [], [], 0
    with tempfile.TemporaryDirectory() as folder:
        names = list(params)
        with open(os.path.join(folder, "names.json"), "w") as f:
            json.dump(names, f)
        for k, n in enumerate(names):
            np.save(os.path.join(folder, f"{k}.npy"), params[n])
        np.save(os.path.join(folder, "prompt.npy"), prompt)
        for r in range(args.rounds):
            tokens, seconds, cpu = our_side(args, params, prompt)
            ours_s.append(seconds)
            ours_cpu.append(cpu)
            subprocess.run([args.torch_python, os.path.abspath(__file__), "--torch-side", folder] + _passed(args),
                           check=True, stdout=subprocess.DEVNULL)
            theirs = np.load(os.path.join(folder, "torch_tokens.npy"))
            with open(os.path.join(folder, "torch_time.json")) as f:
                timing = json.load(f)
            torch_s.append(timing["seconds"])
            torch_cpu.append(timing["cpu"])
            same = np.array_equal(tokens, theirs)
            mismatches += not same
            print(f"round {r + 1}: ours {new / ours_s[-1]:8.1f} tok/s ({ours_s[-1]:.3f} s wall, {ours_cpu[-1]:.3f} s "
                  f"CPU)   nanoGPT torch {new / torch_s[-1]:8.1f} tok/s ({torch_s[-1]:.3f} s wall, "
                  f"{torch_cpu[-1]:.3f} s CPU)   greedy tokens equal: {same}")
    for what, ours, theirs in (("wall", ours_s, torch_s), ("CPU", ours_cpu, torch_cpu)):
        print(f"min {what}: ours {new / min(ours):.1f} tok/s, nanoGPT torch {new / min(theirs):.1f} tok/s, "
              f"ours / torch time {min(ours) / min(theirs):.2f}x")
    print(f"first tokens: {tokens[0, :24].tolist()}")
    return 1 if mismatches else 0


def _passed(args) -> list:
    out = ["--nanogpt", args.nanogpt, "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    for k in CONFIG_KEYS:
        out += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return out


if __name__ == "__main__":
    sys.exit(main())
