"""JAX/XLA baselines for the training benchmark (scripts/bench_train.py is our side, torch_baselines.py PyTorch's).

JAX is NOT a dependency of spmd_runtime: run this from its own venv, e.g. the one scripts/compare_train.sh
creates (default /tmp/jaxvenv, the CPU build ``pip install jax``). Host devices come from
XLA_FLAGS=--xla_force_host_platform_device_count=N, which this script sets from --devices before importing jax.

The model is the one of spmd_runtime/models/lm.py and torch_baselines.py: decoder-only Transformer LM, token
and learned positional embeddings, pre-LayerNorm blocks (causal multi-head attention as plain matmuls + masked
softmax, GELU(tanh) MLP, residuals), final LayerNorm, untied output layer, no biases on projections, softmax
cross-entropy, float32, trained with AdamW (decoupled weight decay on matrices only, bias correction) written
out here (no optax). The whole step (forward, backward, update) is one jitted function with donated state.

Modes (each prints exactly one JSON line on stdout):
  single  one device (XLA's own thread pool over the machine's cores)
  dp      data parallel over --devices host devices: batch split, parameters and state replicated (GSPMD)
  tp      Megatron tensor parallel over --devices: Q/K/V and MLP-up split by columns (heads / hidden),
          attention-output and MLP-down by rows, everything else replicated; GSPMD inserts the collectives
          (as spmd_runtime's megatron preset and DTensor's ColwiseParallel/RowwiseParallel plan)

    XLA_FLAGS= python scripts/jax_baselines.py --mode tp --devices 2

Timing: --warmup untimed steps (the first compiles), then --steps timed ones, each ended by
block_until_ready on the loss; median_step_s is their median, tokens_per_s = batch * seq / median_step_s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

MASKED_SCORE = -1e9  # as spmd_runtime/models/lm.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("single", "dp", "tp"), default="tp")
    p.add_argument("--devices", type=int, default=2, help="host devices (XLA_FLAGS device count)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d", "--dim", dest="d", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.d % args.heads:
        p.error(f"--d ({args.d}) must be a multiple of --heads ({args.heads})")
    if args.mode == "single":
        args.devices = 1
    return args


def init_params(args, key):
    import jax
    import jax.numpy as jnp

    def normal(key, shape, scale=0.02):
        return scale * jax.random.normal(key, shape, jnp.float32)

    keys = iter(jax.random.split(key, 4 + 6 * args.layers))
    small = 0.02 / math.sqrt(2 * args.layers)  # residual projections, GPT-2 init as lm.py
    params = {"tok": normal(next(keys), (args.vocab, args.d)), "pos": normal(next(keys), (args.seq, args.d)),
              "ln_f_g": jnp.ones(args.d), "ln_f_b": jnp.zeros(args.d),
              "head": normal(next(keys), (args.d, args.vocab))}
    for i in range(args.layers):
        params.update({
            f"b{i}.ln1_g": jnp.ones(args.d), f"b{i}.ln1_b": jnp.zeros(args.d),
            f"b{i}.ln2_g": jnp.ones(args.d), f"b{i}.ln2_b": jnp.zeros(args.d),
            f"b{i}.q": normal(next(keys), (args.d, args.d)), f"b{i}.k": normal(next(keys), (args.d, args.d)),
            f"b{i}.v": normal(next(keys), (args.d, args.d)), f"b{i}.o": normal(next(keys), (args.d, args.d), small),
            f"b{i}.up": normal(next(keys), (args.d, args.ffn)),
            f"b{i}.down": normal(next(keys), (args.ffn, args.d), small)})
    return params


def param_spec(name, mode):
    """PartitionSpec of a parameter: Megatron's column/row splits under tp, replicated otherwise."""
    from jax.sharding import PartitionSpec as P
    if mode == "tp":
        leaf = name.split(".")[-1]
        if leaf in ("q", "k", "v", "up"):
            return P(None, "x")
        if leaf in ("o", "down"):
            return P("x", None)
    return P()


