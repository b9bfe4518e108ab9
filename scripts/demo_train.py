"""Main job: train a small Transformer language model on the bundled corpus, sharded on a 2x4 mesh.

One traced training step (forward, backward, AdamW update) is partitioned with the
"megatron_wus" preset: batch on "data"; heads, MLP hidden and vocab on "model"; gradients
reduce-scattered over "data", the optimizer state and update sharded over "data", new
weights all-gathered. Every rank iterates the step on its own shards. At the end it checks
the loss curve against a 1-process run of the SAME traced step (the unpartitioned graph,
``sr.evaluate``), prints the collectives per step, saves a sharded checkpoint, reloads it
onto a different mesh and sharding and checks it holds the same state and continues the
same curve, and samples some text. It also profiles a few steps (OUT/profile, one Chrome
trace per rank) and draws OUT/loss_curve.png and OUT/step_breakdown.png (with matplotlib).

With ``--experts E`` every ``--moe-every``-th block is a GShard mixture of experts (top-2 gating with
capacity ``--capacity-factor``); use ``--preset moe`` or ``moe_megatron``. The progress line then also shows
the fraction of routed tokens dropped at full experts and the load-balancing loss.

Run: mpiexec -n 8 python scripts/demo_train.py   (scripts/demo.sh runs it, then an MoE run)
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time

# One BLAS thread per rank unless the caller chose (scripts/setup_env.sh does the same): 8 ranks on a few
# cores with a BLAS thread pool each would spend their time spinning. Set before NumPy loads BLAS.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import spmd_runtime as sr  # noqa: E402
from spmd_runtime import plots  # noqa: E402
from spmd_runtime.data import ALPHABET, batches, corpus, decode, encode, grammar_text  # noqa: E402
from spmd_runtime.models.lm import LMConfig, lm_logits  # noqa: E402
from spmd_runtime.optim import AdamW  # noqa: E402
from spmd_runtime.train import build_train_step_on_root, format_comm, run_on_root, train_mesh  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="2,4", help="mesh shape (product = number of ranks)")
    ap.add_argument("--preset", default="megatron_wus")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=25)
    for name, default in (("layers", 2), ("d", 64), ("heads", 4), ("ffn", 256), ("seq", 32), ("batch", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--experts", type=int, default=0, help="experts per MoE block (0: a dense model)")
    ap.add_argument("--moe-every", type=int, default=2, help="every n-th block is MoE (with --experts)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"],
                    help="compute dtype; 16-bit ones keep float32 master weights and optimizer state")
    ap.add_argument("--check-steps", type=int, default=None,
                    help="steps of the 1-process reference run to compare (default: all)")
    ap.add_argument("--reload-mesh", default=None, help="mesh to reload the checkpoint on (default: all ranks "
                                                        "on one axis)")
    ap.add_argument("--reload-preset", default="wus")
    ap.add_argument("--out", default="out")
    return ap.parse_args()


def main():
    args = parse_args()
    comm = MPI.COMM_WORLD
    rank, root = comm.Get_rank(), comm.Get_rank() == 0
    moe = dict(moe_every=args.moe_every, experts=args.experts, top_k=args.top_k,
               capacity_factor=args.capacity_factor) if args.experts else {}
    cfg = LMConfig(args.layers, args.d, args.heads, args.ffn, len(ALPHABET) + 1, args.seq, args.batch,
                   dtype=args.dtype, **moe)
    optimizer = AdamW(lr=args.lr, warmup=20)
    mesh = train_mesh(tuple(int(s) for s in args.mesh.split(",")), args.preset)
    t0 = time.perf_counter()
    ts = build_train_step_on_root(cfg, mesh, args.preset, optimizer, comm)
    if root:
        print(f"Transformer LM {cfg}\n{ts.optimizer}\npreset {args.preset!r} on {mesh}: {len(ts.graph.nodes)} traced "
              f"ops -> {len(ts.program.instrs)} instructions per rank (traced + partitioned in "
              f"{time.perf_counter() - t0:.1f}s)")
    data = batches(encode(corpus()), cfg.batch, cfg.seq, seed=0)
    feed = [next(data) for _ in range(args.steps + 1)]  # the same batches on every rank and in the reference
    local = ts.shard_state(ts.init(seed=0), rank)
    local, losses, seconds = train(ts, local, feed[:args.steps], comm, args.log_every)
    ok = comm.bcast(report(ts, args, losses, seconds, feed, comm), root=0)
    pictures(ts, local, losses, feed, args, comm)
    ok &= checkpoint_and_reload(ts, local, feed[args.steps], args, comm)
    params = ts.gather(local, comm)
    run_on_root(comm, lambda: sample(ts, params))
    if not ok:
        raise SystemExit(1)


def train(ts, local, feed, comm, log_every):
    """Iterate the step on local shards; rank 0 prints a progress line every ``log_every`` steps."""
    losses, seconds, t_last, n_last = [], 0.0, time.perf_counter(), 0
    mem = ts.memory_report()
    for i, (x, y) in enumerate(feed, 1):
        t0 = time.perf_counter()
        local, loss = ts.step(local, x, y, comm=comm)
        seconds += time.perf_counter() - t0
        losses.append(loss)
        if i % log_every == 0 or i == len(feed):
            rss = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX) * 1024
            if comm.Get_rank() != 0:
                continue
            now = time.perf_counter()
            rate = (i - n_last) * ts.cfg.tokens_per_step / (now - t_last)
            t_last, n_last = now, i
            moe = "".join(f"  {k.replace('_fraction', '')} {v:.3f}" for k, v in ts.metrics.items())
            print(f"{bar(i, len(feed))} step {i:>4}/{len(feed)}  loss {loss:.4f}{moe}  {rate:>6.0f} tok/s  per rank: "
                  f"params {kib(mem['params'])}, opt {kib(mem['opt_state'])}, peak buffers {kib(mem['peak'])}, "
                  f"max RSS {kib(rss)}", flush=True)
    return local, losses, seconds


def report(ts, args, losses, seconds, feed, comm) -> bool:
    """Loss curve vs the 1-process reference run of the same traced step (rank 0 runs it; the others
    wait without spinning), the comm summary and memory."""
    n = min(args.check_steps or len(losses), len(losses))
    ref = run_on_root(comm, lambda: reference_curve(ts, feed[:n]))
    if comm.Get_rank() != 0:
        return True
    diff = float(np.max(np.abs(np.array(losses[:n]) - np.array(ref))))
    bound = {"float64": 1e-9, "float32": 2e-3}.get(ts.cfg.dtype, 5e-2)  # 16-bit: reduction order rounds
    mem = ts.memory_report()
    print(f"\nloss: {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step {len(losses)}); uniform guess would be "
          f"{np.log(ts.cfg.vocab):.4f}")
    print(f"throughput: {len(losses) * ts.cfg.tokens_per_step / seconds:.0f} tokens/s on {ts.mesh.size} ranks "
          f"({seconds / len(losses) * 1e3:.1f} ms/step)")
    print(f"loss curve vs a 1-process run of the same step (sr.evaluate of the unpartitioned graph), {n} steps: "
          f"max |diff| {diff:.2e} (bound {bound:.0e}) -> {'OK' if diff <= bound else 'FAIL'}")
    print(f"collectives per step ({len(ts.program.comm_summary())} calls):\n{format_comm(ts.comm_summary())}")
    print(f"memory per rank: params {kib(mem['params'])} (of {kib(mem['params_global'])}), optimizer state "
          f"{kib(mem['opt_state'])} (of {kib(mem['opt_state_global'])}), peak live buffers {kib(mem['peak'])} "
          f"(activations/temporaries {kib(mem['activations'])})")
    return diff <= bound


def pictures(ts, local, losses, feed, args, comm, profiled_steps=5):
    """Profile a few more steps (one Chrome trace per rank in OUT/profile), then rank 0 draws
    OUT/loss_curve.png and OUT/step_breakdown.png (skipped with a message without matplotlib)."""
    profile_dir = os.path.join(args.out, "profile")
    if comm.Get_rank() == 0:
        shutil.rmtree(profile_dir, ignore_errors=True)
    comm.Barrier()
    with sr.profile.profiling(profile_dir, "train step"):
        for x, y in feed[:profiled_steps]:
            local, _ = ts.step(local, x, y, comm=comm)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"\nprofile of {profiled_steps} steps: {profile_dir} (open rank*.trace.json in Perfetto; summary: "
              f"python -m spmd_runtime profile {profile_dir})")
        print(sr.profile.summarize(profile_dir, top=6))
        for png in (plots.loss_curve_png(os.path.join(args.out, "loss_curve.png"), losses,
                                         title=f"{args.preset} on {ts.mesh}"),
                    plots.step_breakdown_png(os.path.join(args.out, "step_breakdown.png"),
                                             sr.profile.step_breakdown(profile_dir),
                                             title=f"one training step, {args.preset} on {ts.mesh}")):
            if png is not None:
                print(f"wrote {png}")


def reference_curve(ts, feed) -> list[float]:
    state, curve = ts.init(seed=0), []
    for x, y in feed:
        state, loss = ts.reference_step(state, x, y)
        curve.append(loss)
    return curve


def checkpoint_and_reload(ts, local, next_batch, args, comm) -> bool:
    """Save the sharded state, reload it on another mesh and preset, compare state and the next step's loss."""
    path = os.path.abspath(os.path.join(args.out, "lm_checkpoint"))
    ts.save(path, local, step=args.steps, comm=comm)
    shape = tuple(int(s) for s in args.reload_mesh.split(",")) if args.reload_mesh else (comm.Get_size(),)
    other = build_train_step_on_root(ts.cfg, train_mesh(shape, args.reload_preset), args.reload_preset,
                                     ts.optimizer, comm)
    reloaded = other.load(path, comm=comm)
    same = all(np.array_equal(a, b) for a, b in zip(ts.named(ts.gather(local, comm)).values(),
                                                    other.named(other.gather(reloaded, comm)).values()))
    _, loss_here = ts.step(local, *next_batch, comm=comm)
    _, loss_there = other.step(reloaded, *next_batch, comm=comm)
    tol = 1e-4 if ts.cfg.dtype in ("float32", "float64") else 1e-2  # 16-bit sums round in mesh order
    ok = same and abs(loss_here - loss_there) <= tol
    if comm.Get_rank() == 0:
        info = sr.checkpoint_info(path)
        print(f"\ncheckpoint (step {info['step']}, {len(info['tensors'])} tensors, sharded as on {ts.mesh}) saved "
              f"to {path}")
        print(f"reloaded on {other.mesh} with preset {args.reload_preset!r}: state identical: {same}; next step's "
              f"loss {loss_here:.6f} here, {loss_there:.6f} there -> {'OK' if ok else 'FAIL'}")
    return ok


