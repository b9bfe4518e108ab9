#!/usr/bin/env python3
"""A PyTorch-trained nanoGPT here and back: weights through .safetensors, logits compared at every hop.

    /tmp/torchvenv/bin/python scripts/torch_weights_roundtrip.py --nanogpt /work/scratch/weights_nanogpt/model.py

The torch side (this interpreter: torch + safetensors) imports nanoGPT's ``model.py`` from the path given
(karpathy/nanoGPT, fetched outside the project; nothing of it is copied here), builds its ``GPT`` from random
init (dropout 0, biases on), trains a few AdamW steps, saves the state dict with
``safetensors.torch.save_file`` (``lm_head.weight`` is tied to ``transformer.wte.weight``: only the source is
stored, as Hugging Face does) and writes logits of fixed tokens. Our side runs under ``--ours-python`` (the
project's venv) via ``mpiexec -n R`` for each R of ``--ranks``: it loads the file into
``spmd_runtime.models.gpt2`` (each rank reading only its blocks), computes the logits (hop 1), trains on
``--steps`` plain SGD steps (hop 2: PyTorch takes the same steps from the same weights), and saves its
weights as one .safetensors file, which the torch side loads back into a fresh ``GPT`` (hop 3: its logits
against ours). Every hop prints the max-abs logits difference; the exit status is 1 when one exceeds
``--tol``.

The model interface our side needs (``_our_model``, the one place that touches it; helper gpt2's module):
    gpt2.GPTConfig(block_size=, vocab_size=, n_layer=, n_head=, n_embd=, dropout=, bias=)   nanoGPT's fields
    gpt2.param_shapes(cfg) -> {name: shape}   names exactly nanoGPT's state-dict names, [out, in] weights; the
                                               head tied, so ``lm_head.weight`` absent (present: kept equal)
    gpt2.logits(cfg, params, idx) -> (batch, seq, vocab);  gpt2.loss(cfg, params, idx, targets) -> scalar
                                               both traceable (sr.jit / sr.value_and_grad)
Until that module exists our side round-trips the weights alone (``--weights-only`` forces it): hop 1 and 2
then compare the weights, and hop 3 still compares PyTorch's logits on the weights we wrote.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TIED = {"lm_head.weight": "transformer.wte.weight"}  # nanoGPT's tie: alias -> the name stored


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", help="path of nanoGPT's model.py (torch side)")
    p.add_argument("--workdir", default="/tmp/torch_weights_roundtrip")
    p.add_argument("--ours-python", default=str(ROOT / ".venv/bin/python") if (ROOT / ".venv").is_dir()
                   else "/work/main/.venv/bin/python")
    p.add_argument("--mpiexec", default=None, help="default: the mpiexec beside --ours-python")
    p.add_argument("--ranks", default="1,4")
    p.add_argument("--steps", type=int, default=3, help="training steps on each side")
    p.add_argument("--lr", type=float, default=0.05, help="our side's SGD learning rate (hop 2)")
    p.add_argument("--tol", type=float, default=1e-4, help="max-abs logits difference allowed (float32 rounding)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--embd", type=int, default=32)
    p.add_argument("--vocab", type=int, default=65, help="uneven over 4 ranks on purpose")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--weights-only", action="store_true", help="our side: no model, round-trip the weights")
    p.add_argument("--side", choices=["torch", "ours"], default="torch", help=argparse.SUPPRESS)
    p.add_argument("--hop-ranks", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ======================================================================= the torch side

def torch_side(args) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    nano = _import_nanogpt(args.nanogpt)
    torch.manual_seed(0)
    cfg = dict(block_size=args.block, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
               n_embd=args.embd, dropout=0.0, bias=True)
    model = nano.GPT(nano.GPTConfig(**cfg))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.block + 1), generator=gen) for _ in range(args.steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for b in batches:  # a few steps from random init, in PyTorch
        _, loss = model(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        opt.zero_grad()
        loss.backward()
        opt.step()
    tokens = torch.randint(0, args.vocab, (args.batch, args.block), generator=gen)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.endswith(".attn.bias")}
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr(), "nanoGPT ties the head"
    del state["lm_head.weight"]  # safetensors refuses shared tensors: the source alone is stored (as HF does)
    save_file(state, str(work / "torch.safetensors"), metadata={"spmd_runtime.tied": json.dumps(TIED)})
    np.save(work / "tokens.npy", tokens.numpy())
    np.save(work / "batches.npy", torch.stack(batches).numpy())
    np.save(work / "torch_logits.npy", _logits(model, tokens))
    (work / "config.json").write_text(json.dumps(cfg))
    print(f"torch: trained nanoGPT {cfg} {args.steps} AdamW steps; saved {len(state)} tensors "
          f"(lm_head.weight tied to transformer.wte.weight, stored once)")

    # hop 2's reference: the same plain SGD steps from the same weights, in PyTorch
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr)
    for b in batches:
        _, loss = model(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    np.save(work / "torch_trained_logits.npy", _logits(model, tokens))

    failed = False
    for ranks in [int(r) for r in args.ranks.split(",")]:
        rc = _run_ours(args, ranks)
        if rc != 0:
            print(f"ours at {ranks} rank(s): exited with status {rc}")
            failed = True
            continue
        report = json.loads((work / f"ours_{ranks}.json").read_text())
        failed |= _hop(f"hop 1 ({ranks} rank(s)): {report['hop1']['what']}", report["hop1"]["max_abs"], args.tol)
        if report["hop2"]["what"] == "logits":
            ours_trained = np.load(work / f"ours_trained_logits_{ranks}.npy")
            failed |= _hop(f"hop 2 ({ranks} rank(s)): logits after {args.steps} SGD steps here vs in PyTorch",
                           max_abs(ours_trained, np.load(work / "torch_trained_logits.npy")), args.tol)
        else:
            print(f"hop 2 ({ranks} rank(s)): skipped ({report['hop2']['why']})")
        back = nano.GPT(nano.GPTConfig(**cfg))
        missing, unexpected = back.load_state_dict(load_file(str(work / f"ours_{ranks}.safetensors")), strict=False)
        assert set(missing) <= {"lm_head.weight"} | {k for k in missing if k.endswith(".attn.bias")}, missing
        assert not unexpected, unexpected
        assert back.lm_head.weight is back.transformer.wte.weight  # the tie holds: loading wte set the head
        mine = np.load(work / f"ours_trained_logits_{ranks}.npy") if report["hop2"]["what"] == "logits" else \
            np.load(work / "torch_logits.npy")
        failed |= _hop(f"hop 3 ({ranks} rank(s)): PyTorch's logits on the weights we saved vs ours",
                       max_abs(_logits(back, tokens), mine), args.tol)
    print("FAILED" if failed else "OK: every hop within the tolerance")
    return 1 if failed else 0


def _import_nanogpt(path):
    if not path:
        raise SystemExit("the torch side needs --nanogpt PATH (nanoGPT's model.py, e.g. fetched into /work/scratch)")
    path = Path(path)
    path = path / "model.py" if path.is_dir() else path
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(model, tokens) -> np.ndarray:
    import torch
    model.eval()
    with torch.no_grad():
        logits, _ = model(tokens, tokens)  # with targets nanoGPT returns every position's logits
    model.train()
    return logits.numpy()


def _run_ours(args, ranks: int) -> int:
    mpiexec = args.mpiexec or str(Path(args.ours_python).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), args.ours_python, str(Path(__file__).resolve()), "--side", "ours",
           "--hop-ranks", str(ranks), "--workdir", args.workdir, "--steps", str(args.steps), "--lr", str(args.lr)]
    if args.weights_only:
        cmd.append("--weights-only")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(cmd, env=env).returncode


def _hop(what: str, diff: float, tol: float) -> bool:
    print(f"{what}: max-abs difference {diff:.3e} {'ok' if diff <= tol else f'> tol {tol:g}'}")
    return diff > tol


# ======================================================================= our side (under mpiexec)

def ours_side(args) -> int:
    import spmd_runtime as sr
    from spmd_runtime.weights import load_safetensors, save_safetensors
    from mpi4py import MPI

    work, ranks = Path(args.workdir), args.hop_ranks
    rank = MPI.COMM_WORLD.Get_rank()
    cfg = json.loads((work / "config.json").read_text())
    mesh = sr.Mesh((ranks,), ("x",))
    model = None if args.weights_only else _our_model(cfg)
    shapes = model["shapes"] if model else _file_shapes(work / "torch.safetensors")
    specs = {n: ("x",) + (None,) * (len(s) - 1) if s else () for n, s in shapes.items()}  # dim 0 split (uneven)
    params = load_safetensors(work / "torch.safetensors", mesh, specs, tied=TIED, darrays=True,
                              expect={n: (s, "float32") for n, s in shapes.items()})
    tokens, batches = np.load(work / "tokens.npy"), np.load(work / "batches.npy")
    report = {}
    if model is None:
        whole = {n: np.asarray(p) for n, p in params.items()}
        ref = _file_tensors(work / "torch.safetensors")
        report["hop1"] = {"what": "weights loaded vs saved", "max_abs": max(max_abs(whole[n], ref[n]) for n in ref)}
        report["hop2"] = {"what": None, "why": "no model (spmd_runtime.models.gpt2 missing or --weights-only)"}
    else:
        forward = sr.jit(model["logits"], mesh=mesh)
        report["hop1"] = {"what": "logits here vs PyTorch's on the same weights",
                          "max_abs": max_abs(np.asarray(forward(params, tokens)), np.load(work / "torch_logits.npy"))}
        step = sr.jit(lambda p, x, y: _sgd(p, x, y, model["loss"], args.lr), mesh=mesh)
        for b in batches:
            params, _ = step(params, b[:, :-1], b[:, 1:])
        trained_logits = np.asarray(forward(params, tokens))
        if rank == 0:
            np.save(work / f"ours_trained_logits_{ranks}.npy", trained_logits)
        report["hop2"] = {"what": "logits"}
    save_safetensors(work / f"ours_{ranks}.safetensors", params, tied=TIED)
    if rank == 0:
        (work / f"ours_{ranks}.json").write_text(json.dumps(report))
        print(f"ours ({ranks} rank(s)): loaded {len(params)} tensors, {'trained and ' if model else ''}saved")
    return 0


def _our_model(cfg: dict):
    """The one place that touches spmd_runtime.models.gpt2 (the interface in the module doc); None without it."""
    try:
        from spmd_runtime.models import gpt2
    except ImportError as e:
        if int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
            print(f"ours: spmd_runtime.models.gpt2 not importable ({e}): weights round trip only")
        return None
    c = gpt2.GPTConfig(**cfg)
    return {"shapes": {n: tuple(s) for n, s in gpt2.param_shapes(c).items()},
            "logits": lambda p, idx: gpt2.logits(c, p, idx), "loss": lambda p, x, y: gpt2.loss(c, p, x, y)}


def _sgd(params, x, y, loss, lr):
    """One plain SGD step (torch.optim.SGD's, no momentum): the update PyTorch repeats for hop 2."""
    import spmd_runtime as sr
    value, grads = sr.value_and_grad(lambda p: loss(p, x, y))(params)
    return {n: params[n] - lr * grads[n] for n in params}, value


def _file_shapes(path) -> dict:
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _file_tensors(path) -> dict:
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


if __name__ == "__main__":
    a = parse_args()
    sys.exit(torch_side(a) if a.side == "torch" else ours_side(a))
