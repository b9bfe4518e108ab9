"""The SPMD partitioner: Graph + mesh + a few annotations -> one SPMDProgram.

For each node in order: its partition rule brings the operands into shardings it
can use locally (through the resharding planner), emits the local op, and the
driver reshards the result to the node's propagated sharding.
"""
from __future__ import annotations

import gc
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..cost import resolve_model, using
from ..graph import Graph, Node
from ..mesh import Mesh
from ..opdef import OPS, fresh_result, lookup
from ..comm.simulated import is_lead_rank
from ..graph import MESH_SPLIT, PARAMETER
from ..ops.control import LOOP_OUT, SCAN, WHILE
from ..ops.spmd import ALL_TO_ALLV, COLLECTIVE_PERMUTE, MASK_PADDING, SHARD_INDEX, SHARD_SLICE
from ..program import Instr, IOSpec, ShardingReport, SPMDProgram
from ..sharding import Sharding, parse_spec_free
from .fusion import fuse_elementwise, fusion_enabled
from .pending_sums import (accumulated, deferrable, holds_pending_sum, keep_sums_pending, pending_layout,
                           use_counts, waiting_chains)
from .propagation import propagate, refine_free
from .scan_accumulate import accumulate_in_scans
from .windowed import OFF, windowed_threshold, windowing
from .regather import regather_enabled, regathered
from .schedule import overlap_budget as _budget, overlap_enabled, schedule_collectives
from .resharding import plan_cost, plan_reshard
from .rules.table import PARTITION

@dataclass(frozen=True, slots=True)
class LocalValue:
    slot: int
    sharding: Sharding
    shape: tuple[int, ...]  # global
    dtype: str


