"""GPT-2 training step (forward + backward + AdamW) here (``spmd_runtime.models.gpt2``, under mpiexec, one BLAS
thread per rank) at 1, 2 and 4 ranks under dp, fsdp and megatron, side by side with nanoGPT's own ``model.py`` in
PyTorch eager (``--torch-threads`` threads, its ``configure_optimizers`` AdamW) on the same config. Rounds are
interleaved (every one of our layouts, then torch; again; ...), every round printed, the min of each, the ratio
ours / torch; model FLOPs (6 N T plus attention's 12 L d T per token, nanoGPT's ``estimate_mfu`` count) as a
fraction of a two-core float32 GEMM peak measured here with NumPy matmul (every round, the best kept); memory per rank (max RSS, and the
program's peak of live local buffers) next to params + gradients + AdamW state + activations computed from the
config and the layout.

GPT-2 124M (the defaults: 12 layers, d 768, 12 heads, vocab 50304, batch x seq = 4 x 256):
    python scripts/bench_gpt2.py --nanogpt /work/scratch/nanogpt
A quick check of the machinery:
    python scripts/bench_gpt2.py --nanogpt /work/scratch/nanogpt --layers 2 --rounds 3 --steps 2

Our side runs as ``mpiexec -n R python scripts/bench_gpt2.py --worker ...`` (this interpreter, its venv's
``mpiexec``), the torch side as ``--torch-python scripts/bench_gpt2.py --torch-side ...`` (a venv with torch and
numpy; nanoGPT's ``model.py`` from ``--nanogpt``, never copied here); each writes one JSON file the driver reads.
Each side times ``--steps`` steps after one warm-up step (ours: compile + first run) and reports their median
(ours: the max over ranks of each step). Random tokens, dropout off, nanoGPT's init on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
HYPER = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # nanoGPT's train.py defaults
F32 = 4


def add_side_by_side_args(p: argparse.ArgumentParser, torch_threads: int, torch_threads_help: str | None = None,
                          **config) -> None:
    """The flags every GPT-2 script here shares (this one, gpt2_loss_curves.py): where nanoGPT and torch are,
    our launcher, and the model config (``config``: defaults of layers, d, heads, vocab, batch, seq)."""
    p.add_argument("--nanogpt", default="/work/scratch/nanogpt", help="directory with nanoGPT's model.py")
    p.add_argument("--torch-python", default="/tmp/torchvenv/bin/python")
    p.add_argument("--torch-threads", type=int, default=torch_threads, help=torch_threads_help)
    p.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    for name in ("layers", "d", "heads", "vocab", "batch", "seq"):
        p.add_argument(f"--{name}", type=int, default=config[name])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_args(p, 2, layers=12, d=768, heads=12, vocab=50304, batch=4, seq=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    p.add_argument("--runs", default="1:dp,2:dp,2:fsdp,2:megatron,4:dp,4:fsdp,4:megatron",
                   help="our runs, ranks:preset (at 1 rank every preset is the same program)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # internal: our side under mpiexec
    p.add_argument("--preset", default="dp", help=argparse.SUPPRESS)
    p.add_argument("--torch-side", metavar="JSON", help=argparse.SUPPRESS)  # internal: nanoGPT in torch
    return p.parse_args(argv)


def gpt_config(args, **extra) -> dict:
    return dict(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_embd=args.d,
                bias=True, **extra)


def batch_of(args, seed: int):
    """(inputs, targets) int32 (batch, seq) of random tokens, the same on both sides."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def model_flops(args) -> float:
    """Per step: 6 N per token (N: the parameters less the position table, the tied head counted once) plus
    attention's 12 L d T (nanoGPT's estimate_mfu), times the batch's tokens."""
    d, L, V, T = args.d, args.layers, args.vocab, args.seq
    n = V * d + L * (12 * d * d + 13 * d) + 2 * d
    return (6 * n + 12 * L * d * T) * args.batch * T


