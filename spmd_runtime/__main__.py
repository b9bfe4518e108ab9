"""Command line: ``python -m spmd_runtime {run,show} PROGRAM ...``, ``calibrate`` (under mpiexec), ``profile DIR``,
``plan`` (a training step from shapes alone) and ``autoshard`` (layouts ranked by their predicted step; with
``--measure`` under mpiexec, the front-runners timed for real: ``sr.autotune``)."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .autoshard import autoshard
from .autoshard_tensors import autoshard_tensors
from .autotune import autotune
from .calibrate import calibrate, hardware_profile, sharing_costs, write_profile
from .checkpoint import load_checkpoint, save_checkpoint
from .comm.agreement import AgreedError, agree, capture
from .comm.communicator import world
from .darray import DArray
from .exec import run as run_program
from .exec import run_local
from .exec.runner import shard
from .exec.backend import to_host
from .hardware import Hardware
from .mesh import Mesh
from .models.lm import LMConfig
from .optim import make_optimizer
from .profile import summarize
from .program import load_program
from .train import run_on_root
from .train.plan import plan_train_step
from .train.presets import PRESETS, train_mesh


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_runtime", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a saved program on every rank (under mpiexec)")
    run.add_argument("program")
    run.add_argument("--inputs", required=True, help=".npz with one array per parameter name, or a sharded "
                     "directory (sr.save_checkpoint) from which each rank reads only its own blocks")
    run.add_argument("--out", required=True, help=".npz written by rank 0 with out0, out1, ..., or a directory: "
                     "each rank writes its own output blocks (sr.save_checkpoint layout)")
    run.add_argument("--backend", default=None, help="numpy | cupy (default: SPMD_BACKEND or auto)")
    run.add_argument("--profile", default=None, help="directory for one Chrome trace per rank")
    show = sub.add_parser("show", help="print a saved program and its comm summary")
    show.add_argument("program")
    prof = sub.add_parser("profile", help="merge the per-rank traces of DIR; print top ops and MPI time per rank")
    prof.add_argument("directory")
    prof.add_argument("--top", type=int, default=10)
    cal = sub.add_parser("calibrate", help="measure alpha/beta of every collective per group size (under mpiexec) "
                                           "and write a cost profile for partition(cost_profile=...)")
    cal.add_argument("--out", default="cost_profile.json", help="profile file rank 0 writes")
    cal.add_argument("--sizes", default="1024,16384,131072,1048576", help="bytes per rank, comma-separated")
    cal.add_argument("--repeats", type=int, default=5)
    cal.add_argument("--hardware", default=None, help="also write a hardware profile of this machine (GEMM FLOP/s, "
                     "memory bandwidth, links inside and between nodes) for program.estimate")
    cal.add_argument("--sharing-only", action="store_true", help="with --hardware FILE (written before): only "
                     "time what ranks sharing cores as this job places them cost (the wait per blocking collective, "
                     "the interpreter's overhead per instruction) and add it to FILE (e.g. mpiexec -n 8 on 2 cores: "
                     "four per core)")
    _plan_parser(sub)
    args = parser.parse_args(argv)
    if args.cmd == "profile":
        print(summarize(args.directory, args.top))
        return 0
    return {"run": _run, "show": _show, "calibrate": _calibrate, "plan": _plan, "autoshard": _autoshard}[args.cmd](args)


def _plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="trace and partition a training step from shapes alone (no parameter is "
                                       "allocated, nothing runs) and print its per-rank memory and traffic")
    plan.add_argument("--preset", default="megatron", choices=sorted(PRESETS))
    plan.add_argument("--mesh", required=True, help="mesh shape, comma-separated (e.g. 64,8,6)")
    plan.add_argument("--axes", default=None, help="mesh axis names, comma-separated (default: the preset's "
                      "train_mesh names: data,model; pipeline: stage,data,model)")
    plan.add_argument("--microbatches", type=int, default=1)
    plan.add_argument("--save", default=None, help="write the partitioned program here (python -m spmd_runtime "
                      "show / run read it)")
    plan.add_argument("--predict", default=None, metavar="HARDWARE", help="also predict the step on a hardware "
                      "profile (a file, or dgx-a100-80gb / dgx-h100 / tpu-v3)")
    _placement_arguments(plan)
    _model_arguments(plan)
    auto = sub.add_parser("autoshard", help="every preset on every mesh shape of --devices, predicted on a hardware "
                                            "profile, pruned by memory and ranked (nothing runs)")
    auto.add_argument("--devices", type=int, required=True)
    auto.add_argument("--hardware", required=True, help="a profile file, or dgx-a100-80gb / dgx-h100 / tpu-v3")
    auto.add_argument("--presets", default=None, help="comma-separated (default: every preset that fits the model)")
    auto.add_argument("--microbatches", default=None, help="micro-batch counts to try, comma-separated (default: "
                      "1, 2, 4, ... until a layout fits; a pipeline's until more stop being faster)")
    auto.add_argument("--remats", default=None, help="remat policies to try, comma-separated (default: --remat's)")
    auto.add_argument("--exhaustive", action="store_true", help="build every candidate at full size (default: "
                      "a branch and bound skips those a bound says cannot beat the best)")
    auto.add_argument("--per-tensor", action="store_true", help="then search per-parameter shardings on the best "
                      "layout's mesh (sr.autoshard_tensors) and print its moves against the best preset")
    auto.add_argument("--budget", type=int, default=150, help="--per-tensor: layouts evaluated at most")
    auto.add_argument("--measure", type=int, default=0, metavar="ROUNDS", help="then time the best-predicted layout "
                      "of each preset for real, in this many interleaved rounds (sr.autotune; run under mpiexec -n "
                      "--devices), and print them fastest measured first")
    _placement_arguments(auto)
    _model_arguments(auto)


def _placement_arguments(parser) -> None:
    parser.add_argument("--ranks-per-node", type=int, default=None, help="the job's ranks on each node (default: "
                        "the profile's node.ranks; e.g. 8 for 8 ranks on this 2-core machine)")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="with --ranks-per-node: BLAS threads each")


def _hardware(args, name):
    """The profile ``name`` with the job's placement when --ranks-per-node is given (hardware.with_placement)."""
    if name is None or args.ranks_per_node is None:
        return name
    return Hardware.load(name).with_placement(args.ranks_per_node, args.threads_per_rank)