class PartitionContext:
    def __init__(self, graph: Graph, mesh: Mesh, shardings: dict[int, Sharding]):
        self.graph, self.mesh, self.shardings = graph, mesh, shardings
        self.values: dict[int, LocalValue] = {}
        self.instrs: list[Instr] = []
        self.notes: list[str] = []
        self.note_nodes: list[int] = []  # the node each note is about: its notes go if its work is dropped
        self.node: Node | None = None  # the node being partitioned, named in notes
        self._reshard_cache: dict = {}
        self._shared: dict = {}
        self._local_shapes: dict = {}  # (sharding, global shape) -> local shape
        # partition/loops.py: the graph's live nodes (computed once, on the first scan), and per scan node the
        # position of each traced result among the results it kept (a loop_out reads its result there)
        self.live_nodes: set | None = None
        self.result_positions: dict[int, dict[int, int]] = {}
        self.pending_results: dict[int, set] = {}  # scan node -> its results that may come out pending sums

    def sharding(self, node_id: int) -> Sharding:
        return self.shardings[node_id]

    def value(self, node_id: int) -> LocalValue:
        return self.values[node_id]

    def emit(self, op, args, attrs, sharding: Sharding, shape, dtype, local=None) -> LocalValue:
        """Append one instruction of ``op`` (a record or its name); its local shape is the sharding's unless
        ``local`` says otherwise."""
        out = LocalValue(len(self.instrs), sharding, tuple(shape), str(dtype))
        if local is None:  # the same few (sharding, shape) pairs recur throughout a model
            local = self._local_shapes.get((sharding, out.shape))
            if local is None:
                local = self._local_shapes[sharding, out.shape] = sharding.local_shape(out.shape, self.mesh)
        else:
            local = tuple(local)
        name = op if type(op) is str and op in OPS else lookup(op).name
        self.instrs.append(Instr(name, out.slot, tuple(a.slot for a in args), dict(attrs), local, out.dtype,
                                 sharding, out.shape, source=None if self.node is None else self.node.source))
        return out

    def emit_like(self, node: Node, op, args, attrs, sharding: Sharding) -> LocalValue:
        return self.emit(op, args, attrs, sharding, node.shape, node.dtype)

    def mask_padding(self, value: LocalValue, dims, fill) -> LocalValue:
        """``value`` with the padding of its unevenly split ``dims`` set to ``fill`` (the identity of the
        reduction or contraction about to read them)."""
        for d in dims:
            axes = value.sharding.dims[d]
            if axes and not value.sharding.is_even(value.shape, self.mesh, d):
                value = self.emit(MASK_PADDING, [value], {"dim": d, "axes": axes, "size": value.shape[d],
                                                          "fill": fill}, value.sharding, value.shape, value.dtype)
        return value

    def shared(self, key, build):
        """``build()`` once per ``key``: work that sibling nodes share (e.g. top_k's values and indices)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def local_shape(self, value: LocalValue) -> list[int]:
        """The shape of ``value``'s buffer on every rank, as emitted."""
        return list(self.instrs[value.slot].shape)

    def shard_index(self, axes) -> LocalValue:
        """A 0-d int64 value: this rank's shard number along ``axes`` (its block offset / block size)."""
        return self.emit(SHARD_INDEX, [], {"axes": tuple(axes)}, Sharding(()), (), "int64")

    def cost(self, value: LocalValue, target: Sharding) -> float:
        return plan_cost(value.sharding, target, value.shape, value.dtype, self.mesh)

    def has_resharded(self, value: LocalValue, target: Sharding) -> bool:
        """Whether ``value`` laid out as ``target`` exists already (another user asked for it)."""
        return (value.slot, target) in self._reshard_cache

    def remember_reshard(self, value: LocalValue, target: Sharding, laid_out: LocalValue) -> None:
        """``laid_out`` is ``value`` as ``target``, made by a rule itself (a windowed einsum's ring): later
        reshards of ``value`` to ``target`` take it."""
        self._reshard_cache.setdefault((value.slot, target), laid_out)

    def reshard(self, value: LocalValue, target: Sharding) -> LocalValue:
        """``value`` laid out as ``target``, via the one planner; each (value, target) planned once."""
        if value.sharding is target or value.sharding == target:
            return value
        key = (value.slot, target)
        if key not in self._reshard_cache:
            plan = plan_reshard(value.sharding, target, value.shape, self.mesh, np.dtype(value.dtype).itemsize)
            where = f"at {_describe(self.graph, self.node)}: " if self.node is not None else ""
            self.notes += [where + n for n in plan.notes]
            cur = value
            for step in plan.steps:
                if _moves_nothing(step, self.mesh):  # over size-1 axes: same data, new label
                    cur = LocalValue(cur.slot, step.result, cur.shape, cur.dtype)
                    continue
                cur = self.emit(step.op, [cur], step.attrs, step.result, value.shape, value.dtype, step.local)
            self._reshard_cache[key] = cur
        return self._reshard_cache[key]


def _moves_nothing(step, mesh: Mesh) -> bool:
    """A collective or slice over mesh axes of size 1 leaves every local buffer as it is."""
    return (lookup(step.op).collective or step.op == SHARD_SLICE.name) and \
        step.op not in (COLLECTIVE_PERMUTE.name, ALL_TO_ALLV.name) and \
        mesh.axis_size(step.attrs["axes"]) == 1


