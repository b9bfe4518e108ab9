"""PyTorch baselines for the training benchmark (scripts/bench_train.py is our side).

PyTorch is NOT a dependency of spmd_runtime: run this from its own venv, e.g. the one
scripts/compare_train.sh creates (default /tmp/torchvenv, CPU wheel of torch==2.13.0).

The model is the same as spmd_runtime/models/lm.py: a decoder-only Transformer LM with a
token embedding, a learned positional embedding, pre-LayerNorm blocks (causal multi-head
self-attention written as plain matmuls + masked softmax, GELU(tanh) MLP, residuals), a final
LayerNorm, an untied output layer (no biases on any projection) and softmax cross-entropy,
trained with AdamW in float32. ``--attn sdpa`` swaps the attention core for the fused
``F.scaled_dot_product_attention(is_causal=True)`` as a second figure.

Modes (each prints exactly one JSON line on stdout; rank 0 only in dtensor mode):

  eager    one process, torch.set_num_threads(--threads, default 2):
               python scripts/torch_baselines.py --mode eager --threads 2
  dtensor  Megatron-style tensor parallelism with torch.distributed.tensor.parallel
           (parallelize_module: ColwiseParallel for the Q, K, V and MLP up-projections,
           RowwiseParallel for the attention output and MLP down-projections, so the heads
           and the MLP hidden dim are split across ranks; embeddings, LayerNorms and the
           output layer are replicated), gloo backend on CPU, --threads (default 1) per rank:
               torchrun --standalone --nproc_per_node 2 scripts/torch_baselines.py --mode dtensor
           (under torchrun spell --d as --dim: torchrun takes "--d" for a prefix of its own options)

Timing: --warmup untimed steps, then --steps timed steps; a step is forward + backward +
AdamW step + zero_grad on one fixed random batch of (batch, seq) tokens (next-token targets).
median_step_s is the median over the timed steps (in dtensor mode each step's time is the max
over ranks); tokens_per_s = batch * seq / median_step_s. peak_rss_bytes is the process's
ru_maxrss (includes the ~220 MiB that importing torch costs; rss_after_import_bytes
says how much). wire_bytes_per_step counts, per rank, the bytes each collective that DTensor
issues in one training step puts on the wire under the ring model this project's
spmd_runtime/comm/collectives.py documents (all-reduce 2(k-1)/k*S, all-gather (k-1)/k*S_out,
reduce-scatter (k-1)/k*S_in, all-to-all (k-1)/k*S), measured in a separate step after the
timed ones; collectives counts them by op. loadavg_start/loadavg_end are os.getloadavg()
around the run, and other_cpu_busy_cores is how many cores' worth of CPU other processes used
during the timed steps (from /proc/stat less this benchmark's own CPU time): the machine may be
shared. If the dtensor run fails, the JSON carries "error" with the exception and no timing
numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback

MASKED_SCORE = -1e9  # as spmd_runtime/models/lm.py: a finite fill for masked attention scores


def rss_now_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def cpu_snapshot():
    """(wall s, seconds all CPUs were busy machine-wide, this process's CPU seconds) for other_cpu_busy_cores."""
    busy = -1.0
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system


def other_busy_cores(start, end, own_cpu_s) -> float | None:
    """Cores' worth of CPU that processes other than this benchmark used while it was timing."""
    wall = end[0] - start[0]
    if start[1] < 0 or wall <= 0:
        return None
    return round(max(0.0, (end[1] - start[1]) - own_cpu_s) / wall, 3)


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("eager", "dtensor"), default="eager")
    p.add_argument("--layers", type=int, default=2)
    # --dim: the same flag under another name, for torchrun, whose own argument parser rejects
    # "--d" after the script name as an ambiguous prefix of its --duplicate-* options.
    p.add_argument("--d", "--dim", dest="d", type=int, default=256, help="model width (alias --dim)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads per process (default: 2 in eager mode, 1 per rank in dtensor mode)")
    p.add_argument("--attn", choices=("manual", "sdpa"), default="manual",
                   help="manual: matmuls + masked softmax (like ours); sdpa: F.scaled_dot_product_attention")
    p.add_argument("--tp-plan", choices=("plain", "shared-input", "vocab"), default="plain",
                   help="dtensor mode: plain = ColwiseParallel on Q, K, V, MLP up and RowwiseParallel on the "
                        "attention output and MLP down (one backward all-reduce per Q/K/V); shared-input = "
                        "the same plus PrepareModuleInput on each attention module (one for all three); "
                        "vocab = shared-input plus the vocab dim of the token embedding (RowwiseParallel) "
                        "and of the output layer (ColwiseParallel + loss_parallel cross-entropy), like "
                        "spmd_runtime.train's megatron preset")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="dtensor mode: also train an unsharded copy on the same batch and report the largest "
                        "loss difference")
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = 2 if args.mode == "eager" else 1
    if args.d % args.heads:
        p.error(f"--d ({args.d}) must be a multiple of --heads ({args.heads})")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