# ================================================================ our side (one rank of mpiexec)
def build_step(cfg, preset_name: str, ranks: int, optimizer):
    """The jitted training step of ``cfg`` on ``ranks`` ranks under preset ``preset_name``:
    ``step(params, state, idx, targets, key) -> (params, state, loss)`` (params and state donated), with
    ``place(numpy state dict, optimizer state) -> (params, state)`` laying them out and ``layout`` (a
    ``ParamLayout``), ``mesh`` and ``preset``. Dropout (``cfg.dropout`` > 0) draws from ``key``."""
    import spmd_runtime as sr  # the project's interpreter only (the driver and torch side run without it)
    from spmd_runtime.models import gpt2
    from spmd_runtime.train import PRESETS, param_layout, train_mesh

    mesh = train_mesh((ranks,), preset_name)
    preset = PRESETS[preset_name].on(mesh)
    layout = param_layout(gpt2.param_shapes(cfg), gpt2.param_roles(cfg), mesh, preset)
    decayed = gpt2.decayed(cfg)

    def used(p):  # fsdp: each weight gathered where used, its gradient reduce-scattered back
        return {n: w if layout.use[n] == layout.held[n] else
                sr.mesh_split(w, mesh, layout.use[n], grad_spec=layout.held[n]) for n, w in p.items()}

    def step(params, state, idx, targets, key):
        loss, grads = sr.value_and_grad(lambda p: gpt2.loss(cfg, used(p), idx, targets, key=key, train=True))(params)
        params, state = optimizer.update(params, grads, state, matrices=decayed)
        return params, state, loss

    held = {n: sr.P(*layout.held[n]) for n in layout.held}
    update = {n: sr.P(*layout.update[n]) for n in layout.update}
    state_specs = {"step": sr.P(), "m": update, "v": update}
    rows = sr.P(preset.batch or None)
    jitted = sr.jit(step, mesh=mesh, in_specs=(held, state_specs, rows, rows, sr.P()),
                    out_specs=(held, state_specs, sr.P()), donate_argnums=(0, 1))

    def place(params, state):
        params = {n: sr.device_put(w, held[n], mesh) for n, w in layout.hold(params).items()}
        state = {"step": sr.device_put(np.asarray(state["step"]), sr.P(), mesh),
                 **{k: {n: sr.device_put(np.reshape(w, layout.held_shapes[n]), update[n], mesh)
                        for n, w in state[k].items()} for k in ("m", "v")}}
        return params, state

    def batch(idx, targets):
        return sr.device_put(idx, rows, mesh), sr.device_put(targets, rows, mesh)
    return jitted, place, batch, layout, mesh, preset


def adamw():
    import spmd_runtime as sr  # the project's interpreter only
    b1, b2 = HYPER["betas"]
    return sr.AdamW(lr=HYPER["lr"], b1=b1, b2=b2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])


def computed_bytes(args, layout, mesh, preset) -> dict:
    """Per rank, from the config and the layout: parameters (held blocks), gradients and AdamW's two moments
    (update blocks), and activations kept for the backward: per layer and token 16 d floats (LayerNorm inputs and
    outputs 4 d, q k v 3 d, attention output d, MLP hidden before and after GELU 8 d; all but the LayerNorms' split
    by megatron's model axes) and attention scores and probabilities 2 h T, plus logits and their softmax 2 V per
    token (vocab split by megatron), each over the rows this rank holds."""
    from spmd_runtime.sharding import parse_spec  # the project's interpreter only

    def local(specs):
        return sum(int(np.prod(parse_spec(specs[n], mesh, len(s)).local_shape(s, mesh)))
                   for n, s in layout.held_shapes.items()) * F32
    params, update = local(layout.held), local(layout.update)
    rows = args.batch // max(1, mesh.axis_size(preset.batch)) if preset.batch else args.batch
    m = mesh.axis_size(preset.model) if preset.model else 1
    d, h, T, V = args.d, args.heads, args.seq, args.vocab
    per_layer = 4 * d + (12 * d + 2 * h * T) / m
    acts = rows * T * (args.layers * per_layer + 2 * V / m + d) * F32
    return {"params": params, "grads": update, "adam": 2 * update, "activations": int(acts),
            "total": int(params + 3 * update + acts)}


