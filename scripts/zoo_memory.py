"""Which GPT-2 sizes fit on one box: each size planned from abstract shapes (``plan_train_step`` of a ``Model``
of TensorSpecs: traced and partitioned, nothing allocated, nothing run) under dp / fsdp / megatron at 1, 2 and 4
ranks, with AdamW; per rank the parameters, the optimizer state and the program's peak of live buffers
(parameters, state, activations and temporaries), and the box's total (ranks x peak) against ``--box-gib``.

Run: python scripts/zoo_memory.py [--sizes 124M,350M] [--batch 4 --seq 256]   (prints a Markdown table)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spmd_runtime.graph import TensorSpec  # noqa: E402
from spmd_runtime.models import gpt2  # noqa: E402
from spmd_runtime.optim import AdamW  # noqa: E402
from spmd_runtime.train import Model, plan_train_step, train_mesh  # noqa: E402

SIZES = {"124M": dict(n_layer=12, n_head=12, n_embd=768), "350M": dict(n_layer=24, n_head=16, n_embd=1024),
         "774M": dict(n_layer=36, n_head=20, n_embd=1280), "1.5B": dict(n_layer=48, n_head=25, n_embd=1600)}
GIB = 2.0 ** 30


def abstract_model(cfg: gpt2.GPTConfig, batch: int, seq: int) -> Model:
    specs = {n: TensorSpec(s, "float32") for n, s in gpt2.param_shapes(cfg).items()}
    return Model(lambda p, b: gpt2.loss(cfg, p, b["tokens"], b["labels"]), specs, gpt2.param_roles(cfg), batch, seq,
                 cfg.vocab_size, name="gpt2")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--presets", default="dp,fsdp,megatron")
    ap.add_argument("--box-gib", type=float, default=23.0)
    args = ap.parse_args()
    print("| model | ranks | preset | params / rank | AdamW state / rank | peak / rank | box total | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        cfg = gpt2.GPTConfig(block_size=1024, vocab_size=50304, **SIZES[size])
        model = abstract_model(cfg, args.batch, args.seq)
        for n in (int(r) for r in args.ranks.split(",")):
            for preset in (["dp"] if n == 1 else args.presets.split(",")):
                t0 = time.perf_counter()
                m = plan_train_step(model, train_mesh((n,) if preset != "megatron" else (1, n), preset), preset,
                                    AdamW()).memory
                total = n * m["peak"]
                print(f"| GPT-2 {size} | {n} | {preset if n > 1 else 'any'} | {m['params'] / GIB:.2f} GiB | "
                      f"{m['opt_state'] / GIB:.2f} GiB | {m['peak'] / GIB:.2f} GiB | {total / GIB:.1f} GiB | "
                      f"{'yes' if total <= args.box_gib * GIB else 'no'} |  <!-- planned in "
                      f"{time.perf_counter() - t0:.0f}s -->", flush=True)


if __name__ == "__main__":
    main()