# Imported after argument parsing so that --help works without torch.
def build_model(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, d, heads, attn):
            super().__init__()
            self.hd, self.attn = d // heads, attn
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, d, bias=False)
            self.v = nn.Linear(d, d, bias=False)
            self.o = nn.Linear(d, d, bias=False)

        def forward(self, x, causal):
            b, s, _ = x.shape
            # -1 heads: under tensor parallelism each rank's Q/K/V hold heads/k whole heads.
            q = self.q(x).view(b, s, -1, self.hd).transpose(1, 2)
            k = self.k(x).view(b, s, -1, self.hd).transpose(1, 2)
            v = self.v(x).view(b, s, -1, self.hd).transpose(1, 2)
            if self.attn == "sdpa":
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
                scores = scores.masked_fill(~causal, MASKED_SCORE)
                ctx = torch.softmax(scores, dim=-1) @ v
            return self.o(ctx.transpose(1, 2).reshape(b, s, -1))

    class MLP(nn.Module):
        def __init__(self, d, ffn):
            super().__init__()
            self.up = nn.Linear(d, ffn, bias=False)
            self.down = nn.Linear(ffn, d, bias=False)

        def forward(self, x):
            return self.down(F.gelu(self.up(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, d, heads, ffn, attn):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(d, eps=1e-5), Attention(d, heads, attn)
            self.ln2, self.mlp = nn.LayerNorm(d, eps=1e-5), MLP(d, ffn)

        def forward(self, x, causal):
            x = x + self.attn(self.ln1(x), causal)
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.d)
            self.pos = nn.Embedding(a.seq, a.d)
            self.blocks = nn.ModuleList(Block(a.d, a.heads, a.ffn, a.attn) for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.d, eps=1e-5)
            self.head = nn.Linear(a.d, a.vocab, bias=False)  # untied from self.tok
            self.register_buffer("causal", torch.ones(a.seq, a.seq, dtype=torch.bool).tril(), persistent=False)
            # GPT-2 initialisation as in lm.py: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers).
            for name, prm in self.named_parameters():
                if prm.dim() == 2:
                    small = name.endswith(("attn.o.weight", "mlp.down.weight"))
                    nn.init.normal_(prm, std=0.02 / (math.sqrt(2 * a.layers) if small else 1.0))

        def forward(self, tokens, targets):
            b, s = tokens.shape
            x = self.tok(tokens) + self.pos.weight[:s]
            causal = self.causal[:s, :s]
            for blk in self.blocks:
                x = blk(x, causal)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(b * s))

    torch.manual_seed(args.seed)
    return LM(args)