def our_worker(args) -> None:
    from mpi4py import MPI  # only under mpiexec (the driver and torch side have no MPI)
    # a split weight's block is a view of the whole array: the first step copies it once instead of donating it
    warnings.filterwarnings("ignore", message="donated input")

    import spmd_runtime.random as srandom
    from spmd_runtime.models import gpt2
    comm = MPI.COMM_WORLD
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = gpt2.GPTConfig(**gpt_config(args))
    optimizer = adamw()
    step, place, batch, layout, mesh, preset = build_step(cfg, args.preset, comm.Get_size(), optimizer)
    weights = gpt2.init_params(cfg, args.seed)
    params, state = place(weights, optimizer.init_state(weights))
    del weights
    idx, targets = batch(*batch_of(args, args.seed + 1))
    key = srandom.key(args.seed)
    start = time.perf_counter()
    params, state, loss = step(params, state, idx, targets, key)
    first = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    times, losses = [], [float(np.asarray(loss))]
    for _ in range(args.steps):
        comm.Barrier()
        start = time.perf_counter()
        params, state, loss = step(params, state, idx, targets, key)
        losses.append(float(np.asarray(loss)))
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    program = step.lower(params, state, idx, targets, key)
    rss = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=MPI.MAX)
    if comm.Get_rank() == 0:
        kinds = {}
        for c in program.comm_summary():
            kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
        with open(args.worker, "w") as f:
            json.dump({"times": times, "first": first, "losses": losses, "max_rss": rss, "base_rss": base_rss,
                       "program_peak": program.peak_bytes(), "computed": computed_bytes(args, layout, mesh, preset),
                       "collectives": kinds}, f)


