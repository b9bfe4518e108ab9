"""Loss curves: GPT-2-small-shaped training (12 layers, 12 heads, a reduced width) here and in PyTorch (nanoGPT's own
``model.py``, its ``configure_optimizers`` AdamW with the same hyper-parameters) from the same weights and the same
batches, dropout off: the max |loss difference| over the steps (float32 rounding, amplified a little by training,
is what is expected); and with dropout on, our 1-rank curve against our 4-rank curves (dp and megatron: the masks
are the same on any mesh, so the curves must be equal to rounding).

    python scripts/gpt2_loss_curves.py --nanogpt /work/scratch/nanogpt            # 200 steps, d 96
    python scripts/gpt2_loss_curves.py --steps 20 --layers 2 --d 48 --skip-torch   # a quick check, no torch

The data is a token stream of a fixed random Markov chain (each token has a few likely successors, so the loss
falls well below log(vocab)); step s trains on rows drawn at seeded offsets, written once as .npy files that both
sides read, as are the weights (our ``init_params``, one .npy per nanoGPT name; the torch side loads them with
``load_state_dict``). Our runs go through ``mpiexec -n R`` (``bench_gpt2.build_step``: jit of forward, backward
and AdamW, params and state donated), one BLAS thread per rank; torch runs with ``--torch-threads`` (1). Exit status
1 when a difference exceeds its tolerance (``--torch-tol``, ``--ranks-tol``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import bench_gpt2  # this directory (scripts/): the shared training step, AdamW hyper-parameters and launchers

THREAD_VARS = bench_gpt2.THREAD_VARS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_gpt2.add_side_by_side_args(p, 1, "(only numbers are compared: 1 is fastest on a loaded machine)",
                                     layers=12, d=96, heads=12, vocab=512, batch=4, seq=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dropout", type=float, default=0.1, help="for the 1-rank vs 4-rank curves")
    p.add_argument("--many", default="4:dp,4:megatron", help="the runs with dropout compared to 1 rank's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--torch-tol", type=float, default=1e-3, help="max |loss difference| here vs torch")
    p.add_argument("--ranks-tol", type=float, default=1e-4, help="max |loss difference| 1 rank vs many")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # internal: our side under mpiexec
    p.add_argument("--preset", default="dp", help=argparse.SUPPRESS)
    p.add_argument("--torch-side", metavar="DIR", help=argparse.SUPPRESS)  # internal: nanoGPT in torch
    return p.parse_args(argv)


def gpt_config(args, dropout: float) -> dict:
    return dict(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_embd=args.d,
                dropout=dropout, bias=True)


def make_batches(args) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 (steps, batch, seq): windows of a token stream from a random Markov chain whose
    every token has 4 likely successors."""
    rng = np.random.default_rng(args.seed + 1)
    successors = rng.integers(0, args.vocab, (args.vocab, 4))
    stream = np.empty(64 * args.batch * args.seq, np.int64)
    stream[0] = 0
    picks = rng.integers(0, 4, stream.size)
    noise = rng.random(stream.size) < 0.1
    anything = rng.integers(0, args.vocab, stream.size)
    for i in range(1, stream.size):  # data preparation, once: a plain loop is clear and fast enough here
        stream[i] = anything[i] if noise[i] else successors[stream[i - 1], picks[i]]
    starts = rng.integers(0, stream.size - args.seq - 1, (args.steps, args.batch))
    rows = starts[..., None] + np.arange(args.seq + 1)
    return stream[rows][..., :-1].astype("int32"), stream[rows][..., 1:].astype("int32")


# ================================================================ our side (one rank of mpiexec)
def our_worker(args) -> None:
    import warnings

    from mpi4py import MPI  # only under mpiexec (the driver and torch side have no MPI)

    import spmd_runtime.random as srandom
    from spmd_runtime.models import gpt2
    warnings.filterwarnings("ignore", message="donated input")  # the first step copies the placed views once
    comm = MPI.COMM_WORLD
    folder = args.worker
    cfg = gpt2.GPTConfig(**gpt_config(args, args.dropout))
    optimizer = bench_gpt2.adamw()
    step, place, batch, *_ = bench_gpt2.build_step(cfg, args.preset, comm.Get_size(), optimizer)
    weights = gpt2.init_params(cfg, args.seed)
    params, state = place(weights, optimizer.init_state(weights))
    inputs, targets = np.load(os.path.join(folder, "inputs.npy")), np.load(os.path.join(folder, "targets.npy"))
    key = srandom.key(args.seed)
    losses = []
    for s in range(args.steps):
        params, state, loss = step(params, state, *batch(inputs[s], targets[s]), srandom.fold_in(key, s))
        losses.append(float(np.asarray(loss)))
    if comm.Get_rank() == 0:
        np.save(os.path.join(folder, f"ours-{comm.Get_size()}-{args.preset}-{args.dropout}.npy"), np.array(losses))


