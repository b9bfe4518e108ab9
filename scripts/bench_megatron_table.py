"""Plan every row of Megatron-LM's Table 1 (and GShard's MoE(2048E, 36L)) from shapes alone, next to the hand
formulas.

Each row is traced and partitioned on its own layout (tensor x pipeline x data) with ``sr.TensorSpec`` leaves
(``spmd_runtime.train.plan``): nothing is allocated and nothing runs. Per rank it prints partition seconds,
instructions, parameter + optimizer bytes, peak bytes, and wire bytes per step by collective kind and mesh axis,
each NEXT TO its hand formula and the ratio ours / formula:

- parameters: Megatron's eq. 2, P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)); held per rank: fp32 master
  weights + Adam's m and v = 12 bytes x P / (t p) (the embedding counted once, as eq. 2 does);
- peak: 16 bytes x P / (t p) (the held 12, plus the 16-bit weight copies and gradients; one copy of each, as
  Megatron's optimizer updates in place: the script plans the step with donation unless ``--no-donate``) + activations
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"): with full
  recompute 2 s b h bytes per layer (each layer's input), for the l/p layers of a stage and min(p, M) micro-batches
  in flight (1F1B), plus one layer's recomputed activations s b h (10 + 24/t + 5 a s/(h t)); without recompute
  s b h (10 + 24/t + 5 a s/(h t)) per layer (s b h (34 + 5 a s/h) at t = 1);
- tensor-parallel traffic: 4 (no remat) / 6 (full remat) all-reduces of the b s h activation per layer and
  micro-batch over the model axis, each 2 (t - 1)/t x 2 b s h bytes on the wire;
- data-parallel traffic: ONE reduction of the 16-bit gradients per step, 2 (d - 1)/d x 2 P/(t p) bytes;
- pipeline traffic: one send of the b s h activation forward and one of its gradient backward per micro-batch,
  2 M x 2 b s h bytes (with ``--sp`` of the sequence-split activation: 1/t of that).

The model is Megatron's GPT (biases on every projection, the output layer tied to the embedding), so its
parameter count is exactly eq. 2's. Here b is the micro-batch size per data-parallel rank (Table 1 gives only the global batch; 1 assumed, as in
Megatron-LM's published GPT-3 175B script), M = batch / (d b) micro-batches (gradient accumulation without a
pipeline, the pipeline's micro-batches with one), V = 51200, s = 2048, bf16 compute (the paper: fp16; same bytes).

Rows are planned with the closest preset: ``megatron`` (mesh data x model) for p = 1, ``pipeline_1f1b`` (stage x
data x model; the paper's 1F1B, without its interleaving; ``--schedule pipeline`` for GPipe) for p > 1. A row
that cannot be planned prints why and the script goes on. ``--max-ranks`` skips the larger meshes (partitioning no
longer grows with the rank count: the 1T row's 3072 ranks plan like the others).

    python scripts/bench_megatron_table.py --predict dgx-a100-80gb   # every row, and its predicted TFLOP/s
    python scripts/bench_megatron_table.py --rows 1.7B,18B --remat none
    python scripts/bench_megatron_table.py --rows 1T --schedule pipeline   # GPipe instead of 1F1B
    python scripts/bench_megatron_table.py --rows 145B,1T --sp   # Megatron-SP in the stages (pipeline_1f1b_sp)
    python scripts/bench_megatron_table.py --no-donate   # new parameters and optimizer state beside the old

The tensor-parallel all-reduces per layer are those in the loops over a stage's layers, per layer and iteration
(M micro-batches, or the M + S - 1 ticks of the pipeline loops); the embedding's and the head's (one each per
micro-batch, on every stage in the vectorised pipeline) are printed beside them.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import spmd_runtime as sr  # noqa: E402
from spmd_runtime.cost import collective_kind  # noqa: E402
from spmd_runtime.optim import AdamW  # noqa: E402
from spmd_runtime.train.plan import plan_train_step  # noqa: E402

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC21), Table 1: name, attention heads a, hidden size h, layers l, tensor-parallel t, pipeline-parallel p,
# GPUs, global batch size. Data-parallel d = GPUs / (t p).
TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072),
]
# Table 1's achieved teraFLOP/s per GPU (A100, eq. 3's FLOPs over the measured step), by row
PUBLISHED_TFLOPS = {"1.7B": 137, "3.6B": 138, "7.5B": 142, "18B": 135, "39B": 138, "76B": 140, "145B": 148,
                    "310B": 155, "530B": 163, "1T": 163}
VOCAB, SEQ, MICRO = 51200, 2048, 1
GIB = 2.0 ** 30
# Lepikhin et al. 2020, "GShard", MoE(2048E, 36L): 36 layers (every other one MoE, top-2, capacity factor 2),
# 2048 experts, model dim 1024, FFN hidden 8192, 16 heads of dim 128, 2048 TPU cores (one expert each),
# 4M tokens per batch; planned as a decoder-only LM of the same shape (GShard's model is an encoder-decoder).
# Its published training speed: 0.72 steps/s on 2048 TPU v3 cores (the figure issue 27 compares against).
GSHARD_HARDWARE, GSHARD_STEPS_PER_S = "tpu-v3", 0.72
GSHARD = dict(layers=36, d=1024, heads=16, head_dim=128, ffn=8192, experts=2048, moe_every=2, vocab=32000,
              seq=1024, batch=4096, ranks=2048)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="comma-separated row names (1.7B, ..., 1T, gshard); default all")
    ap.add_argument("--max-ranks", type=int, default=4096, help="skip rows on more ranks than this")
    ap.add_argument("--remat", default="full", choices=["full", "none"], help="full: the paper's full recompute")
    ap.add_argument("--moe-unrolled", action="store_true", help="the MoE row's 36 blocks unrolled (default: ONE scan "
                    "over its 18 groups of a dense and an MoE block)")
    ap.add_argument("--moe-remat", default="full_save_all_to_all", choices=["full_save_all_to_all", "full", "none"],
                    help="the MoE row's remat: full_save_all_to_all (default: full recompute, the all-to-all "
                         "results saved) or full (the all-to-alls sent again by the recomputed forward)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--schedule", default="pipeline_1f1b", choices=["pipeline_1f1b", "pipeline"],
                    help="the preset of the p > 1 rows: 1F1B (the paper's schedule, default) or GPipe")
    ap.add_argument("--sp", action="store_true",
                    help="Megatron-SP (Korthikanti et al. 2022): the sequence split over the tensor-parallel axis "
                         "outside its regions (megatron_sp, or the schedule's _sp preset): the activation formula "
                         "theirs with sequence parallelism, the all-reduces counted as the reduce-scatters that "
                         "replace them (each with an all-gather: the same bytes)")
    ap.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                    help="the step updates parameters and optimizer state in place (build_train_step(donate=True)), "
                         "the default: Megatron's optimizer updates its fp32 master weights and Adam's moments in "
                         "place, so the formula's 16 bytes per parameter hold one copy of them; --no-donate writes "
                         "the new ones beside the old (the peak then holds both)")
    ap.add_argument("--predict", default=None, metavar="HARDWARE",
                    help="also predict each row's step on this hardware profile (e.g. dgx-a100-80gb: program.estimate)"
                         " and print its TFLOP/s per GPU by the paper's eq. 3 next to the published figure")
    return ap.parse_args(argv)


def megatron_formulas(a, h, l, t, p, d, batch, remat, sp: bool = False) -> dict:
    """Per-rank hand figures of a Table 1 row (see the module docstring); ``sp``: with sequence parallelism."""
    params = 12 * l * h * h * (1 + 13 / (12 * h) + (VOCAB + SEQ) / (12 * l * h))  # eq. 2
    local = params / (t * p)
    m = batch // (d * MICRO)
    sbh = SEQ * MICRO * h
    # Korthikanti's per layer, tensor parallel: the LayerNorm / dropout / residual part (10 s b h) split t ways too
    # with sequence parallelism, as is each layer's saved input under full recompute
    layer = sbh * ((10 / t if sp else 10) + 24 / t + 5 * a * SEQ / (h * t))
    saved = 2 * sbh / (t if sp else 1)
    in_flight = min(p, m) if p > 1 else 1
    acts = (saved * (l / p) * in_flight + layer) if remat == "full" else layer * (l / p) * in_flight
    ring = lambda k: 2 * (k - 1) / k
    return {"P": params, "held": 12 * local, "peak": 16 * local + acts, "M": m,
            "ar_per_layer": 0 if t == 1 else 6 if remat == "full" else 4,
            "model": (6 if remat == "full" else 4) * (l / p) * m * ring(t) * 2 * sbh,
            "data": ring(d) * 2 * local, "stage": 2 * m * 2 * sbh / (t if sp else 1) if p > 1 else 0.0}


def eq3_flops(batch, l, h) -> float:
    """Megatron's eq. 3: model FLOPs per step with full recompute, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    return 96 * batch * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def predict_row(name, program, hardware, flops, gpus) -> None:
    """The predicted step on ``hardware`` and its TFLOP/s per GPU (eq. 3) beside Table 1's."""
    e = program.estimate(hardware)
    tflops = flops / (e.step_s * gpus) / 1e12
    published = PUBLISHED_TFLOPS.get(name)
    versus = f"   published {published} TFLOP/s   ratio {tflops / published:5.2f}" if published else ""
    print(f"  predicted on {e.hardware.name}: step {e.step_s:.2f} s (compute {e.compute_s:.2f} s, exposed "
          f"communication {e.exposed_comm_s:.2f} s); {tflops:.0f} TFLOP/s per GPU{versus}; {e.verdict}")
    PREDICTED.append((name, gpus, e.step_s, tflops, published, e.fits))