def partition(graph: Graph, mesh: Mesh, in_specs=None, out_specs=None, fuse: bool | None = None,
              cost_profile=None, overlap: bool | None = None, overlap_budget: int | None = None,
              timings: dict | None = None, windowed_einsum: int | None = None, donate=(),
              pending=(), regather: bool = True) -> SPMDProgram:
    """Partition ``graph`` over ``mesh`` into one SPMD program.

    ``in_specs`` / ``out_specs``: one ``mesh_split``-style spec per graph
    input / output (None entries, or None altogether, leave it to propagation).
    An out spec that disagrees with a value's own annotation reshards at the output.
    ``fuse``: fuse elementwise chains into ``fusion`` instructions (``partition/fusion.py``); None (default)
    fuses unless ``$SPMD_FUSE`` is 0.
    ``overlap``: split collectives into start/done pairs scheduled around the compute (``partition/schedule.py``);
    None (default) splits unless ``$SPMD_ASYNC`` is 0. ``overlap_budget``: bytes of receive buffers in flight
    at once (default ``$SPMD_ASYNC_BUDGET``, else 64 MiB).
    ``cost_profile``: a profile file from ``python -m spmd_runtime calibrate`` (or a ``CostModel``) that prices
    the collectives when choosing strategies and resharding plans; default: $SPMD_COST_PROFILE, else the
    ring-formula wire bytes.
    ``windowed_einsum``: bytes from which an all-gather before an einsum, or a reduce-scatter after it, may
    become a ring of collective_permutes overlapped with the einsum's steps where the cost model says it pays
    (``partition/windowed.py``); None (default): ``$SPMD_WINDOWED_EINSUM``, else off.
    ``donate``: input positions (or input names) whose buffers the program may overwrite, as JAX's
    ``donate_argnums``: an update such as AdamW's then writes the new parameter into the old one's buffer
    instead of a fresh one (``sr.run_local`` hands it the caller's arrays: do not read a donated array after
    the run; ``sr.run`` donates copies of its shards).
    ``pending``: output positions the caller takes as pending sums where they are (an enclosing loop's body:
    partition/loops.py): such an output comes out partial when its sum is pending, and an accumulator among them
    (output k = input k + a pending sum) takes input k partial too (``pending_sums``).
    ``regather``: a weight gathered from an input and read again much later (its backward pass) is gathered again
    there instead of kept whole (``partition/regather.py``; ``$SPMD_REGATHER=0`` turns it off); a loop body's
    partition passes False (its gathers already run once per iteration).
    ``timings``: a dict that receives, for benchmarks, the seconds of each pass run (``partition``: propagation,
    partition rules, resharding; ``fuse`` and ``schedule``, each with frees and donations) and the instructions
    it left (``<pass>_instrs``).
    """
    laps = _Laps(timings)
    with _gc_paused():
        model = resolve_model(cost_profile)
        fusing = fusion_enabled(fuse)
        windows = windowed_threshold(windowed_einsum) if overlap_enabled(overlap) else OFF  # nothing would hide
        with using(model), windowing(windows):  # frees and donations are left to the fusion pass, which redoes them anyway
            program = _partition(graph, mesh, in_specs, out_specs, buffers=not fusing, pending=pending)
        laps.lap("partition", program)
        if fusing:
            fused = fused_program(program)
            if fused is program:  # nothing fused
                assign_buffers(program.instrs, {o.slot for o in program.outputs})
            program = fused
            laps.lap("fuse", program)
        if regather and regather_enabled():
            program = regathered_program(program)
        if overlap_enabled(overlap):
            program = scheduled_program(program, _budget(overlap_budget))
            laps.lap("schedule", program)
        if donate:
            program = donated_program(program, donate)
        program = accumulate_in_scans(program, assign_buffers)
    program.cost_model = model
    return program


class _Laps:
    """Seconds per pass, and the instructions it left, into ``timings`` (when given)."""

    def __init__(self, timings: dict | None):
        self.timings, self.t = timings, time.perf_counter()

    def lap(self, name: str, program: SPMDProgram) -> None:
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[name], self.timings[f"{name}_instrs"], self.t = now - self.t, len(program.instrs), now


