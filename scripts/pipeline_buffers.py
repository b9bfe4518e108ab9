"""The loop buffers of the pipeline preset's partitioned training step, with their shardings and per-rank bytes.

    python scripts/pipeline_buffers.py --stages 32 --microbatches 32 --d 256 --seq 2048 [--preset pipeline_1f1b]

Partitions (never runs) one step of the ``pipeline`` preset on a ("stage",) mesh and lists, per scan (the
forward pipeline loop, the backward loop autodiff builds, the per-stage layer scans inside them): its carries,
its stacked xs operands and stacked ys results, each with its global shape, sharding and bytes per rank; then
the largest per-rank buffers of the whole program. A [iterations, stages, ...] buffer that is not split over
"stage" holds S times its stage's share on every rank (the GPipe backward's output cotangent once did: 8 GiB
at S = M = 32)."""
from __future__ import annotations

import argparse

import numpy as np

import spmd_runtime as sr
from spmd_runtime.optim import AdamW
from spmd_runtime.pipeline import bubble_fraction


def _local_bytes(shape, dtype, sharding, mesh) -> int:
    return int(np.prod(sharding.local_shape(shape, mesh))) * np.dtype(dtype).itemsize


def loop_buffers(program, where: str = "step") -> list[dict]:
    """One dict per loop buffer of ``program`` and its nested bodies: ``where`` (the enclosing loops), ``role``
    ("carry", "xs" or "ys"), global ``shape``, ``sharding`` and per-rank ``bytes`` (a stacked buffer's whole
    [iterations, ...] stack)."""
    out, made = [], {i.out: i for i in program.instrs}
    for k, ins in enumerate(i for i in program.instrs if i.op == "scan"):
        a, body = ins.attrs, ins.attrs["body"]
        nc, nx, length = a["num_carry"], a["num_xs"], a["length"]
        name = f"{where}/scan{k}(length={length}{', reverse' if a['reverse'] else ''})"
        for j, slot in enumerate(ins.args[:nc + nx]):
            src = made[slot]
            out.append({"where": name, "role": "carry" if j < nc else "xs", "shape": src.global_shape,
                        "sharding": src.sharding, "bytes": src.nbytes})
        for o in body.outputs[nc:]:
            out.append({"where": name, "role": "ys", "shape": (length,) + tuple(o.shape),
                        "sharding": sr.Sharding(((),) + o.sharding.dims),
                        "bytes": length * _local_bytes(o.shape, o.dtype, o.sharding, program.mesh)})
        out += loop_buffers(body, name)
    return out


def largest_buffers(program, n: int = 8) -> list:
    """The ``n`` largest per-rank buffers of ``program`` and its bodies' top level: (bytes, op, global shape,
    sharding)."""
    rows = [(i.nbytes, i.op, i.global_shape, i.sharding) for i in program.instrs]
    for i in program.instrs:
        if i.op == "scan":
            rows += [(b.nbytes, b.op, b.global_shape, b.sharding) for b in i.attrs["body"].instrs]
    return sorted(rows, key=lambda r: -r[0])[:n]


def pipeline_step(stages: int, microbatches: int, d: int = 64, seq: int = 16, micro_batch: int = 1,
                  layers: int | None = None, dtype: str = "float32", preset: str = "pipeline", remat: str = "none"):
    cfg = sr.LMConfig(layers=layers or stages, d=d, heads=max(1, d // 64), ffn=4 * d, vocab=64, seq=seq,
                      batch=micro_batch * microbatches, dtype=dtype, remat=remat)
    return sr.build_train_step(cfg, sr.train_mesh((stages,), preset), preset, AdamW(), microbatches=microbatches)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    ap.add_argument("--preset", default="pipeline", choices=("pipeline", "pipeline_1f1b"))
    args = ap.parse_args(argv)
    ts = pipeline_step(args.stages, args.microbatches, args.d, args.seq, args.micro_batch, preset=args.preset,
                       remat=args.remat)
    gib = lambda b: f"{b / 2**20:10.2f} MiB"
    schedule = "1f1b" if args.preset == "pipeline_1f1b" else "gpipe"
    print(f"{args.preset} preset, S={args.stages} M={args.microbatches} d={args.d} seq={args.seq} "
          f"micro-batch={args.micro_batch} remat={args.remat}: loop buffers per rank")
    for b in loop_buffers(ts.program):
        print(f"  {gib(b['bytes'])}  {b['role']:5s} {str(b['shape']):28s} {str(b['sharding']):22s} {b['where']}")
    print("largest buffers per rank:")
    for nbytes, op, shape, sharding in largest_buffers(ts.program):
        print(f"  {gib(nbytes)}  {op:18s} {str(shape):28s} {sharding}")
    print(f"peak bytes per rank: {gib(ts.program.peak_bytes())}")
    print(f"bubble fraction ({schedule}): {bubble_fraction(schedule, args.stages, args.microbatches):.3f}")


if __name__ == "__main__":
    main()
