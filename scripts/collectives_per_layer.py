"""Collectives of the partitioned training step, per layer and per step, by kind, mesh axes and bytes.

    python scripts/collectives_per_layer.py                              # megatron on (2, 4), remat none and full
    python scripts/collectives_per_layer.py --preset dp --mesh 2 2 --microbatches 4
    python scripts/collectives_per_layer.py --preset megatron --remat full --all

A collective inside a loop body counts once per trip (``SPMDProgram.comm_summary``'s ``trips``), so the counts are
what one step runs. Per layer = the step of ``--layers`` + 1 layers minus the step of ``--layers`` layers (scanned
or unrolled alike); the rest of the step (embedding, head, loss, the gradient reductions, the update) is the
step of ``--layers`` layers minus ``--layers`` times that. The table marks the collectives of the (b, s, h)
activation on the tensor-parallel axis, which Megatron-LM counts: 4 all-reduces per layer, 6 with full
recompute (Narayanan et al. 2021). Data-parallel gradient traffic with M micro-batches should be once per step.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import numpy as np

import spmd_runtime as sr
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.train import as_preset, build_train_step, train_mesh

CFG = LMConfig(layers=3, d=64, heads=4, ffn=128, vocab=96, seq=16, batch=8)


def step_collectives(program, layers: int = 0) -> tuple[Counter, Counter]:
    """What one execution of ``program`` runs, loop trips counted: (kind, axes, bytes in per rank) -> count, split
    into the collectives of a loop over ``layers`` (the scanned layers: trips a multiple of ``layers``), counted
    per layer, and the rest. ``layers`` 0: all in the rest."""
    layer, rest = Counter(), Counter()
    for c in program.comm_summary():
        key, trips = (c["kind"], c["axes"], c["bytes_in"]), c.get("trips", 1)
        if layers and trips % layers == 0:
            layer[key] += trips // layers
        else:
            rest[key] += trips
    return layer, rest


def step_program(cfg: LMConfig, mesh_shape, preset: str, microbatches: int = 1):
    return build_train_step(cfg, train_mesh(tuple(mesh_shape), preset), preset, sr.SGD(lr=0.1),
                            microbatches=microbatches).program


def per_layer(cfg: LMConfig, mesh_shape, preset: str, microbatches: int = 1) -> tuple[Counter, Counter]:
    """(collectives per layer, collectives of the rest of the step) of ``cfg``'s training step. Scanned layers:
    the layer loops' collectives (``cfg.layers`` must not divide the micro-batch count); unrolled: the step of
    one more layer minus this one's; pipelined (a stage axis): the step of one more layer per stage minus this
    one's, per tick of the pipeline loops (M + S - 1 of them, bubbles included: every stage runs every tick)."""
    stages, ticks = pipeline_ticks(mesh_shape, preset, microbatches)
    if cfg.scanned and not stages:
        if microbatches % cfg.layers == 0:
            raise ValueError(f"per-layer counts of scanned layers need layers not dividing the micro-batches; got "
                             f"layers={cfg.layers}, microbatches={microbatches}")
        return step_collectives(step_program(cfg, mesh_shape, preset, microbatches), cfg.layers)
    if stages:
        return _pipelined_per_layer(cfg, mesh_shape, preset, microbatches, stages, ticks)
    _, base = step_collectives(step_program(cfg, mesh_shape, preset, microbatches))
    _, more = step_collectives(step_program(dataclasses.replace(cfg, layers=cfg.layers + 1), mesh_shape, preset,
                                            microbatches))
    layer = Counter({k: more[k] - base[k] for k in set(more) | set(base) if more[k] != base[k]})
    rest = Counter({k: base[k] - cfg.layers * layer[k] for k in base if base[k] != cfg.layers * layer[k]})
    return layer, rest