@contextmanager
def _gc_paused():
    """CPython's cycle collector off while partitioning. The passes allocate a dozen short-lived objects per
    instruction, almost none in cycles (reference counting frees them), and every full collection re-scans the
    whole live heap (graph, program so far): that made partitioning super-linear in the program's size (a
    third of the time at 64 layers). Collection resumes as usual afterwards."""
    if not gc.isenabled():  # nested (a loop body's partition) or turned off by the caller
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _partition(graph, mesh, in_specs, out_specs, buffers: bool = True, pending=()) -> SPMDProgram:
    """The partitioned program; ``buffers``: with its frees and donations (else left for a later pass);
    ``pending``: as ``partition``'s."""
    free: dict[int, tuple[int, ...]] = {}  # value -> dims its in/out spec leaves UNCONSTRAINED
    fixed = user_shardings(graph, mesh, in_specs, free)
    out_specs = _output_shardings(graph, mesh, out_specs, fixed, free)
    prop = propagate(graph, mesh, fixed, free=free)
    out_targets = {k: refine_free(s, dims, prop.shardings[graph.outputs[k]]) if dims else s
                   for k, (s, dims) in out_specs.items()}
    keep_sums_pending(graph, prop.shardings, fixed)
    ctx = PartitionContext(graph, mesh, prop.shardings)
    live = live_nodes(graph)
    waits = deferrable(graph, live)
    uses = use_counts(graph) if pending else {}
    sums = accumulated(graph, pending, uses)  # output position -> the pending sum added to its input
    adds = {graph.outputs[k]: (graph.params[k], g) for k, g in sums.items()}
    outs = [graph.outputs[k] for k in pending if k < len(graph.outputs) and uses.get(graph.outputs[k]) == 1]
    passes, ctx.pending_results = waiting_chains(graph, [sums.get(k, graph.outputs[k]) for k in pending], uses)
    waits |= {graph[m].inputs[0] for m in passes} | set(outs)
    for node in graph.nodes:
        if node.id in live:
            ctx.node, before = node, len(ctx.notes)
            if node.id in passes and holds_pending_sum(ctx.value(node.inputs[0]).sharding):
                ctx.values[node.id] = ctx.value(node.inputs[0])  # the annotation holds where the sum completes
                continue
            if node.id in adds:
                _accumulate_pending(ctx, *adds[node.id])
            ctx.values[node.id] = _partition_and_complete(ctx, node, node.id in waits)
            if len(ctx.notes) > before:
                _name_notes(ctx, node, before)
                ctx.note_nodes += [node.id] * (len(ctx.notes) - before)
    ctx.node = None
    kept = {graph.outputs[k]: k for k in pending if graph.outputs[k] in outs}
    outputs = [ctx.value(o) if kept.get(o) == k and holds_pending_sum(ctx.value(o).sharding) else
               ctx.reshard(ctx.value(o), out_targets.get(k, prop.shardings[o])) for k, o in enumerate(graph.outputs)]
    return _finish(ctx, graph, prop, outputs, buffers)


def _accumulate_pending(ctx: PartitionContext, param: int, summand: int) -> None:
    """An accumulator ``param + summand`` whose summand holds a pending sum: the parameter (read only there) is
    laid out as that pending sum instead, so the sum stays pending across iterations (its loop completes it
    after the last)."""
    acc, g = ctx.value(param), ctx.value(summand)
    if not holds_pending_sum(g.sharding) or acc.sharding.partial:
        return
    ins = ctx.instrs[acc.slot]
    ctx.instrs[acc.slot] = ins.copy(shape=tuple(ctx.local_shape(g)), sharding=g.sharding)
    ctx.values[param] = LocalValue(acc.slot, g.sharding, acc.shape, acc.dtype)


def _partition_and_complete(ctx: PartitionContext, node: Node, may_wait: bool) -> LocalValue:
    """``node`` partitioned and laid out as its propagated sharding, except for the pending sums it may keep
    (``pending_sums``): an op linear in operands that hold pending sums over the same axes adds them pending,
    and a value whose one user can take its sum over leaves it pending (that user completes it, or passes it
    on). A result whose propagated sharding is partial itself is left to the rules (``keep_sums_pending``)."""
    target = ctx.shardings[node.id]
    wants_final = isinstance(target, Sharding) and not target.partial
    operands = [ctx.value(i) for i in node.inputs]
    pending = pending_layout(node.op, node.attrs, [x.sharding for x in operands],
                             (operands[0].shape, node.shape) if operands else None, ctx.mesh) if wants_final else None
    if pending is None:
        value = _partition_node(ctx, node)
        target = ctx.shardings[node.id]  # a control node's rule sets its results' shardings
    else:
        ctx.shardings[node.id] = pending  # what the rule reads as its target
        try:
            value = _partition_node(ctx, node)
        finally:
            ctx.shardings[node.id] = target
    if may_wait and wants_final and holds_pending_sum(value.sharding):
        return value
    return ctx.reshard(value, target)


def fused_program(program: SPMDProgram) -> SPMDProgram:
    """``program`` with its elementwise chains fused (partition/fusion.py), frees and donations redone."""
    fused = fuse_elementwise(program)
    if fused is None:
        return program
    instrs, inputs, outputs = fused
    assign_buffers(instrs, {o.slot for o in outputs})
    slots = {i.out for i in instrs}
    return SPMDProgram(program.mesh, instrs, inputs, outputs, list(program.notes), program.report, program.in_tree,
                       program.out_tree, {s: n for s, n in program.names.items() if s in slots})