def bucket(axes: tuple) -> str:
    """The formula a collective's traffic counts against: the pipeline shift (any group with 'stage') is
    'stage'; otherwise its mesh axes."""
    return "stage" if "stage" in axes else ",".join(axes)


def activation_all_reduces(program, nbytes: int, layers: int, trips: int = 1, in_layers: bool = False,
                           kind: str = "all_reduce") -> tuple:
    """Executions per step of all-reduces (``kind``: Megatron-SP's reduce-scatters) over "model" of exactly
    ``nbytes`` (the local b s h activation; a start/done pair counts once): (those in the loops over the
    ``layers`` layers of a stage, the others: the embedding's and the head's)."""
    inside = outside = 0
    sizes = {i.out: i.nbytes for i in program.instrs}
    for ins in program.instrs:
        if ins.op == "scan":
            a = ins.attrs
            more = activation_all_reduces(a["body"], nbytes, layers, trips * a["length"],
                                          in_layers or a["length"] == layers, kind)
            inside, outside = inside + more[0], outside + more[1]
        elif collective_kind(ins.op) == kind and tuple(ins.attrs.get("axes", ())) == ("model",) \
                and sizes.get(ins.args[0]) == nbytes:
            inside, outside = (inside + trips, outside) if in_layers else (inside, outside + trips)
    return inside, outside