def sample(ts, state, chars=160, temperature=0.7, seed=0):
    """A continuation of an unseen grammar sentence by the trained model (1-process forward graph),
    sampled at ``temperature`` from a seeded generator."""
    cfg, rng = ts.cfg, np.random.default_rng(seed)
    params = [state["params"][name] for name in ts.param_names]
    graph = sr.trace(lambda *a: lm_logits(cfg, a[:-1], a[-1]), *params, np.zeros((1, cfg.seq), np.int32))
    context = list(encode(grammar_text(4, seed=12345)[:cfg.seq]))
    for _ in range(chars):
        logits = sr.evaluate(graph, *params, np.array([context[-cfg.seq:]], np.int32))[0][0, -1] / temperature
        logits = logits[:len(ALPHABET)]  # the last id is no character (an undertrained model may pick it)
        logits = logits.astype(np.float64)
        p = np.exp(logits - logits.max())
        context.append(int(rng.choice(len(p), p=p / p.sum())))
    print(f"\nsample (temperature {temperature}, prompt in brackets): [{decode(context[:cfg.seq])}]"
          f"{decode(context[cfg.seq:])}")


def bar(i, n, width=20) -> str:
    filled = round(width * i / n)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def kib(n) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2 ** 20 else f"{n / 2 ** 20:.2f} MiB"


if __name__ == "__main__":
    main()