def donated_program(program: SPMDProgram, donate) -> SPMDProgram:
    """``program`` with the inputs ``donate`` names (positions or names) marked donated on their parameter
    instructions, and its donations redone: an op may now write into a donated input's buffer where that
    input dies, in preference to an intermediate's (which could then never be planned: exec/buffers.py)."""
    names = {io.name: k for k, io in enumerate(program.inputs)}
    positions = set()
    for d in ([donate] if isinstance(donate, (str, int, np.integer)) else donate):
        k = names.get(d, d) if isinstance(d, str) else d
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k < len(program.inputs):
            raise ValueError(f"donate takes input positions in [0, {len(program.inputs)}) or input names "
                             f"{sorted(names)[:8]}{' ...' if len(names) > 8 else ''}; got {d!r}")
        positions.add(int(k))
    for ins in program.instrs:
        if ins.op == PARAMETER.name and ins.attrs["index"] in positions:
            ins.attrs = {**ins.attrs, "donated": True}
    program.__dict__.pop("_donated", None)  # SPMDProgram.donated's cache, if read before
    assign_buffers(program.instrs, {o.slot for o in program.outputs})
    return program


def regathered_program(program: SPMDProgram) -> SPMDProgram:
    """``program`` with weights gathered again for their late readers (partition/regather.py), frees and
    donations redone."""
    done = regathered(program.instrs)
    if done is None:
        return program
    instrs, new, not_before = done
    outputs = [o.at(new[o.slot]) for o in program.outputs]
    assign_buffers(instrs, {o.slot for o in outputs})
    program = SPMDProgram(program.mesh, instrs, [i.at(new[i.slot]) for i in program.inputs], outputs,
                          list(program.notes), program.report, program.in_tree, program.out_tree,
                          {new[s]: n for s, n in program.names.items() if s in new})
    program.__dict__["not_before"] = not_before  # read by the scheduler, which runs next
    return program


def scheduled_program(program: SPMDProgram, budget: int) -> SPMDProgram:
    """``program`` with its collectives split into start/done pairs (partition/schedule.py), frees and donations
    redone; an all-reduce whose operand dies at its done reduces into it (``MPI.IN_PLACE``)."""
    scheduled = schedule_collectives(program, budget)
    if scheduled is None:
        return program
    instrs, inputs, outputs, names, in_place = scheduled
    assign_buffers(instrs, {o.slot for o in outputs})
    for slot in in_place:
        done = instrs[slot]
        if done.args[1] in done.free:
            done.donate = 1
    return SPMDProgram(program.mesh, instrs, inputs, outputs, list(program.notes), program.report, program.in_tree,
                       program.out_tree, names)


def _parse_io(graph, spec, mesh, vid, what, k) -> tuple[Sharding, tuple[int, ...]]:
    """An in/out spec as a Sharding (UNCONSTRAINED dims replicated there) and its UNCONSTRAINED dims."""
    return parse_spec_free(spec, mesh, len(graph[vid].shape), f"{what} {k}")


def _name_notes(ctx: PartitionContext, node: Node, before: int) -> None:
    """Prefix the notes a rule just wrote with where they arose, in the user's names when there are any."""
    if any(ctx.graph.name_of(i) for i in (node.id, *node.inputs)):
        ctx.notes[before:] = [n if n.startswith("at ") else f"at {_describe(ctx.graph, node)}: {n}"
                              for n in ctx.notes[before:]]


def _partition_node(ctx: PartitionContext, node: Node) -> LocalValue:
    fn = PARTITION.get(node.op) if node.op in OPS else None
    if fn is None:
        shardings = [str(ctx.value(i).sharding) for i in node.inputs]
        raise NotImplementedError(f"every op needs a partition rule; got none for op {node.op!r} "
                                  f"(%{node.id}, operand shardings {shardings})")
    return fn(ctx, node)