def plan_row(row, args) -> None:
    name, a, h, l, t, p, gpus, batch = row
    d = gpus // (t * p)
    f = megatron_formulas(a, h, l, t, p, d, batch, args.remat, args.sp)
    head = f"{name}: l={l} h={h} a={a}  t={t} p={p} d={d} ({gpus} ranks)  batch {batch}, M={f['M']} x b={MICRO}"
    if gpus > args.max_ranks:
        print(f"{head}\n  skipped: {gpus} ranks > --max-ranks {args.max_ranks}\n")
        return
    cfg = sr.LMConfig(layers=l, d=h, heads=a, ffn=4 * h, vocab=VOCAB, seq=SEQ, batch=batch, dtype=args.dtype,
                      remat=args.remat, tied=True, bias=True)  # Megatron's GPT: biases, tied output layer
    preset, mesh = (("megatron", sr.Mesh((d, t), ("data", "model"))) if p == 1 else
                    (args.schedule, sr.Mesh((p, d, t), ("stage", "data", "model"))))
    preset += "_sp" if args.sp else ""
    try:
        plan = plan_train_step(cfg, mesh, preset, AdamW(), microbatches=f["M"], donate=args.donate)
    except Exception as e:  # a row the presets cannot express yet: say why, go on with the next
        print(f"{head}\n  not planned ({preset}): {type(e).__name__}: {str(e)[:400]}\n")
        return
    mem, wire = plan.memory, plan.wire_by_axis()
    held = mem["params"] + mem["opt_state"]
    item = 2  # bytes of a 16-bit activation
    iterations = f["M"] + p - 1 if p > 1 else f["M"]  # the pipeline loop runs M + S - 1 times
    in_layers, rest = activation_all_reduces(plan.step.program, MICRO * SEQ * h * item, l // p,
                                             kind="reduce_scatter" if args.sp else "all_reduce")
    ars = in_layers / (l / p * iterations)
    print(f"{head}  preset {preset}")
    print(f"  partition {plan.seconds:.2f} s ({plan.cpu_seconds:.2f} s CPU)   instructions {plan.instructions}")
    row_line = lambda what, ours, formula, unit=GIB, fmt="{:10.2f} GiB": (
        f"  {what:<34}" + fmt.format(ours / unit) + "   formula " + fmt.format(formula / unit)
        + (f"   ratio {ours / formula:6.2f}" if formula else ""))
    print(row_line("params + optimizer state / rank", held, f["held"]))
    print(row_line("peak / rank", mem["peak"], f["peak"]))
    reductions = "reduce-scatters" if args.sp else "all-reduces"
    print(row_line(f"TP {reductions} of b*s*h per layer", ars, f["ar_per_layer"], 1, "{:10.2f}    "))
    print(f"  {'  + outside the layers, per iteration':<34}{rest / iterations:10.2f}        (embedding, head)")
    for axis in ("model", "data", "stage"):
        print(row_line(f"wire bytes / step, {axis}", sum(v for k, v in wire.items() if bucket(tuple(k.split(",")))
                                                          == axis), f[axis]))
    for g in plan.comm:
        print(f"    {g['kind']:<19} {','.join(g['axes']):<18} x{g['count']:<4} {g['wire_bytes'] / GIB:10.2f} GiB")
    if args.predict:
        predict_row(name, plan.step.program, args.predict, eq3_flops(batch, l, h), gpus)
    print()
    SUMMARY.append((name, gpus, plan.cpu_seconds, plan.instructions, held, f["held"], mem["peak"], f["peak"],
                    sum(wire.values()), f["model"] + f["data"] + f["stage"], ars, f["ar_per_layer"]))