def _model_arguments(parser) -> None:
    """The model config's options, shared by ``plan`` and ``autoshard``."""
    for name, default in (("layers", 2), ("d", 256), ("heads", 8), ("ffn", None), ("vocab", 51200),
                          ("seq", 2048), ("batch", 8), ("experts", 0), ("moe-every", 0), ("head-dim", None)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--ffn-kind", default="gelu", help="gelu | geglu | swiglu")
    parser.add_argument("--bias", action="store_true", help="biases on every projection (GPT-2, Megatron)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (master weights and state: float32)")
    parser.add_argument("--remat", default="none", help="none | full | dots | full_save_all_to_all (MoE: the "
                        "all-to-alls' results saved)")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="the layers as one scan (default: dense models; MoE ones in groups of --moe-every)")
    parser.add_argument("--optimizer", default="adamw", help="adamw | sgd | adafactor")
    parser.add_argument("--tied", action="store_true", help="output layer tied to the embedding")


def _config(args) -> LMConfig:
    return LMConfig(layers=args.layers, d=args.d, heads=args.heads, ffn=args.ffn or 4 * args.d, vocab=args.vocab,
                    seq=args.seq, batch=args.batch, dtype=args.dtype, remat=args.remat, tied=args.tied,
                    experts=args.experts, moe_every=args.moe_every, head_dim=args.head_dim, bias=args.bias,
                    ffn_kind=args.ffn_kind, scan_layers=args.scan_layers)


def _plan(args) -> int:
    try:
        shape = tuple(int(s) for s in args.mesh.split(","))
        mesh = train_mesh(shape, args.preset) if args.axes is None else Mesh(shape, tuple(args.axes.split(",")))
        plan = plan_train_step(_config(args), mesh, args.preset, make_optimizer(args.optimizer), args.microbatches)
        estimate = plan.step.program.estimate(_hardware(args, args.predict)) if args.predict else None
    except ValueError as e:
        print(f"spmd_runtime plan: {e}", file=sys.stderr, flush=True)
        return 2
    print(plan.format())
    if estimate is not None:
        print(estimate)
    if args.save:
        plan.step.program.save(args.save)
        print(f"wrote the program to {args.save}")
    return 0