def user_shardings(graph, mesh, in_specs, free=None) -> dict[int, Sharding]:
    """value -> the user's sharding (in_specs and mesh_split annotations); ``free`` collects the dims of in_specs
    left UNCONSTRAINED (a mesh_split node keeps its own in its ``unconstrained`` attribute)."""
    fixed: dict[int, Sharding] = {}
    for k, (vid, spec) in enumerate(zip(graph.params, _specs(in_specs, graph.params, "input"))):
        if spec is not None:
            sharding, dims = _parse_io(graph, spec, mesh, vid, "input", k)
            _fix(fixed, vid, sharding, graph, mesh)
            if dims and free is not None:
                free[vid] = dims
    for node in graph.nodes:
        if node.op == MESH_SPLIT.name:
            if node.attrs["mesh"] != mesh:
                raise ValueError(f"mesh_split annotations must use the partition mesh {mesh}; got "
                                 f"{node.attrs['mesh']} at %{node.id}")
            _fix(fixed, node.id, node.attrs["sharding"], graph, mesh)
    return fixed


def _output_shardings(graph, mesh, out_specs, fixed, free) -> dict[int, tuple[Sharding, tuple[int, ...]]]:
    """Out specs by output position (sharding, UNCONSTRAINED dims); each also annotates its value unless the
    user already did, leaving those dims free for propagation. The output then takes the spec's pinned dims
    and the propagated value's free ones."""
    targets = {}
    for k, (vid, spec) in enumerate(zip(graph.outputs, _specs(out_specs, graph.outputs, "output"))):
        if spec is not None:
            sharding, dims = targets[k] = _parse_io(graph, spec, mesh, vid, "output", k)
            _check(sharding, mesh, graph, vid)
            if vid not in fixed:
                fixed[vid] = sharding
                if dims:
                    free[vid] = dims
    return targets


def _specs(specs, ids, what):
    if specs is None:
        return [None] * len(ids)
    if len(specs) != len(ids):
        raise ValueError(f"{what} specs need one entry per graph {what} ({len(ids)}); got {len(specs)}")
    return list(specs)


def _check(sharding: Sharding, mesh: Mesh, graph: Graph, vid: int) -> None:
    """``sharding.check`` for value ``vid``, described in the message it raises (described only then)."""
    shape = graph[vid].shape
    sharding.check(mesh, shape, what=_describe(graph, graph[vid]) if len(sharding.dims) != len(shape) else "")


def _fix(fixed, vid, sharding, graph, mesh):
    _check(sharding, mesh, graph, vid)
    if fixed.setdefault(vid, sharding) != sharding:
        raise ValueError(f"a value takes one user sharding; got {fixed[vid]} and {sharding} for "
                         f"{_describe(graph, graph[vid])}")


def _describe(graph: Graph, node: Node) -> str:
    """``tensor %7 ('h') = einsum float32[8, 4] of %2 ('x'), %5 ('w1')``: the user's names where known."""
    label = lambda i: f"%{i}" + (f" ({graph.name_of(i)!r})" if graph.name_of(i) else "")  # noqa: E731
    named = [label(i) for i in node.inputs if graph.name_of(i)]
    return f"tensor {label(node.id)} = {node.op} {node.spec}" + (f" of {', '.join(named)}" if named else "")


def live_nodes(graph: Graph) -> set[int]:
    live, stack = set(), list(graph.outputs)
    while stack:
        v = stack.pop()
        if v not in live:
            live.add(v)
            stack += graph[v].inputs
    return live | set(graph.params)


