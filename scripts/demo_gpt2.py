"""GPT-2 from the model zoo (``models.gpt2``, nanoGPT's model on the public API), trained as any model is: stated
as a ``Model`` (its loss, parameter shapes and sharding roles), partitioned by a preset, trained by ``fit``.

The bundled corpus becomes nanoGPT token files (``prepare_corpus``: train.bin, val.bin, meta.json, character
tokens); ``fit`` trains a small GPT-2 (dropout on) with AdamW on a cosine schedule with warmup and gradient
clipping, evaluates on val.bin every ``--eval-every`` steps and checkpoints (parameters, optimizer state, step
and the loader's position in one atomic save; run it again to resume from there). Then the trained weights,
laid out as the preset uses them, continue a prompt by greedy decoding with a KV cache (``gpt2.generate``).

Run: mpiexec -n 2 python scripts/demo_gpt2.py   (scripts/demo.sh runs it after the LM demos)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one BLAS thread per rank
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import spmd_runtime as sr  # noqa: E402
from spmd_runtime.data import decode, encode  # noqa: E402
from spmd_runtime.models import gpt2  # noqa: E402
from spmd_runtime.optim import AdamW, CosineSchedule  # noqa: E402
from spmd_runtime.tokens import prepare_corpus  # noqa: E402
from spmd_runtime.train import (Model, build_train_step_on_root, fit, format_comm, token_loaders,  # noqa: E402
                                train_mesh)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="1,2", help="mesh shape (product = number of ranks)")
    ap.add_argument("--preset", default="megatron", help="dp, fsdp, megatron, wus, fsdp_megatron, ...")
    ap.add_argument("--steps", type=int, default=60)
    for name, default in (("layers", 2), ("heads", 4), ("d", 64), ("seq", 64), ("batch", 8), ("eval-every", 20),
                          ("checkpoint-every", 30), ("eval-steps", 2), ("new-tokens", 48)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--out", default="out/gpt2")
    return ap.parse_args()


def main():
    args = parse_args()
    comm = MPI.COMM_WORLD
    rank, say = comm.Get_rank(), (print if comm.Get_rank() == 0 else (lambda *a, **k: None))
    data_dir, ckpt = os.path.join(args.out, "data"), os.path.abspath(os.path.join(args.out, "checkpoint"))
    meta = prepare_corpus(data_dir, sentences=2000) if rank == 0 else None
    meta = comm.bcast(meta)
    say(f"token files in {data_dir}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens, vocab "
        f"{meta['vocab_size']}")
    cfg = gpt2.GPTConfig(block_size=args.seq, vocab_size=meta["vocab_size"], n_layer=args.layers,
                         n_head=args.heads, n_embd=args.d, dropout=args.dropout)
    model = Model(lambda p, batch, key: gpt2.loss(cfg, p, batch["tokens"], batch["labels"], key, train=True),
                  params=gpt2.param_shapes(cfg), roles=gpt2.param_roles(cfg), batch=args.batch, seq=args.seq,
                  vocab=cfg.vocab_size, init=lambda seed: gpt2.init_params(cfg, seed), dropout_seed=0, name="gpt2")
    optimizer = AdamW(lr=CosineSchedule(args.lr, warmup=args.steps // 10, total=args.steps, end=args.lr / 10),
                      clip_norm=args.clip)
    mesh = train_mesh(tuple(int(s) for s in args.mesh.split(",")), args.preset)
    t0 = time.perf_counter()
    ts = build_train_step_on_root(model, mesh, args.preset, optimizer, comm)
    mem = ts.memory_report()
    say(f"{model}: {cfg}\n{optimizer}\npreset {args.preset!r} on {mesh}: traced + partitioned in "
        f"{time.perf_counter() - t0:.1f}s; per rank: params {mem['params'] / 1024:.0f} KiB of "
        f"{mem['params_global'] / 1024:.0f} KiB, optimizer state {mem['opt_state'] / 1024:.0f} KiB, peak "
        f"{mem['peak'] / 2 ** 20:.1f} MiB\ncollectives per step:\n{format_comm(ts.comm_summary())}")
    train, val = token_loaders(ts, data_dir, rank)
    t0 = time.perf_counter()
    result = fit(ts, train, args.steps, eval_loader=val, eval_every=args.eval_every, eval_steps=args.eval_steps,
                 checkpoint_every=args.checkpoint_every, directory=ckpt, log_every=args.eval_every, comm=comm)
    seconds = time.perf_counter() - t0
    ran = result.step - result.resumed_from
    say(f"fit: steps {result.resumed_from + 1}..{result.step} in {seconds:.1f}s"
        + (f" ({ran * args.batch * args.seq / seconds:.0f} tokens/s)" if ran else "")
        + f"; checkpoint at step {sr.checkpoint_info(ckpt)['step']} in {ckpt}")
    ok = not result.evals or result.evals[-1][1] < np.log(cfg.vocab_size)  # better than a uniform guess
    if result.evals:
        say(f"eval loss {result.evals[0][1]:.4f} (step {result.evals[0][0]}) -> {result.evals[-1][1]:.4f} (step "
            f"{result.evals[-1][0]}); uniform guess {np.log(cfg.vocab_size):.4f} -> {'OK' if ok else 'FAIL'}")
    generate(ts, cfg, result.state, args, comm, say)
    if not ok:
        raise SystemExit(1)


def generate(ts, cfg, local, args, comm, say):
    """Greedy tokens from the trained weights, each laid out as the step uses it (megatron: tensor-parallel
    decode, the KV cache split over heads)."""
    params = ts.gather(local, comm)["params"]
    placed = {n: sr.device_put(w, sr.P(*ts.layout.use[n]), ts.mesh) for n, w in params.items()}
    prompt = encode("The ")[None, :].astype(np.int32)
    t0 = time.perf_counter()
    tokens = gpt2.generate(cfg, placed, prompt, args.new_tokens, temperature=0.0)
    seconds = time.perf_counter() - t0
    say(f"\ngreedy decode with a KV cache ({args.new_tokens} tokens, {args.new_tokens / seconds:.0f} tokens/s): "
        f"[{decode(tokens[0, :prompt.shape[1]])}]{decode(tokens[0, prompt.shape[1]:])!r}")


if __name__ == "__main__":
    main()