def _autoshard(args) -> int:
    try:
        optimizer = make_optimizer(args.optimizer)
        hardware = _hardware(args, args.hardware)
        comm = world() if args.measure else None
        search = lambda: autoshard(_config(args), args.devices, hardware, optimizer=optimizer,  # noqa: E731
                                   presets=args.presets.split(",") if args.presets else None,
                                   microbatches=tuple(int(m) for m in args.microbatches.split(","))
                                   if args.microbatches else None,
                                   remats=tuple(args.remats.split(",")) if args.remats else None,
                                   prune=not args.exhaustive)
        # measured: rank 0 searches (the others sleep), every rank times the same front-runners
        found = comm.bcast(run_on_root(comm, search, "autoshard's search"), root=0) if comm else search()
        if comm:
            autotune(found, _config(args), comm, optimizer=optimizer, rounds=args.measure)
        if args.per_tensor:
            autoshard_tensors(_config(args), args.devices, hardware, start=found[0], optimizer=optimizer,
                              budget=args.budget)
    except ValueError as e:
        print(f"spmd_runtime autoshard: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def _calibrate(args) -> int:
    try:  # the same command line on every rank: every rank refuses it alike, before any collective
        sizes = tuple(int(s) for s in args.sizes.split(","))
        if min(sizes) < 1 or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"spmd_runtime calibrate: --sizes must be positive byte counts (comma-separated) and --repeats >= 1; "
              f"got --sizes {args.sizes!r} --repeats {args.repeats}", file=sys.stderr, flush=True)
        return 2
    comm = world()
    if args.sharing_only:
        return _calibrate_sharing(args, comm)
    doc = calibrate(comm, sizes, args.repeats)
    if comm.Get_rank() == 0:
        write_profile(doc, args.out)
        for f in doc["fits"]:
            print(f"{f['op']:<19} k={f['k']:<3} alpha={f['alpha'] * 1e6:9.2f} us  beta={f['beta'] * 1e9:8.3f} ns/B")
        print(f"wrote {args.out} (use partition(..., cost_profile=...) or SPMD_COST_PROFILE={args.out})")
    if args.hardware:
        hardware = hardware_profile(doc, comm, args.repeats)
        if comm.Get_rank() == 0:
            hardware.save(args.hardware)
            print(f"wrote {args.hardware}: {hardware}, FLOP/s {dict(hardware.flops)}, memory "
                  f"{hardware.memory_bandwidth / 1e9:.1f} GB/s, per instruction {hardware.overhead_s * 1e6:.1f} us, "
                  f"inside a node {hardware.intra}, between nodes {hardware.inter} (use program.estimate(path))")
    return 0


def _calibrate_sharing(args, comm) -> int:
    """``calibrate --sharing-only``: what sharing cores costs as placed, added to an existing profile. Rank 0 reads
    the profile before anything is timed and every rank gets its verdict, so a file only rank 0 can see (or not
    see) fails every rank alike, before any collective of the timing."""
    if comm.Get_size() < 2:
        print("spmd_runtime calibrate: --sharing-only times ranks that share cores: run it under mpiexec -n 2 or more; "
              "got 1 rank", file=sys.stderr, flush=True)
        return 2
    hardware, error = capture(lambda: _existing_profile(args.hardware), describe=str) if comm.Get_rank() == 0 else (None, None)
    error = comm.bcast(error, root=0)
    if error:
        print(f"spmd_runtime calibrate: {error}", file=sys.stderr, flush=True)
        return 2
    per_core, slice_s, overhead = sharing_costs(comm, args.repeats)
    if comm.Get_rank() == 0:
        hardware = hardware.with_sharing(per_core, slice_s, overhead)
        hardware.save(args.hardware)
        per_instruction = "" if overhead is None else f", {overhead * 1e6:.1f} us per instruction"
        slices = ", ".join(f"{s * 1e3:.3f} ms after {since * 1e3:.2f} ms" for since, s in slice_s)
        print(f"wrote {args.hardware}: at {per_core:g} ranks per core slice_s {slices} of compute{per_instruction}; "
              f"measured at {', '.join(f'{q:g}' for q, _ in hardware.slices)} ranks per core")
    return 0


def _existing_profile(path) -> Hardware:
    if not path or not os.path.exists(path):
        raise ValueError(f"calibrate --sharing-only adds to a hardware profile written before (calibrate --hardware "
                         f"FILE); got --hardware {path!r}, which is not a file")
    return Hardware.load(path)


def _show(args) -> int:
    program = load_program(args.program)
    print(program)
    print(format_comm_summary(program))
    return 0