def _finish(ctx: PartitionContext, graph: Graph, prop, results: list[LocalValue], buffers: bool) -> SPMDProgram:
    mesh, names = ctx.mesh, graph.param_names
    inputs = [IOSpec(n, ctx.value(p).slot, graph[p].shape, graph[p].dtype, ctx.value(p).sharding)
              for n, p in zip(names, graph.params)]
    outputs = [IOSpec(f"out{k}", r.slot, r.shape, r.dtype, r.sharding) for k, r in enumerate(results)]
    instrs, renumber = _drop_dead(ctx.instrs, [o.slot for o in outputs] + [i.slot for i in inputs])
    inputs = [i.at(renumber[i.slot]) for i in inputs]
    outputs = [o.at(renumber[o.slot]) for o in outputs]
    if buffers:
        assign_buffers(instrs, {o.slot for o in outputs})
    dropped = {n for n, v in ctx.values.items() if v.slot not in renumber}
    about = {}  # each kept note -> the node it is about (the first), or None
    for note, n in zip(ctx.notes, ctx.note_nodes + [None] * len(ctx.notes)):
        if n not in dropped:
            about.setdefault(note, n)
    notes = list(about)
    if is_lead_rank():  # every rank partitions the same graph: one copy of each note per job
        for note, n in about.items():
            _warn(f"spmd_runtime partitioner: {note}", None if n is None else graph[n].source)
    named = [(n, graph.name_of(n.id)) for n in graph.nodes if n.op in (PARAMETER.name, MESH_SPLIT.name)]
    named = [(n, name) for n, name in named if name]
    report = ShardingReport({n.id: (prop.shardings[n.id], prop.origin[n.id]) for n in graph.nodes},
                            {name: n.id for n, name in named})
    names = {renumber[ctx.value(n.id).slot]: name for n, name in named
             if n.id in ctx.values and n.op != PARAMETER.name and ctx.value(n.id).slot in renumber}
    return SPMDProgram(mesh, instrs, inputs, outputs, notes, report, graph.in_tree, graph.out_tree, names)


def _warn(message: str, source) -> None:
    """A partitioner warning at the user's line that made the node (JAX's source_info), else at the caller's."""
    if source is None:
        warnings.warn(message, stacklevel=4)
    else:
        warnings.warn_explicit(message, UserWarning, source[0], source[1])


def _drop_dead(instrs: list[Instr], roots) -> tuple[list[Instr], dict[int, int]]:
    """The instructions the roots (outputs, parameters) need, slots renumbered densely, and the renumbering.
    A rule may emit work a later rule bypasses (a concatenation of slices read straight from their operand):
    every rank drops the same instructions, so no collective is left unmatched."""
    live, stack = set(), list(roots)
    while stack:
        slot = stack.pop()
        if slot not in live:
            live.add(slot)
            stack += instrs[slot].args
    if len(live) == len(instrs):
        return instrs, {i.out: i.out for i in instrs}
    renumber = {i.out: k for k, i in enumerate(i for i in instrs if i.out in live)}
    return [i.renumbered(renumber) for i in instrs if i.out in live], renumber  # frees come later


def assign_buffers(instrs: list[Instr], keep: set[int]) -> None:
    """Frees, then donations, of a program whose slots are its positions (``instrs[k].out == k``)."""
    last = list(range(len(instrs)))  # slot -> the instruction that reads it last (itself when none does)
    for ins in instrs:
        for a in ins.args:
            last[a] = ins.out
    _assign_frees(instrs, keep, last)
    _assign_donations(instrs, keep, last)


def _assign_frees(instrs: list[Instr], keep: set[int], last: list[int]) -> None:
    """Record on each instruction the buffers that die there, so the interpreter frees them at once."""
    dying: dict[int, list[int]] = {}
    for slot, at in enumerate(last):  # ascending slots: each list comes out sorted
        if slot not in keep:
            if at in dying:
                dying[at].append(slot)
            else:
                dying[at] = [slot]
    for ins in instrs:
        ins.free = tuple(dying[ins.out]) if ins.out in dying else ()


def _assign_donations(instrs: list[Instr], keep: set[int], last: list[int]) -> None:
    """Let an op write into an operand whose buffer dies there (a ufunc's ``out=``, an all-reduce's
    ``MPI.IN_PLACE``): no allocation.

    Safe only when that buffer is owned by the operand alone: produced by a fresh op, not viewed by any
    value still alive (outputs, ``keep``, live to the end), of the result's shape and dtype. Decided once
    here, not per step at run time.
    """
    records = {op: lookup(op) for op in {ins.op for ins in instrs}}
    roots, viewers = buffer_roots(instrs)
    last = list(last)
    for slot in keep:
        last[slot] = len(instrs)
    for ins in instrs:
        if records[ins.op].in_place and ins.shape:
            able = [k for k, a in enumerate(ins.args) if _donatable(instrs[a], ins, roots, viewers, last)]
            # A donated input first: an intermediate written into an output could never have a planned buffer.
            ins.donate = min(able, key=lambda k: not donated_input(instrs[ins.args[k]]), default=-1)
        elif ins.op in (SCAN.name, WHILE.name):
            _assign_adoptions(ins, instrs, roots, viewers, last)