def gshard_formulas(g) -> dict:
    """Per-rank hand figures of the MoE row: parameters (one expert per rank), Adafactor's held bytes (fp32
    weights; the factored moments, ~(rows + columns) per matrix, not counted), the all-to-all traffic: 2 forward
    + 2 backward per MoE layer of the local dispatched (E, G/N, C, M) tensor, each (N - 1)/N of it on the wire,
    and one all-reduce of the replicated (non-expert) weights' 16-bit gradients, 2 (N - 1)/N x 2 bytes each."""
    d, ffn, e, n, inner = g["d"], g["ffn"], g["experts"], g["ranks"], g["heads"] * g["head_dim"]
    moe_layers = g["layers"] // g["moe_every"]
    dense = (g["vocab"] + g["seq"]) * d + g["layers"] * (4 * d * inner + 4 * d) + 2 * d + d * g["vocab"]
    replicated = dense + (g["layers"] - moe_layers) * 2 * d * ffn + moe_layers * d * e
    local = replicated + moe_layers * 2 * d * ffn * e // n
    capacity = math.ceil(2.0 * 2 * g["seq"] / e)
    dispatched = e * (g["batch"] // n) * capacity * d * 2
    return {"held": 4 * local, "all_to_all": 4 * moe_layers * (n - 1) / n * dispatched,
            "all_reduce": 2 * (n - 1) / n * 2 * replicated}


def plan_gshard(args) -> None:
    g = GSHARD
    head = (f"GShard MoE(2048E, 36L): d={g['d']} heads={g['heads']}x{g['head_dim']} ffn={g['ffn']} "
            f"experts={g['experts']} on {g['ranks']} ranks, preset moe, Adafactor, remat {args.moe_remat}, "
            f"{'unrolled' if args.moe_unrolled else 'scanned in groups of moe_every blocks'}")
    if g["ranks"] > args.max_ranks:
        print(f"{head}\n  skipped: {g['ranks']} ranks > --max-ranks {args.max_ranks}\n")
        return
    fields = {k: v for k, v in g.items() if k != "ranks"}
    try:
        cfg = sr.LMConfig(dtype=args.dtype, remat=args.moe_remat, scan_layers=not args.moe_unrolled, **fields)
        plan = plan_train_step(cfg, sr.Mesh((g["ranks"], 1), ("data", "model")), "moe",
                               sr.Adafactor())  # factored over the last two dims: each expert's moments its own
    except Exception as e:  # say why, as for the Table 1 rows
        print(f"{head}\n  not planned: {type(e).__name__}: {str(e)[:400]}\n")
        return
    f, mem = gshard_formulas(g), plan.memory
    ours = sum(c["wire_bytes"] for c in plan.comm if c["kind"].startswith("all_to_all"))
    reduced = sum(c["wire_bytes"] for c in plan.comm if c["kind"] == "all_reduce")
    print(head)
    print(plan.format())
    held = mem["params"] + mem["opt_state"]
    print(f"  params + optimizer state / rank {held / GIB:10.2f} GiB   formula {f['held'] / GIB:10.2f} GiB   "
          f"ratio {held / f['held']:6.2f}")
    print(f"  all-to-all wire bytes / step    {ours / GIB:10.2f} GiB   formula {f['all_to_all'] / GIB:10.2f} GiB   "
          f"ratio {ours / f['all_to_all']:6.2f}")
    print(f"  all-reduce wire bytes / step    {reduced / GIB:10.2f} GiB   formula {f['all_reduce'] / GIB:10.2f} GiB   "
          f"ratio {reduced / f['all_reduce']:6.2f}")
    if args.predict:  # on the paper's own device, whatever profile the Table 1 rows use
        predict_gshard(plan.step.program)
    print()


def predict_gshard(program) -> None:
    """The MoE row's predicted steps/s on TPU v3 (GShard's device: 2048 cores) beside the published 0.72."""
    e = program.estimate(GSHARD_HARDWARE)
    rate = 1.0 / e.step_s
    print(f"  predicted on {e.hardware.name}: step {e.step_s:.2f} s (compute {e.compute_s:.2f} s, exposed "
          f"communication {e.exposed_comm_s:.2f} s); {rate:.2f} steps/s   published {GSHARD_STEPS_PER_S} steps/s   "
          f"ratio {rate / GSHARD_STEPS_PER_S:5.2f}; {e.verdict}")


SUMMARY: list = []
PREDICTED: list = []


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [r[0] for r in TABLE1] + ["gshard"]
    chosen = names if args.rows is None else args.rows.split(",")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"--rows must name rows of {names}; got {unknown}", file=sys.stderr)
        return 2
    print(f"Megatron-LM Table 1 planned from shapes ({args.dtype} compute, fp32 master weights and Adam, "
          f"remat {args.remat}, V={VOCAB}, s={SEQ}, micro-batch {MICRO})\n")
    for row in TABLE1:
        if row[0] in chosen:
            plan_row(row, args)
    if "gshard" in chosen:
        plan_gshard(args)
    print(f"{'row':>5} {'ranks':>5} {'cpu s':>7} {'instrs':>6} {'held GiB':>9} {'formula':>8} {'peak GiB':>9} "
          f"{'formula':>8} {'wire GiB':>9} {'formula':>8} {'AR/layer':>8} {'formula':>7}")
    for r in SUMMARY:
        print(f"{r[0]:>5} {r[1]:>5} {r[2]:>7.2f} {r[3]:>6} {r[4] / GIB:>9.1f} {r[5] / GIB:>8.1f} {r[6] / GIB:>9.1f} "
              f"{r[7] / GIB:>8.1f} {r[8] / GIB:>9.1f} {r[9] / GIB:>8.1f} {r[10]:>8.2f} {r[11]:>7}")
    if PREDICTED:
        print(f"\n{'row':>5} {'ranks':>5} {'step s':>8} {'TFLOP/s':>8} {'published':>9} {'ratio':>6}  memory")
        for name, gpus, step, tflops, published, fits in PREDICTED:
            ratio = f"{tflops / published:6.2f}" if published else ""
            print(f"{name:>5} {gpus:>5} {step:8.2f} {tflops:8.0f} {published or '':>9} {ratio:>6}  "
                  f"{'fits' if fits else 'does not fit'}")
    print(f"max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB "
          f"(cpu s: tracing + partitioning, this process's CPU time; wire: all axes per rank per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