def _run(args) -> int:
    comm = world()
    if os.path.isdir(args.inputs):
        return _run_sharded(args, comm)
    loaded, error = capture(_load, args, describe=_load_error)  # agreed on below, so every rank reports it
    try:
        agree(comm, error, "python -m spmd_runtime run")
        program, inputs = loaded
        outs = run_program(program, *inputs, comm=comm, backend=args.backend, profile=args.profile)
    except AgreedError as e:  # raised alike on every rank: each prints the same line, the job exits 1
        print(f"spmd_runtime: rank {comm.Get_rank()}: {e}", file=sys.stderr, flush=True)
        return 1
    if not args.out.endswith(".npz"):
        return _save_blocks(program, [shard(o, s.sharding, program.mesh, comm.Get_rank())
                                      for o, s in zip(outs, program.outputs)], args.out, comm)
    if comm.Get_rank() == 0:
        np.savez(args.out, **{f"out{i}": to_host(o) for i, o in enumerate(outs)})
        print(f"wrote {len(outs)} outputs to {args.out}")
    return 0


def _load(args):
    """(program, inputs in program order) from the files named on the command line."""
    program = load_program(args.program)
    with np.load(args.inputs, allow_pickle=False) as data:
        missing = [i.name for i in program.inputs if i.name not in data]
        if missing:
            raise KeyError(f"--inputs needs one array per program input {[i.name for i in program.inputs]}; "
                           f"got keys {sorted(data.keys())}, missing {missing}")
        return program, [data[i.name] for i in program.inputs]


def _load_error(e: Exception) -> str:
    reason = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) adds quotes
    return f"could not load the program or inputs: {type(e).__name__}: {reason}"


def _run_sharded(args, comm) -> int:
    """Inputs from a sharded directory: each rank memory-maps only its own blocks; nothing global is built
    unless --out is an .npz (every rank then gathers the outputs and rank 0 writes them)."""
    program, error = capture(load_program, args.program,  # agreed on below, so every rank reports it
                             describe=lambda e: f"could not load the program: {type(e).__name__}: {e}")
    try:
        agree(comm, error, "python -m spmd_runtime run")
        blocks = load_checkpoint(args.inputs, program.mesh, {i.name: i.sharding for i in program.inputs}, comm=comm)
        missing = [i.name for i in program.inputs if i.name not in blocks]
        agree(comm, f"--inputs needs one tensor per program input {[i.name for i in program.inputs]}; got "
                    f"{sorted(blocks)}, missing {missing}" if missing else None, "python -m spmd_runtime run")
        outs = run_local(program, *[blocks[i.name] for i in program.inputs], comm=comm, backend=args.backend,
                         profile=args.profile)
    except AgreedError as e:
        print(f"spmd_runtime: rank {comm.Get_rank()}: {e}", file=sys.stderr, flush=True)
        return 1
    if not args.out.endswith(".npz"):
        return _save_blocks(program, outs, args.out, comm)
    full = [DArray(o, s.shape, s.dtype, program.mesh, s.sharding, comm).gather() for o, s in zip(outs, program.outputs)]
    if comm.Get_rank() == 0:
        np.savez(args.out, **{f"out{i}": to_host(o) for i, o in enumerate(full)})
        print(f"wrote {len(full)} outputs to {args.out}")
    return 0


def _save_blocks(program, blocks, directory, comm) -> int:
    save_checkpoint(directory, {f"out{i}": to_host(b) for i, b in enumerate(blocks)}, program, comm=comm)
    if comm.Get_rank() == 0:
        print(f"wrote {len(blocks)} sharded outputs to {directory}")
    return 0


def format_comm_summary(program) -> str:
    rows = [f"{'#':>3} {'collective':<19} {'axes':<14} {'k':>3} {'bytes in':>12} {'bytes out':>12} {'wire bytes':>12}"
            f" {'predicted us':>12}"]
    for i, c in enumerate(program.comm_summary()):
        rows.append(f"{i:>3} {c['kind']:<19} {','.join(c['axes']):<14} {c['group_size']:>3} {c['bytes_in']:>12} "
                    f"{c['bytes_out']:>12} {c['wire_bytes']:>12.0f} {c['predicted_s'] * 1e6:>12.1f}")
    rows.append(f"    total wire bytes per rank: {program.wire_bytes:.0f}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