def _assign_adoptions(loop: Instr, instrs: list[Instr], roots, viewers, last) -> None:
    """``loop.attrs["adopt"]``: the carries its body writes in place whose initial value dies at the loop, in a
    buffer the program owns alone (as ``_donatable``): the loop runs in that buffer instead of a copy of it
    (exec/loops.py), so the value is never held twice (and the planner's count, which holds it once, is the
    executor's)."""
    body = loop.attrs["body"]
    carry = lambda k: (body.inputs[k].sharding.local_shape(body.inputs[k].shape, body.mesh), body.inputs[k].dtype)
    # the loop and its results view their operands (a carry handed on as it is); not one its body writes in place
    mine = lambda v: v == loop.out or (instrs[v].op == LOOP_OUT.name and instrs[v].args[0] == loop.out)
    others = {a: [v for v in viewers.get(a, ()) if not mine(v)] for a in loop.args}
    body_roots = buffer_roots(body.instrs)[0]
    alone = lambda k: not any(body.inputs[k].slot in body_roots[o.slot] for j, o in enumerate(body.outputs) if j != k)
    adopt = tuple(k for k in sorted(body.written_inputs) if k < loop.attrs["num_carry"]
                  and loop.args.count(loop.args[k]) == 1 and alone(k)
                  and _donatable(instrs[loop.args[k]], loop, roots, others, last, carry(k)))
    if adopt or "adopt" in loop.attrs:
        loop.attrs = {**{n: v for n, v in loop.attrs.items() if n != "adopt"}, **({"adopt": adopt} if adopt else {})}


def buffer_roots(instrs: list[Instr]) -> tuple[list, dict]:
    """Per slot (slots are positions), the buffers its value may share: its own slot for a fresh op or a donated
    input, ``("read-only", slot)`` for the caller's or the program's array, and for any other op its operands'
    plus ``("view", slot)``; and per fresh slot, the slots that may view its buffer. Which ops return fresh
    buffers, read-only arrays or views, their records say (``OpDef.fresh``, ``fresh_if``, ``read_only``)."""
    roots: list = [None] * len(instrs)
    viewers: dict[int, list[int]] = {}
    for ins in instrs:
        if fresh_result(ins, instrs.__getitem__) or donated_input(ins):  # a donated input is the program's to overwrite
            roots[ins.out] = frozenset({ins.out})
        elif lookup(ins.op).read_only:
            roots[ins.out] = frozenset({("read-only", ins.out)})
        else:
            rs = roots[ins.out] = frozenset().union(*(roots[a] for a in ins.args)) | {("view", ins.out)}
            for r in rs:
                if type(r) is int:
                    viewers.setdefault(r, []).append(ins.out)
    return roots, viewers


def made_fresh(roots) -> bool:
    """Whether a value with ``roots`` (``buffer_roots``) can only be, or view, buffers that fresh ops made: no
    read-only array, no input's buffer."""
    return any(type(r) is int for r in roots) and all(type(r) is int or r[0] == "view" for r in roots)


def donated_input(ins: Instr) -> bool:
    """Whether ``ins`` is the parameter of an input the program may overwrite (``partition(donate=...)``)."""
    return ins.op == PARAMETER.name and bool(ins.attrs.get("donated"))


def _donatable(src: Instr, ins: Instr, roots, viewers, last, like=None) -> bool:
    """Whether ``ins`` may write into ``src``'s buffer: it dies there, is the program's alone, and is shaped as
    ``ins``'s result (or as ``like``, (local shape, dtype): a loop's carry)."""
    shape, dtype = (ins.shape, ins.dtype) if like is None else like
    return (src.out in ins.free and tuple(src.shape) == tuple(shape) and str(src.dtype) == str(dtype)
            and roots[src.out] == {src.out} and all(last[v] < ins.out for v in viewers.get(src.out, ())))