# ================================================================ the torch side (its own interpreter)
def torch_side(args) -> None:
    import torch  # torch and nanoGPT exist only in the torch interpreter, where spmd_runtime does not
    sys.path.insert(0, args.nanogpt)
    import model as nanogpt

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    net = nanogpt.GPT(nanogpt.GPTConfig(**gpt_config(args, dropout=0.0)))
    optimizer = net.configure_optimizers(HYPER["weight_decay"], HYPER["lr"], HYPER["betas"], "cpu")
    idx, targets = (torch.from_numpy(a.astype(np.int64)) for a in batch_of(args, args.seed + 1))

    def one_step():
        _, loss = net(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    losses, times = [one_step()], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(one_step())
        times.append(time.perf_counter() - start)
    with open(args.torch_side, "w") as f:
        json.dump({"times": times, "losses": losses,
                   "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)


# ================================================================ the driver
def gemm_peak(threads: int, n: int = 2048, reps: int = 5) -> float:
    """float32 GEMM FLOP/s of NumPy's matmul with ``threads`` BLAS threads (a fresh interpreter, so the
    thread count holds), best of ``reps``."""
    code = ("import time, numpy as np\n"
            f"a = np.random.default_rng(0).standard_normal(({n}, {n})).astype('float32'); b = a.T.copy()\n"
            "a @ b\nbest = 1e9\n"
            f"for _ in range({reps}):\n    t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t)\n"
            f"print(2 * {n} ** 3 / best)")
    env = {**os.environ, **{v: str(threads) for v in THREAD_VARS}}
    return float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                text=True).stdout)


def run_ours(args, ranks: int, preset: str, folder: str) -> dict:
    out = os.path.join(folder, f"ours-{ranks}-{preset}.json")
    env = {**os.environ, **{v: "1" for v in THREAD_VARS}}
    cmd = [args.mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker", out,
           "--preset", preset] + _passed(args)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def run_torch(args, folder: str) -> dict:
    out = os.path.join(folder, "torch.json")
    cmd = [args.torch_python, os.path.abspath(__file__), "--torch-side", out] + _passed(args)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _passed(args) -> list:
    out = []
    for k in ("nanogpt", "torch_threads", "layers", "d", "heads", "vocab", "batch", "seq", "steps", "seed"):
        out += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return out


def _mib(n) -> str:
    return f"{n / 2 ** 20:.0f} MiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        our_worker(args)
        return 0
    if args.torch_side:
        torch_side(args)
        return 0
    runs = [(int(r), p) for r, p in (x.split(":") for x in args.runs.split(","))]
    flops = model_flops(args)
    peak = [gemm_peak(2), 2 * gemm_peak(1)]
    print(f"GPT-2 {gpt_config(args)}, batch x seq {args.batch} x {args.seq}, AdamW {HYPER}; model FLOPs per step "
          f"{flops / 1e9:.1f} G; two-core float32 GEMM peak (NumPy matmul 2048^2): {peak[0] / 1e9:.1f} GFLOP/s "
          f"with 2 threads, {peak[1] / 1e9:.1f} as 2 x one thread; load average {os.getloadavg()[0]:.1f}")
    ours = {r: [] for r in runs}
    torch_runs = []
    with tempfile.TemporaryDirectory() as folder:
        for rnd in range(args.rounds):
            if rnd:  # the peak is measured every round too: on a loaded machine the first one may be low
                peak = [max(peak[0], gemm_peak(2)), max(peak[1], 2 * gemm_peak(1))]
                print(f"round {rnd + 1}: GEMM peak so far {peak[0] / 1e9:.1f} GFLOP/s (2 threads), "
                      f"{peak[1] / 1e9:.1f} (2 x one thread)", flush=True)
            for r in runs:
                ours[r].append(run_ours(args, *r, folder))
                got = ours[r][-1]
                print(f"round {rnd + 1}: ours {r[0]} rank(s) {r[1]:9s} step {np.median(got['times']):.4f} s "
                      f"(steps {', '.join(f'{t:.4f}' for t in got['times'])}; first {got['first']:.1f} s) "
                      f"loss {got['losses'][-1]:.4f}", flush=True)
            torch_runs.append(run_torch(args, folder))
            got = torch_runs[-1]
            print(f"round {rnd + 1}: torch {args.torch_threads} threads     step {np.median(got['times']):.4f} s "
                  f"(steps {', '.join(f'{t:.4f}' for t in got['times'])}) loss {got['losses'][-1]:.4f}", flush=True)
    best_peak = max(peak)
    torch_min = min(np.median(t["times"]) for t in torch_runs)
    print(f"\nmin over {args.rounds} rounds (each round: the median of {args.steps} steps); fraction of peak = "
          f"model FLOPs / step time / {best_peak / 1e9:.1f} GFLOP/s (the higher peak measured; per rank at 1 "
          f"rank: of one core's {peak[1] / 2e9:.1f})")
    print(f"torch {args.torch_threads} threads: {torch_min:.4f} s, {flops / torch_min / best_peak:.0%} of the "
          f"two-core peak, max RSS {_mib(torch_runs[-1]['max_rss'])}")
    for r in runs:
        t = min(np.median(x["times"]) for x in ours[r])
        last = ours[r][-1]
        c = last["computed"]
        cores_peak = best_peak if r[0] >= 2 else peak[1] / 2
        print(f"ours {r[0]} rank(s) {r[1]:9s}: {t:.4f} s, {t / torch_min:.2f}x torch, "
              f"{flops / t / cores_peak:.0%} of {'two-core' if r[0] >= 2 else 'one-core'} peak; per rank: max RSS "
              f"{_mib(last['max_rss'])} (at start {_mib(last['base_rss'])}), program peak "
              f"{_mib(last['program_peak'])}, computed {_mib(c['total'])} (params {_mib(c['params'])} + grads "
              f"{_mib(c['grads'])} + AdamW {_mib(c['adam'])} + activations {_mib(c['activations'])}); "
              f"program peak / computed {last['program_peak'] / c['total']:.2f}; collectives {last['collectives']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
