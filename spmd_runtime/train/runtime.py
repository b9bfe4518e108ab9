"""The training step at run time: ``build_train_step`` (trace and partition), ``TrainStep`` (init, shard,
step, gather, checkpoints, reports), and the collective helpers that do rank 0's work while the other
ranks sleep (``build_train_step_on_root``, ``run_on_root``)."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .. import pytree
from ..checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from ..comm import watchdog
from ..comm.agreement import agree, capture, digests, sleep_until_every_rank_arrives
from ..comm.communicator import world
from ..exec.backend import to_host
from ..exec.runner import Promised, Runtime, communicator, run_local_checked, shard, unshard
from ..mesh import Mesh
from ..models.lm import LMConfig, init_params, layer_views, param_shapes
from ..optim import AdamW, DynamicLossScale, Optimizer, slot_tree
from ..partition import partition
from ..program import SPMDProgram
from ..reference import evaluate
from ..sharding import Sharding
from ..trace import trace
from .layout import Layout, make_layout, state_leaf_name
from .presets import Preset, as_preset, check_experts, check_pipeline
from .model import (Model, check_model_optimizer, check_model_preset, model_eval_fn, layout_for, model_input_specs,
                    model_step_fn)
from .step import TOKEN_DTYPE, eval_loss_fn, input_specs, metric_names, step_specs, train_step_fn


def build_train_step(cfg: "LMConfig | Model", mesh: Mesh, preset="dp", optimizer: Optimizer | None = None,
                     microbatches: int = 1, donate: bool = False, layout: Layout | None = None) -> "TrainStep":
    """Trace and partition one training step of ``cfg`` (the built-in LM's ``LMConfig``, or any ``Model``:
    a loss, its parameters' specs and sharding roles) over ``mesh`` with ``preset`` (name or Preset);
    ``microbatches`` > 1 accumulates gradients over that many slices of the batch (one optimizer update);
    with the ``pipeline`` preset they are the pipeline's micro-batches. ``donate``: the step updates the
    parameters and optimizer state in place (``partition(donate=...)``, JAX's ``donate_argnums``): no new
    buffers for the new state, and ``step`` consumes the local state it is given (use the one it returns).
    ``layout``: the preset's layout on ``mesh`` with some parameters' specs changed (``sr.autoshard_tensors``
    finds one); default: the preset's own."""
    if layout is not None and (layout.mesh != mesh or layout.preset != as_preset(preset).on(mesh)):
        raise ValueError(f"build_train_step's layout must be of its mesh and preset; got a layout of "
                         f"{layout.preset.name!r} on {layout.mesh} for {as_preset(preset).name!r} on {mesh}")
    if not isinstance(microbatches, int) or microbatches < 1 or cfg.batch % microbatches:
        raise ValueError(f"microbatches must be a positive int dividing the batch; got microbatches="
                         f"{microbatches!r} for batch={cfg.batch}")
    if isinstance(cfg, Model):
        return _build_model_step(cfg, mesh, as_preset(preset).on(mesh), optimizer or AdamW(), microbatches, donate,
                                 layout)
    if microbatches > 1 and cfg.moe_every:
        raise ValueError(f"gradient accumulation supports dense models (it returns no MoE metrics); got "
                         f"microbatches={microbatches} with moe_every={cfg.moe_every}")
    check_pipeline(cfg, mesh, as_preset(preset), microbatches)
    optimizer = optimizer or AdamW()
    if np.dtype(cfg.dtype) == np.float16 and not isinstance(optimizer, DynamicLossScale):
        optimizer = DynamicLossScale(optimizer)  # float16 gradients underflow without it
    preset = as_preset(preset).on(mesh)
    layout = layout or make_layout(cfg, mesh, preset, optimizer)
    graph = trace(train_step_fn(cfg, optimizer, layout, microbatches), *input_specs(cfg, optimizer))
    return _partitioned(cfg, mesh, preset, optimizer, layout, graph, microbatches, donate)


def _build_model_step(model: Model, mesh: Mesh, preset: Preset, optimizer: Optimizer, microbatches: int,
                      donate: bool, layout: Layout | None = None) -> "TrainStep":
    check_model_preset(model, preset)
    check_model_optimizer(model, optimizer)
    layout = layout or layout_for(model, mesh, preset, optimizer)
    graph = trace(model_step_fn(model, optimizer, layout, microbatches), *model_input_specs(model, optimizer))
    return _partitioned(model, mesh, preset, optimizer, layout, graph, microbatches, donate)


def _partitioned(cfg, mesh, preset, optimizer, layout, graph, microbatches, donate) -> "TrainStep":
    in_specs, out_specs = step_specs(graph, layout)
    state = [k for k, node in enumerate(graph.params) if not graph.name_of(node).startswith("batch.")] if donate else ()
    program = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs, donate=state)
    return TrainStep(cfg, mesh, preset, optimizer, layout, graph, program, microbatches)


def build_train_step_on_root(cfg: "LMConfig | Model", mesh: Mesh, preset="dp", optimizer: Optimizer | None = None,
                             comm=None, microbatches: int = 1, donate: bool = False) -> "TrainStep":
    """Collective: rank 0 traces and partitions, every rank receives the same TrainStep (each rank would
    otherwise repeat the same deterministic work, N times over on shared cores)."""
    comm = world(comm)
    if isinstance(cfg, Model):  # on every rank, before rank 0 goes off alone
        check_model_preset(cfg, as_preset(preset).on(mesh))
    else:
        check_experts(cfg, mesh, as_preset(preset).on(mesh))
        check_pipeline(cfg, mesh, as_preset(preset), microbatches)
    def build():
        step = build_train_step(cfg, mesh, preset, optimizer, microbatches, donate)
        if isinstance(cfg, Model):
            step.cfg = None  # a Model's functions need not pickle: every rank has the model and puts it back
        return step
    step = comm.bcast(run_on_root(comm, build, "tracing and partitioning the training step on rank 0"), root=0)
    if isinstance(cfg, Model):
        step.cfg = cfg
    return step


def run_on_root(comm, fn, what: str = "the work done on rank 0"):
    """Collective: rank 0 runs ``fn`` (its result is returned there, None elsewhere) while the other ranks
    wait SLEEPING: an MPI wait spins, and with more ranks than cores the spinning ranks would take the
    cores rank 0 needs. An exception in ``fn`` becomes the same one-line ``AgreedError`` on every rank."""
    result, error = capture(fn) if comm.Get_rank() == 0 else (None, None)  # agreed below: no rank waits for it
    if hasattr(comm, "Ibarrier"):
        _sleep_until_every_rank_arrives(comm, what)
    agree(comm, error, what)
    return result


@watchdog.collective(lambda frame: f"the ranks' barrier after {frame.f_locals.get('what')}")
def _sleep_until_every_rank_arrives(comm, what: str) -> None:
    sleep_until_every_rank_arrives(comm)




# ---------------------------------------------------------------- running it
@dataclass
class TrainStep:
    """A partitioned training step, of the built-in LM (``cfg`` an ``LMConfig``) or of any ``Model`` (``cfg`` the
    Model: its loss, parameter specs and roles; ``is_model``). Its state is the pytree ``{"params": {name: weight}, "opt_state": the
    optimizer's state tree}``: global (``init``, ``gather``, ``reference_step``) or this rank's TRUE blocks
    (``shard_state``, ``step``, ``load``). ``state_names`` are the state's dotted leaf names in program order
    (``params.wq``, ``opt_state.m.wq``), the names of the program's inputs and of checkpoint tensors.
    ``metrics`` holds the last step's extra scalars (MoE: 'aux_loss', 'dropped_fraction')."""
    cfg: "LMConfig | Model"
    mesh: Mesh
    preset: Preset
    optimizer: Optimizer
    layout: Layout
    graph: object  # the unpartitioned traced step (sr.evaluate runs it on global arrays)
    program: SPMDProgram
    microbatches: int = 1
    state_names: list = field(init=False)
    param_names: list = field(init=False)
    metrics: dict = field(init=False, default_factory=dict)
    _eval: SPMDProgram | None = field(init=False, default=None, repr=False)  # eval_program(), built on first use

    def __post_init__(self):
        self.param_names = list(self.cfg.param_shapes() if self.is_model else param_shapes(self.cfg))
        self.state_names = [io.name for io in self.program.inputs if not io.name.startswith("batch.")]
        self._state_ios = self.program.inputs[:len(self.state_names)]
        self._batch_ios = self.program.inputs[len(self.state_names):]
        names = {"params": {n: f"params.{n}" for n in self.param_names},
                 "opt_state": slot_tree(self.layout.slots, map(state_leaf_name, self.layout.slots))}
        order, self._state_tree = pytree.flatten(names)
        self._order = [order.index(n) for n in self.state_names]  # program order -> tree leaf order

    @property
    def is_model(self) -> bool:
        """A ``Model``'s step (not the built-in LM's)."""
        return isinstance(self.cfg, Model)

    def _metrics(self, outs) -> dict:
        names = () if self.is_model else metric_names(self.cfg)
        self.metrics = {k: float(v) for k, v in zip(names, outs[len(outs) - 1 - len(names):-1])}
        return self.metrics

    def _flat(self, state) -> list:
        """The leaves of a state tree in program order (the tree must be a TrainStep state)."""
        leaves = pytree.flatten_like(state, self._state_tree, "a TrainStep state")
        return [leaves[k] for k in self._order]

    def _tree(self, flat) -> dict:
        """The state tree of leaves in program order."""
        leaves = [None] * len(flat)
        for k, x in zip(self._order, flat):
            leaves[k] = x
        return self._state_tree.unflatten(leaves)

    def named(self, state) -> "OrderedDict[str, object]":
        """Dotted leaf name -> leaf of a state tree, in program order."""
        return OrderedDict(zip(self.state_names, self._flat(state)))

    def init(self, seed: int = 0) -> dict:
        """Global initial state: parameters from ``seed`` (the same on every mesh) and fresh optimizer state."""
        if self.is_model and self.cfg.init is None:
            raise ValueError(f"TrainStep.init needs the Model's init (seed -> params); got {self.cfg!r} without one "
                             f"(or pass fit a state)")
        params = dict(self.cfg.held_params(self.cfg.init(seed)) if self.is_model else init_params(self.cfg, seed))
        return {"params": params, "opt_state": self.optimizer.init_state(params)}

    def shard_state(self, state: dict, rank: int) -> dict:
        """``rank``'s TRUE blocks of the global ``state`` (sliced once; the step then keeps them local). Views of
        ``state``, or copies when the step donates its state (it would write into ``state`` itself)."""
        own = bool(self.program.donated)
        return self._tree([shard(np.asarray(x), io.sharding, self.mesh, rank, own=own)
                           for x, io in zip(self._flat(state), self._state_ios)])

    def _batch(self, tokens, labels) -> list:
        """The batch inputs in program order."""
        batch = {"batch.tokens": tokens, "batch.labels": labels}
        return [np.asarray(batch[io.name], TOKEN_DTYPE) for io in self._batch_ios]

    def step(self, local_state: dict, tokens, labels, comm=None,
             check_inputs: bool | None = None) -> tuple[dict, float]:
        """One step on this rank's blocks; ``tokens``/``labels`` are the global batch (every rank the same).
        Returns (new local state, loss). ``check_inputs`` (default True, or ``$SPMD_CHECK_INPUTS=0``): the
        ranks agree on a digest of the batch in the run's preparation (no exchange of its own; ~µs for the
        reference config's batch), so a batch differing on one rank fails instead of mixing into one loss."""
        rt = Runtime.of(comm)
        error = check_batch(tokens, labels, self.cfg)  # agreed on in the run's preparation: raises on every rank
        whole = [] if error else self._batch(tokens, labels)
        batch = [shard(x, io.sharding, self.mesh, rt.rank) for x, io in zip(whole, self._batch_ios)]
        promised = None
        if rt.checks_inputs(check_inputs) and not error:
            promised = Promised("TrainStep.step needs the same global batch on every rank (each takes its block "
                                "of it)", [io.name for io in self._batch_ios], digests(whole))
        outs = run_local_checked(self.program, [*self._flat(local_state), *batch], comm=comm, error=error,
                                 promised=promised)
        self._metrics(outs)
        return self._tree(outs[:len(self.state_names)]), float(outs[-1])

    def batch_block(self, rank: int) -> tuple[slice, slice]:
        """(rows, cols): the block of the global (batch, seq) token batch that ``rank`` holds (a
        ``TokenLoader``'s ``rows`` / ``cols``), the same for tokens and labels."""
        tokens, labels = (io for name in ("batch.tokens", "batch.labels") for io in self._batch_ios if io.name == name)
        assert tokens.sharding == labels.sharding, "the layout splits tokens and labels alike"
        return tuple(tokens.sharding.block_slices(tokens.shape, self.mesh, rank))

    def _local_batch(self, tokens, labels, rank: int):
        """(error or None, the batch blocks in program order): this rank's blocks, checked like a global batch."""
        rows, cols = self.batch_block(rank)
        shape = (len(range(self.cfg.batch)[rows]), len(range(self.cfg.seq)[cols]))
        error = check_batch(tokens, labels, self.cfg, shape, f"this rank's block {rows.start}:{rows.stop}, "
                                                             f"{cols.start}:{cols.stop} of the batch")
        return error, [] if error else self._batch(tokens, labels)

    def step_local(self, local_state: dict, tokens, labels, comm=None, position: int | None = None,
                   check_inputs: bool | None = None) -> tuple[dict, float]:
        """``step`` on this rank's blocks of the batch too (``batch_block(rank)``, as a ``TokenLoader`` reads
        them): no rank holds the global batch. The ranks' blocks differ, so instead of the batch's digest the
        ranks agree on ``position`` when given (the loader position the blocks come from; ``check_inputs`` as in
        ``step``), in the run's preparation: a rank drawing another batch fails on every rank."""
        rt = Runtime.of(comm)
        error, batch = self._local_batch(tokens, labels, rt.rank)
        promised = None
        if position is not None and rt.checks_inputs(check_inputs):
            promised = Promised("TrainStep.step_local needs every rank at the same loader position (each reads its "
                                "block of that batch)", ["loader position"], digests([np.asarray(position, np.int64)]))
        outs = run_local_checked(self.program, [*self._flat(local_state), *batch], comm=comm, error=error,
                                 promised=promised)
        self._metrics(outs)
        return self._tree(outs[:len(self.state_names)]), float(outs[-1])

    def eval_program(self) -> SPMDProgram:
        """The step's forward alone, ``loss(params, batch)`` (no gradient, no update), partitioned with the
        step's layout; built on first use (on each rank: it is deterministic)."""
        if self._eval is None:
            if self.is_model:
                params, _, batch = model_input_specs(self.cfg, self.optimizer)
                loss = model_eval_fn(self.cfg, self.layout)
            else:
                params, _, batch = input_specs(self.cfg, self.optimizer)
                loss = eval_loss_fn(self.cfg, self.layout, self.microbatches)
            graph = trace(loss, params, batch)
            self._eval = partition(graph, self.mesh, in_specs=[self.layout.specs[n] for n in graph.param_names],
                                   out_specs=[()])
        return self._eval

    def eval_loss(self, local_state: dict, tokens, labels, comm=None) -> float:
        """The mean loss of the parameters in ``local_state`` on this rank's blocks of a batch (like
        ``step_local``), without training."""
        program, rt = self.eval_program(), Runtime.of(comm)
        error, batch = self._local_batch(tokens, labels, rt.rank)
        named = self.named(local_state)
        params = [named[io.name] for io in program.inputs if not io.name.startswith("batch.")]
        return float(run_local_checked(program, [*params, *batch], comm=comm, error=error)[0])

    def reference_step(self, state: dict, tokens, labels) -> tuple[dict, float]:
        """The same step, unpartitioned, on global arrays (``sr.evaluate`` of the traced graph)."""
        outs = evaluate(self.graph, *self._flat(state), *self._batch(tokens, labels))
        self._metrics(outs)
        return self._tree(outs[:len(self.state_names)]), float(outs[-1])

    def gather(self, local_state: dict, comm=None) -> dict:
        """Collective: the global state from every rank's blocks."""
        mc = communicator(self.mesh, comm)
        out = []
        for x, io in zip(self._flat(local_state), self._state_ios):
            padded = _pad_to(to_host(x), io.sharding.local_shape(io.shape, self.mesh))
            out.append(np.asarray(unshard(padded, io.sharding, io.shape, mc)))
        return self._tree(out)

    # ------------------------------------------------------------ checkpoints
    def save(self, directory, local_state: dict, step: int | None = None, comm=None, extra=None) -> None:
        """Collective: save this rank's blocks of the state (sharded, atomic; see ``checkpoint``), one tensor
        per state leaf, named by its dotted path (``params.wq``, ``opt_state.m.wq``). ``extra``: name -> a small
        array the same on every rank (a data loader's position), saved replicated as ``extra.<name>`` in the same
        atomic save (``load(..., extra=True)`` returns them)."""
        extra = {f"{EXTRA}{k}": np.asarray(v) for k, v in (extra or {}).items()}
        entries = {io.name: (io.shape, io.sharding) for io in self._state_ios}
        entries.update((k, (v.shape, Sharding.replicated(v.ndim))) for k, v in extra.items())
        save_checkpoint(directory, {**self.named(local_state), **extra}, entries, self.mesh, comm=comm, step=step)

    def load(self, directory, comm=None, strict: bool = True, extra: bool = False):
        """Collective: this rank's blocks of a saved state, whatever mesh and preset saved it; with ``extra``,
        ``(state, extra)``, the dict ``save(..., extra=...)`` saved with it ({} if none).

        The checkpoint must hold exactly this model's parameters and optimizer state at their shapes and dtypes
        (a checkpoint of another config fails, naming each mismatched tensor); ``strict=False`` loads the ones
        that match and leaves None for the others. Layers saved unrolled (one tensor per layer) load into
        stacked layers and vice versa (``models.lm.layer_views``). Checkpoints written before the state was a
        pytree (flat names: ``wq``, ``m_wq``, ``step``) load too, each tensor mapped to its leaf
        (``legacy_names``)."""
        stored = _stored_names(directory)
        extras = {n: e for n, e in stored.items() if n.startswith(EXTRA)}
        legacy = self.legacy_names() if stored and not any(n in stored for n in self.state_names) else {}
        name = lambda n: legacy.get(n, n)
        ios = {name(io.name): io for io in self._state_ios}
        views = {} if self.is_model else layer_views(self.cfg, ios)
        expect = {n: (io.shape, io.dtype) for n, io in ios.items()}
        expect.update((n, (e["shape"], e["dtype"])) for n, e in extras.items())
        blocks = load_checkpoint(directory, self.mesh, {n: io.sharding for n, io in ios.items()
                                                        if n in stored or n in views},
                                 comm=comm, expect=expect, strict=strict, views=views)
        state = self._tree([blocks.get(name(n)) for n in self.state_names])
        return (state, {n[len(EXTRA):]: blocks[n] for n in extras}) if extra else state

    def legacy_names(self) -> dict:
        """State leaf name -> the flat name checkpoints written before state trees gave it (``params.wq`` ->
        ``wq``, ``opt_state.m.wq`` -> ``m_wq``)."""
        names = {f"params.{n}": n for n in self.param_names}
        names.update((state_leaf_name(slot), slot.name) for slot in self.layout.slots)
        return names

    # ------------------------------------------------------------ reports
    def memory_report(self) -> dict:
        """Per-rank bytes: parameters, optimizer state and batch held between steps (IOSpec local shapes,
        padded), the program's peak of live buffers, and the temporaries at that peak (activations,
        gradients, updates: peak minus inputs). ``*_global`` give the unsharded sizes."""
        held = {"params": 0, "opt_state": 0, "batch": 0}
        whole = dict(held)
        for io in self.program.inputs:
            kind = io.name.split(".", 1)[0]
            item = np.dtype(io.dtype).itemsize
            held[kind] += math.prod(io.sharding.local_shape(io.shape, self.mesh)) * item
            whole[kind] += math.prod(io.shape) * item
        peak = self.program.peak_bytes()
        return {**held, "peak": peak, "activations": peak - sum(held.values()),
                **{f"{k}_global": v for k, v in whole.items()}}

    def comm_summary(self) -> list[dict]:
        """Collectives per step grouped by (kind, axes): count, bytes in, wire bytes per rank."""
        groups: "OrderedDict[tuple, dict]" = OrderedDict()
        for c in self.program.comm_summary():
            g = groups.setdefault((c["kind"], c["axes"]), {"kind": c["kind"], "axes": c["axes"], "count": 0,
                                                            "bytes_in": 0, "wire_bytes": 0.0})
            g["count"] += 1
            g["bytes_in"] += c["bytes_in"]
            g["wire_bytes"] += c["wire_bytes"]
        return list(groups.values())


EXTRA = "extra."  # the prefix of the values TrainStep.save(extra=...) keeps beside the state


def _stored_names(directory) -> dict:
    """The tensors of the checkpoint in ``directory`` by name (empty when it cannot be read:
    ``load_checkpoint`` then fails on every rank, saying why)."""
    try:
        return dict(checkpoint_info(directory)["tensors"])
    except (OSError, ValueError, KeyError):
        return {}


def check_batch(tokens, labels, cfg: LMConfig, shape=None, block: str = "") -> str | None:
    """Why a batch is unusable (None if it is fine): integer token ids and labels in [0, vocab), shape
    (batch, seq) (or ``shape``, that of the ``block`` of it a rank holds). Checked on the host: the kernels
    would clip or cast them silently."""
    for what, x in (("tokens", tokens), ("labels", labels)):
        x = np.asarray(x)
        if shape is not None and x.shape != tuple(shape):
            return f"TrainStep.step_local {what} must have the shape of {block}, {tuple(shape)}; got {x.shape}"
        if shape is None and x.shape != (cfg.batch, cfg.seq):
            return f"TrainStep.step {what} must have shape (batch, seq) = {(cfg.batch, cfg.seq)}; got {x.shape}"
        if not np.issubdtype(x.dtype, np.integer):
            return f"TrainStep.step {what} must be integer token ids; got dtype {x.dtype}"
        low, high = (int(x.min()), int(x.max())) if x.size else (0, 0)
        if low < 0 or high >= cfg.vocab:
            bad = x[(x < 0) | (x >= cfg.vocab)]
            return (f"TrainStep.step {what} must be token ids in [0, vocab={cfg.vocab}); got {bad.size} outside, "
                    f"e.g. {bad[:4].tolist()}")
    return None


def format_comm(summary: list[dict]) -> str:
    rows = [f"  {'collective':<19} {'axes':<12} {'count':>5} {'bytes in':>12} {'wire bytes':>12}"]
    for g in summary:
        rows.append(f"  {g['kind']:<19} {','.join(g['axes']):<12} {g['count']:>5} {g['bytes_in']:>12} "
                    f"{g['wire_bytes']:>12.0f}")
    rows.append(f"  total wire bytes per rank per step: {sum(g['wire_bytes'] for g in summary):.0f}")
    return "\n".join(rows)


def _pad_to(x, shape):
    widths = [(0, want - have) for have, want in zip(x.shape, shape)]
    return np.pad(x, widths) if any(w for _, w in widths) else x