def _pipelined_per_layer(cfg: LMConfig, mesh_shape, preset: str, microbatches: int, stages: int, ticks: int):
    """The pipeline's per layer and tick: what S more layers (one per stage) add to its loops, over the ticks. Only
    the loops are compared: the gradient reductions after them grow in bytes with the stacked layers."""
    base, top = loop_collectives(step_program(cfg, mesh_shape, preset, microbatches))
    more, _ = loop_collectives(step_program(dataclasses.replace(cfg, layers=cfg.layers + stages), mesh_shape,
                                            preset, microbatches))
    added = {k: more[k] - base[k] for k in set(more) | set(base) if more[k] != base[k]}
    if any(n % ticks for n in added.values()):
        raise ValueError(f"one more layer per stage should add a multiple of the {ticks} pipeline ticks of each "
                         f"collective; got {added}")
    layer = Counter({k: n // ticks for k, n in added.items()})
    runs = cfg.layers // stages * ticks  # layer runs per stage and step
    rest = Counter({k: base[k] - runs * layer[k] for k in base if base[k] != runs * layer[k]}) + top
    return layer, rest


def loop_collectives(program) -> tuple[Counter, Counter]:
    """(collectives inside loop bodies, trips counted; those outside), by (kind, axes, bytes in per rank)."""
    loops, top = Counter(), Counter()
    for c in program.comm_summary():
        key = (c["kind"], c["axes"], c["bytes_in"])
        if "trips" in c:
            loops[key] += c["trips"]
        else:
            top[key] += 1
    return loops, top


def pipeline_ticks(mesh_shape, preset: str, microbatches: int) -> tuple[int, int]:
    """(stages, ticks of its loops: M + S - 1) of a pipeline preset on this mesh; (0, 1) without a stage axis."""
    p = as_preset(preset).on(train_mesh(tuple(mesh_shape), preset))
    if not p.stage:
        return 0, 1
    stages = train_mesh(tuple(mesh_shape), preset).axis_size(p.stage)
    return stages, microbatches + stages - 1


def activation_bytes(cfg: LMConfig, mesh_shape, preset: str, microbatches: int = 1) -> int:
    """Bytes per rank of one micro-batch's (b, s, h) activation, batch split over "data" where the mesh has it."""
    mesh = train_mesh(tuple(mesh_shape), preset)
    data = mesh.axis_size("data") if "data" in mesh.axis_names else 1
    return cfg.batch // microbatches // data * cfg.seq * cfg.d * np.dtype(cfg.dtype).itemsize


def tensor_parallel_all_reduces(layer: Counter, nbytes: int) -> int:
    """All-reduces of the (b, s, h) activation over the "model" axis among ``layer``'s collectives."""
    return sum(n for (kind, axes, b), n in layer.items() if kind == "all_reduce" and axes == ("model",) and b == nbytes)


def table(counts: Counter, nbytes: int) -> str:
    rows = [f"  {'collective':<16} {'axes':<14} {'bytes in':>10} {'count':>6}"]
    for (kind, axes, b), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        mark = "  <- (b, s, h) activation" if b == nbytes and axes == ("model",) else ""
        rows.append(f"  {kind:<16} {','.join(axes):<14} {b:>10} {n:>6}{mark}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="megatron")
    parser.add_argument("--mesh", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--remat", nargs="+", default=["none", "full"])
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--layers", type=int, default=CFG.layers)
    parser.add_argument("--unrolled", action="store_true", help="layers unrolled instead of one scan")
    parser.add_argument("--all", action="store_true", help="print every collective, not only the summary")
    args = parser.parse_args()
    for remat in args.remat:
        cfg = dataclasses.replace(CFG, layers=args.layers, remat=remat, scan_layers=not args.unrolled)
        layer, rest = per_layer(cfg, args.mesh, args.preset, args.microbatches)
        nbytes = activation_bytes(cfg, args.mesh, args.preset, args.microbatches)
        dp = lambda counts: sum(n for (kind, axes, _), n in counts.items()  # noqa: E731
                                if "data" in axes and kind in ("all_reduce", "reduce_scatter"))
        print(f"# {args.preset} on mesh {tuple(args.mesh)}, remat={remat}, microbatches={args.microbatches}: "
              f"{tensor_parallel_all_reduces(layer, nbytes) / args.microbatches:g} tensor-parallel all-reduces of the "
              f"(b, s, h) activation per layer and micro-batch (Megatron-LM: {6 if remat == 'full' else 4}); data-axis reductions per step: "
              f"{dp(layer)} per layer + {dp(rest)} outside the layers")
        if args.all:
            print("per layer:\n" + table(layer, nbytes))
            print("rest of the step:\n" + table(rest, nbytes))


if __name__ == "__main__":
    main()