def loss_fn(params, tokens, targets, args):
    import jax
    import jax.numpy as jnp

    def layer_norm(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * g + b

    b, s = tokens.shape
    hd = args.d // args.heads
    causal = jnp.tril(jnp.ones((s, s), bool))
    x = params["tok"][tokens] + params["pos"][:s]
    for i in range(args.layers):
        p = lambda n: params[f"b{i}.{n}"]  # noqa: E731
        h = layer_norm(x, p("ln1_g"), p("ln1_b"))
        q, k, v = ((h @ p(n)).reshape(b, s, args.heads, hd).transpose(0, 2, 1, 3) for n in "qkv")
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), MASKED_SCORE)
        ctx = jax.nn.softmax(scores, axis=-1) @ v
        x = x + ctx.transpose(0, 2, 1, 3).reshape(b, s, args.d) @ p("o")
        h = layer_norm(x, p("ln2_g"), p("ln2_b"))
        x = x + jax.nn.gelu(h @ p("up"), approximate=True) @ p("down")
    logits = layer_norm(x, params["ln_f_g"], params["ln_f_b"]) @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def make_step(args):
    import jax
    import jax.numpy as jnp
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01

    def step(params, m, v, t, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, args)
        t = t + 1.0
        c1, c2 = 1.0 / (1.0 - b1 ** t), 1.0 / (1.0 - b2 ** t)
        new_p, new_m, new_v = {}, {}, {}
        for n, p in params.items():
            g = grads[n]
            new_m[n] = b1 * m[n] + (1 - b1) * g
            new_v[n] = b2 * v[n] + (1 - b2) * g * g
            update = new_m[n] * c1 / (jnp.sqrt(new_v[n] * c2) + eps)
            if p.ndim >= 2:  # decoupled weight decay on matrices only
                update = update + wd * p
            new_p[n] = p - args.lr * update
        return new_p, new_m, new_v, t, loss
    return step


def main():
    args = parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    load0 = os.getloadavg()
    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices} needs that many host devices; got {len(jax.devices())}")
    mesh = Mesh(np.array(devices), ("x",))
    params = init_params(args, jax.random.PRNGKey(args.seed))
    specs = {n: NamedSharding(mesh, param_spec(n, args.mode)) for n in params}
    data_spec = NamedSharding(mesh, P("x") if args.mode == "dp" else P())
    scalar = NamedSharding(mesh, P())
    params = {n: jax.device_put(p, specs[n]) for n, p in params.items()}
    m = {n: jax.device_put(jnp.zeros_like(p), specs[n]) for n, p in params.items()}
    v = {n: jax.device_put(jnp.zeros_like(p), specs[n]) for n, p in params.items()}
    t = jax.device_put(jnp.zeros((), jnp.float32), scalar)
    rng = np.random.default_rng(args.seed + 1)
    data = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    tokens, targets = (jax.device_put(a, data_spec) for a in (data[:, :-1], data[:, 1:]))
    step = jax.jit(make_step(args), in_shardings=(specs, specs, specs, scalar, data_spec, data_spec),
                   out_shardings=(specs, specs, specs, scalar, scalar), donate_argnums=(0, 1, 2, 3))
    losses, times = [], []
    for k in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        params, m, v, t, loss = step(params, m, v, t, tokens, targets)
        loss.block_until_ready()
        if k >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    med = statistics.median(times)
    print(json.dumps({
        "bench": "jax_baselines", "mode": args.mode, "devices": args.devices,
        "config": {k: getattr(args, k) for k in ("layers", "d", "heads", "ffn", "vocab", "seq", "batch")},
        "optimizer": "AdamW", "dtype": "float32", "jax": jax.__version__, "python": platform.python_version(),
        "xla_flags": os.environ["XLA_FLAGS"], "steps": args.steps, "warmup": args.warmup,
        "median_step_s": med, "min_step_s": min(times), "max_step_s": max(times),
        "tokens_per_s": args.batch * args.seq / med, "loss_first": losses[0], "loss_last": losses[-1],
        "step_s": times, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg())}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