def run_ours(args, ranks: int, preset: str, dropout: float, folder: str) -> np.ndarray:
    env = {**os.environ, **{v: "1" for v in THREAD_VARS}}
    cmd = [args.mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker", folder,
           "--preset", preset, "--dropout", str(dropout)] + _passed(args)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return np.load(os.path.join(folder, f"ours-{ranks}-{preset}-{dropout}.npy"))


# ================================================================ the torch side (its own interpreter)
def torch_side(args) -> None:
    import torch  # torch and nanoGPT exist only in the torch interpreter, where spmd_runtime does not
    sys.path.insert(0, args.nanogpt)
    import model as nanogpt

    torch.set_num_threads(args.torch_threads)
    folder = args.torch_side
    with open(os.path.join(folder, "names.json")) as f:
        names = json.load(f)
    net = nanogpt.GPT(nanogpt.GPTConfig(**gpt_config(args, 0.0)))
    state = {n: torch.from_numpy(np.load(os.path.join(folder, f"w{k}.npy"))) for k, n in enumerate(names)}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: nanoGPT's state_dict names it twice
    net.load_state_dict(state, strict=True)
    net.train()
    hyper = bench_gpt2.HYPER
    optimizer = net.configure_optimizers(hyper["weight_decay"], hyper["lr"], hyper["betas"], "cpu")
    inputs, targets = (torch.from_numpy(np.load(os.path.join(folder, f"{k}.npy")).astype(np.int64))
                       for k in ("inputs", "targets"))
    losses = []
    for s in range(args.steps):
        _, loss = net(inputs[s], targets[s])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    np.save(os.path.join(folder, "torch.npy"), np.array(losses))


def _passed(args) -> list:
    out = []
    for k in ("nanogpt", "torch_threads", "layers", "d", "heads", "vocab", "batch", "seq", "steps", "seed"):
        out += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return out


# ================================================================ the driver
def _curve(losses) -> str:
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    return ", ".join(f"{s + 1}: {losses[s]:.4f}" for s in marks)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        our_worker(args)
        return 0
    if args.torch_side:
        torch_side(args)
        return 0
    from spmd_runtime.models import gpt2  # the project's interpreter from here on

    print(f"GPT-2-small-shaped {gpt_config(args, args.dropout)}, batch x seq {args.batch} x {args.seq}, "
          f"{args.steps} steps, AdamW {bench_gpt2.HYPER} (constant lr), log(vocab) {np.log(args.vocab):.3f}")
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        inputs, targets = make_batches(args)
        np.save(os.path.join(folder, "inputs.npy"), inputs)
        np.save(os.path.join(folder, "targets.npy"), targets)
        if not args.skip_torch:
            weights = gpt2.init_params(gpt2.GPTConfig(**gpt_config(args, 0.0)), args.seed)
            with open(os.path.join(folder, "names.json"), "w") as f:
                json.dump(list(weights), f)
            for k, w in enumerate(weights.values()):
                np.save(os.path.join(folder, f"w{k}.npy"), w)
            ours = run_ours(args, 1, "dp", 0.0, folder)
            subprocess.run([args.torch_python, os.path.abspath(__file__), "--torch-side", folder] + _passed(args),
                           check=True, stdout=subprocess.DEVNULL)
            theirs = np.load(os.path.join(folder, "torch.npy"))
            diff = np.abs(ours - theirs)
            failed |= bool(diff.max() > args.torch_tol)
            print(f"dropout off, ours 1 rank: {_curve(ours)}\ndropout off, torch:       {_curve(theirs)}")
            print(f"max |loss difference| ours vs torch over {args.steps} steps: {diff.max():.3g} (at step "
                  f"{diff.argmax() + 1}; first 10 steps {diff[:10].max():.3g}, relative {np.max(diff / theirs):.3g})")
        one = run_ours(args, 1, "dp", args.dropout, folder)
        print(f"dropout {args.dropout}, ours 1 rank: {_curve(one)}")
        for ranks, preset in (x.split(":") for x in args.many.split(",")):
            many = run_ours(args, int(ranks), preset, args.dropout, folder)
            diff = np.abs(many - one)
            failed |= bool(diff.max() > args.ranks_tol)
            print(f"dropout {args.dropout}, ours {ranks} ranks {preset}: {_curve(many)}\n  max |loss difference| vs 1 "
                  f"rank over {args.steps} steps: {diff.max():.3g} (at step {diff.argmax() + 1})")
    print("FAILED: a difference exceeds its tolerance" if failed else "ok: every difference within its tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