def make_batch(args):
    import torch
    g = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def train_steps(model, opt, tokens, targets, n, context=contextlib.nullcontext):
    """Run n steps (forward, backward, AdamW step, zero_grad); returns (per-step seconds, losses)."""
    times, losses = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        with context():
            loss = model(tokens, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return times, losses


def make_optimizer(model, args):
    """AdamW as spmd_runtime.optim.AdamW: decoupled weight decay on matrices only (not LayerNorm)."""
    import torch
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.999), eps=1e-8)


def common_fields(args, world):
    import torch
    return {
        "bench": "torch_baselines",
        "mode": args.mode,
        "attn": args.attn,
        "tp_plan": args.tp_plan if args.mode == "dtensor" else None,
        "world": world,
        "threads_per_rank": args.threads,
        "config": {k: getattr(args, k) for k in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch")},
        "steps": args.steps,
        "warmup": args.warmup,
        "dtype": "float32",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": None,
        "loadavg_end": None,
        "other_cpu_busy_cores": None,
    }


def timing_fields(times, args):
    med = statistics.median(times)
    return {
        "median_step_s": med,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "tokens_per_s": args.batch * args.seq / med,
    }


def run_eager(args):
    import torch
    load0 = os.getloadavg()
    rss0 = rss_now_bytes()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    opt = make_optimizer(model, args)
    tokens, targets = make_batch(args)
    _, warm_losses = train_steps(model, opt, tokens, targets, args.warmup)
    c0 = cpu_snapshot()
    times, losses = train_steps(model, opt, tokens, targets, args.steps)
    c1 = cpu_snapshot()
    out = common_fields(args, 1)
    out["other_cpu_busy_cores"] = other_busy_cores(c0, c1, c1[2] - c0[2])
    out.update(timing_fields(times, args))
    all_losses = warm_losses + losses
    out.update({
        "loss_first": all_losses[0],
        "loss_last": all_losses[-1],
        "wire_bytes_per_step": 0,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_after_import_bytes": rss0,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": times,
        "loadavg_start": list(load0),
        "loadavg_end": list(os.getloadavg()),
    })
    print(json.dumps(out), flush=True)


def wire_counter_mode(world):
    """A TorchDispatchMode that adds up the wire bytes (ring model) of the collectives DTensor issues."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    fc = torch.ops._c10d_functional

    def nbytes(t):
        return t.numel() * t.element_size()

    rules = {  # op packet -> (name, wire bytes as a function of (args, k))
        fc.all_reduce: ("all_reduce", lambda a, k: 2 * (k - 1) / k * nbytes(a[0])),
        fc.all_gather_into_tensor: ("all_gather", lambda a, k: (k - 1) * nbytes(a[0])),  # (k-1)/k * S_out
        fc.reduce_scatter_tensor: ("reduce_scatter", lambda a, k: (k - 1) / k * nbytes(a[0])),
        fc.all_to_all_single: ("all_to_all", lambda a, k: (k - 1) / k * nbytes(a[0])),
        fc.broadcast: ("broadcast", lambda a, k: nbytes(a[0])),
    }

    class WireBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.counts = 0.0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor lower itself to plain-tensor collectives first
            rule = rules.get(getattr(func, "_overloadpacket", None))
            if rule is not None:
                name, fn = rule
                self.bytes += fn(args, world)
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **kwargs)

    return WireBytes()


def run_dtensor(args):
    import torch
    import torch.distributed as dist

    load0 = os.getloadavg()
    rss0 = rss_now_bytes()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = common_fields(args, world)
    out["loadavg_start"] = list(load0)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       loss_parallel, parallelize_module)

        if args.heads % world or args.ffn % world or (args.tp_plan == "vocab" and args.vocab % world):
            raise ValueError(f"--heads ({args.heads}), --ffn ({args.ffn}) and, with --tp-plan vocab, --vocab "
                             f"({args.vocab}) must be multiples of the world size {world}")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = build_model(args)  # same seed on every rank: identical full weights before sharding
        ref = None
        if args.check:
            import copy
            ref = copy.deepcopy(model)
        plan, context = {}, contextlib.nullcontext
        if args.tp_plan == "vocab":
            plan["tok"] = RowwiseParallel(input_layouts=Replicate())  # vocab rows split, output all-reduced
            plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)  # logits vocab-split
            context = loss_parallel  # cross-entropy on vocab-split logits without gathering them
        for i in range(args.layers):
            if args.tp_plan in ("shared-input", "vocab"):
                # Make the attention input a Replicate DTensor once, so that the gradients of Q, K
                # and V w.r.t. it add up as one Partial DTensor and cost one all-reduce, not three.
                plan[f"blocks.{i}.attn"] = PrepareModuleInput(
                    input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None),
                    use_local_output=False)
            plan.update({
                f"blocks.{i}.attn.q": ColwiseParallel(),
                f"blocks.{i}.attn.k": ColwiseParallel(),
                f"blocks.{i}.attn.v": ColwiseParallel(),
                f"blocks.{i}.attn.o": RowwiseParallel(),
                f"blocks.{i}.mlp.up": ColwiseParallel(),
                f"blocks.{i}.mlp.down": RowwiseParallel(),
            })
        parallelize_module(model, mesh, plan)
        opt = make_optimizer(model, args)
        tokens, targets = make_batch(args)

        _, warm_losses = train_steps(model, opt, tokens, targets, args.warmup, context)
        dist.barrier()
        c0 = cpu_snapshot()
        times, losses = train_steps(model, opt, tokens, targets, args.steps, context)
        c1 = cpu_snapshot()
        own = torch.tensor([c1[2] - c0[2]], dtype=torch.float64)
        dist.all_reduce(own)  # CPU seconds of all ranks together
        out["other_cpu_busy_cores"] = other_busy_cores(c0, c1, float(own))
        # Per step, the slowest rank sets the pace.
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()

        counter = wire_counter_mode(world)
        with counter:
            train_steps(model, opt, tokens, targets, 1, context)

        check = None
        if ref is not None:
            ref_opt = make_optimizer(ref, args)
            _, ref_losses = train_steps(ref, ref_opt, tokens, targets, args.warmup + args.steps)
            all_losses = warm_losses + losses
            check = {"max_abs_loss_diff_vs_unsharded": max(abs(a - b) for a, b in zip(all_losses, ref_losses))}

        rss = [None] * world
        dist.all_gather_object(rss, {"peak_rss_bytes": peak_rss_bytes(), "rss_after_import_bytes": rss0})
        all_losses = warm_losses + losses
        out.update(timing_fields(times, args))
        out.update({
            "loss_first": all_losses[0],
            "loss_last": all_losses[-1],
            "wire_bytes_per_step": int(round(counter.bytes)),
            "collectives_per_step": counter.counts,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rss),
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in rss],
            "rss_after_import_bytes_per_rank": [r["rss_after_import_bytes"] for r in rss],
            "params": sum(p.numel() for p in model.parameters()),  # DTensor.numel() is the global size
            "step_s": times,
        })
        if check is not None:
            out["check"] = check
        rc = 0
    except Exception as e:  # report, do not fake a number
        out.update({
            "error": f"{type(e).__name__}: {e}",
            "traceback_tail": traceback.format_exc().strip().splitlines()[-6:],
            "median_step_s": None,
            "tokens_per_s": None,
        })
        print(f"[rank {rank}] dtensor run failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        rc = 1
    out["loadavg_end"] = list(os.getloadavg())
    if rank == 0:
        print(json.dumps(out), flush=True)
    if rc == 0:
        dist.destroy_process_group()
    return rc


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "eager":
        run_eager(args)
        return 0
    if "RANK" not in os.environ:
        print("--mode dtensor must be launched with torchrun, e.g.\n"
              "  torchrun --standalone --nproc_per_node 2 scripts/torch_baselines.py --mode dtensor",
              file=sys.stderr)
        return 2
    return run_dtensor(args)


if __name__ == "__main__":
    sys.exit(main())
