"""``sr.autoshard_tensors`` / ``sr.autoshard_jit``: per-tensor shardings on one mesh, searched from a layout by
prediction (issue 27's second step, after the preset search of ``autoshard``).

A preset gives every parameter the sharding of its role; this search changes them one *group* at a time. A group
is one decision: the parameters of one kind in every layer (a scanned stack is one parameter already; the
``l0_wq`` ... ``l7_wq`` of unrolled layers are one group), or, for a jitted function, the input leaves whose
paths differ only in a list index; so the search costs the same for 2 layers or 96. A group's candidates:

- its weight where used: replicated, one dim split over one mesh axis or two (in mesh order), or two dims over
  one axis each; never into more shards than elements (uneven blocks are padded, as the partitioner allows). A
  stacked layer dim keeps the start's entry (a pipeline's stage split; else whole, as the layer scan slices it);
- (training steps) its update -- gradient, optimizer state, new weight -- as used, or further split over the axes
  the weight leaves free (weight-update sharding); and held between steps as used, or as updated (FSDP).

The objective is the predicted step (``program.estimate``: the slowest rank's; ranks 0 and last beyond 8) under
the peak bytes fitting the device; while a layout does not fit, a smaller peak is better. An evaluation traces
and partitions the abstract program (nothing is allocated, nothing runs; repeated layouts are not re-evaluated).
The search is coordinate descent: groups largest first, each group's candidates tried with the others fixed, the
best taken when it improves the objective; passes repeat until one takes no move or ``budget`` evaluations are
spent. So the result is never predicted slower than its start, nor with a larger peak when the start does not
fit. (An ILP, as Alpa's, would need a solver: the environment has none.) A candidate the partitioner or a
preset refuses is counted and its first reason reported, never silently dropped.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import pytree
from .autoshard import Candidate, autoshard
from .graph import TensorSpec
from .hardware import Hardware
from .mesh import Mesh
from .models.lm import param_kind
from .partition import partition
from .sharding import P
from .trace import trace
from .train import build_train_step, train_mesh
from .train.layout import Layout, slot_spec, state_leaf_name, update_spec

REFUSALS = (ValueError, NotImplementedError)  # what a partitioner or preset raises for a layout it cannot build


@dataclass(frozen=True)
class Choice:
    """One group's shardings: ``use`` where the weight is used, ``update`` of its gradient, optimizer state and
    new value, ``held`` between steps (``use`` or ``update``). A jitted function's input has ``held`` alone."""
    held: tuple
    use: tuple | None = None
    update: tuple | None = None

    def __str__(self):
        if self.use is None or self.use == self.held == self.update:
            return _spec_str(self.held)
        held = "held as used" if self.held == self.use else "held as updated"
        return f"{_spec_str(self.use)} update {_spec_str(self.update)} {held}"


@dataclass(frozen=True)
class Group:
    """Parameters (or input leaves) decided together: the same kind in every layer, of one held shape."""
    name: str
    members: tuple
    shape: tuple
    nbytes: int
    fixed: dict = field(default_factory=dict, hash=False, compare=False)  # dim -> entry the search keeps


@dataclass(frozen=True)
class Prediction:
    step_s: float | None
    peak_bytes: int | None
    fits: bool = False
    error: str | None = None

    def better_than(self, other: "Prediction") -> bool:
        """Fitting beats not fitting; among fitting layouts the faster step, among the others the smaller peak."""
        if self.error is not None:
            return False
        if self.fits != other.fits:
            return self.fits
        if self.fits:
            return self.step_s < other.step_s * (1 - 1e-9)
        return self.peak_bytes < other.peak_bytes


@dataclass(frozen=True)
class Move:
    group: str
    before: Choice
    after: Choice
    step_before: float
    step_after: float
    peak_after: int


@dataclass
class TensorSearch:
    """The search's result: ``start`` (its preset candidate for a training step), the ``moves`` taken, the final
    prediction, and what builds it: ``layout`` (a training step's: ``build(cfg)``) or ``in_specs`` (a jitted
    function's: ``sr.jit(fn, mesh=..., in_specs=result.in_specs)``)."""
    hardware: Hardware
    start: Prediction
    final: Prediction
    moves: list
    choices: dict  # group name -> Choice
    evaluations: int
    refused: int
    first_refusal: str | None
    cpu_s: float
    baseline: Candidate | None = None
    optimizer: object = None  # a training step's, as the search built it (its state slots are in the layout)
    layout: Layout | None = None
    in_specs: tuple | None = None
    program: object = None

    @property
    def step_s(self) -> float:
        return self.final.step_s

    @property
    def peak_bytes(self) -> int:
        return self.final.peak_bytes

    def build(self, cfg, donate: bool = False):
        """The TrainStep of the found layout (a training step's search), with the search's optimizer."""
        c = self.baseline
        return build_train_step(dataclasses.replace(cfg, remat=c.remat) if hasattr(cfg, "remat") else cfg,
                                self.layout.mesh, c.preset, self.optimizer, c.microbatches, donate, self.layout)

    def format(self) -> str:
        where = (f"{self.baseline.preset} on {self.baseline.mesh_shape} M={self.baseline.microbatches}"
                 if self.baseline else "the given in_specs")
        rows = [f"autoshard_tensors on {self.hardware.name} from {where}: {len(self.moves)} moves in "
                f"{self.evaluations} evaluations ({self.cpu_s:.1f} s CPU)",
                f"{'group':18s} {'from':40s} {'to':40s} {'step ms':>19s} {'peak GiB':>9s}"]
        for m in self.moves:
            rows.append(f"{m.group:18s} {str(m.before):40s} {str(m.after):40s} "
                        f"{m.step_before * 1e3:9.3f}->{m.step_after * 1e3:9.3f} {m.peak_after / 2**30:9.3f}")
        rows.append(f"{where}: {_verdict(self.start, self.hardware)}; per-tensor {_verdict(self.final, self.hardware)}"
                    f" ({(self.final.step_s / self.start.step_s - 1) * 100:+.1f}% step)")
        if self.refused:
            rows.append(f"{self.refused} candidates refused, the first: {self.first_refusal}")
        return "\n".join(rows)


def _verdict(p: Prediction, hardware: Hardware) -> str:
    fits = "fits" if p.fits else f"does not fit in {hardware.memory_bytes / 2**30:.2f} GiB"
    return f"{p.step_s * 1e3:.3f} ms, peak {p.peak_bytes / 2**30:.3f} GiB ({fits})"


def _spec_str(spec) -> str:
    return "(" + ", ".join("+".join(e) if e else "-" for e in spec) + ")"


def canon(spec, ndim: int) -> tuple:
    """``spec`` with one entry per dim, each None or a tuple of axis names: the one form candidates compare in."""
    spec = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(None if not e else (e,) if isinstance(e, str) else tuple(e) for e in spec)


# ---------------------------------------------------------------- candidates
def use_candidates(group: Group, mesh: Mesh) -> list[tuple]:
    """Replicated, one dim over one axis or two (in mesh order), two dims over one axis each; the ``fixed``
    dims as they are, the other dims split only over axes the fixed ones leave free."""
    taken = {a for e in group.fixed.values() if e for a in e}
    axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a not in taken]
    dims = [d for d in range(len(group.shape)) if d not in group.fixed]
    combos = [(a,) for a in axes] + list(itertools.combinations(axes, 2))
    splits = [{}] + [{d: c} for d in dims for c in combos]
    splits += [{d: (a,), e: (b,)} for d, e in itertools.combinations(dims, 2) for a, b in itertools.permutations(axes, 2)]
    found = []
    for split in splits:
        if all(mesh.axis_size(c) <= group.shape[d] for d, c in split.items()):
            found.append(canon([group.fixed.get(d, split.get(d)) for d in range(len(group.shape))], len(group.shape)))
    return found


def _update_modes(group: Group, use: tuple, mesh: Mesh) -> list[Choice]:
    """The choices of one use spec: update as used; or split further over the axes it leaves free, held as
    used (weight-update sharding) or as updated (FSDP)."""
    taken = {a for e in use if e for a in e}
    free = tuple(a for a in mesh.axis_names if a not in taken and mesh.axis_size(a) > 1)
    split = update_spec(group.shape, use, free, mesh, first_dim=min(group.fixed, default=-1) + 1)
    split = canon(split, len(use))
    same = Choice(use, use, use)
    return [same] if split == use else [same, Choice(use, use, split), Choice(split, use, split)]


def _mode(c: Choice) -> int:
    return 0 if c.update == c.use else 1 if c.held == c.use else 2


def train_moves(group: Group, current: Choice, mesh: Mesh) -> list[Choice]:
    """Every other use spec with the current update mode, then every other mode of the current use spec."""
    moves = []
    for use in use_candidates(group, mesh):
        modes = _update_modes(group, use, mesh)
        pick = modes[min(_mode(current), len(modes) - 1)]
        if use != current.use:
            moves.append(pick)
    return moves + [c for c in _update_modes(group, current.use, mesh) if c != current]


def input_moves(group: Group, current: Choice, mesh: Mesh) -> list[Choice]:
    return [Choice(s) for s in use_candidates(group, mesh) if s != current.held]


# ---------------------------------------------------------------- the search
def descend(groups: list[Group], start: dict, moves, evaluate, budget: int):
    """Coordinate descent (the module doc): (choices, prediction, moves taken, evaluations, refused, first
    refusal). ``evaluate(choices) -> Prediction``; ``moves(group, choice) -> candidates``."""
    seen: dict = {}
    refused = [0, None]

    def score(choices):
        key = tuple(choices[g.name] for g in groups)
        if key not in seen:
            with warnings.catch_warnings():  # a candidate's partitioner warnings (a replicated operand, ...) are
                warnings.simplefilter("ignore")  # in its prediction; the chosen layout's come when it is built
                seen[key] = evaluate(choices)
            if seen[key].error is not None:
                refused[0] += 1
                refused[1] = refused[1] or seen[key].error
        return seen[key]

    current = dict(start)
    best = score(current)
    if best.error is not None:
        raise ValueError(f"autoshard_tensors needs a start layout that builds; got: {best.error}")
    taken = []
    improved = True
    while improved and len(seen) < budget:
        improved = False
        for g in sorted(groups, key=lambda g: -g.nbytes):
            pick = None
            for cand in moves(g, current[g.name]):
                if len(seen) >= budget:
                    break
                trial = {**current, g.name: cand}
                got = score(trial)
                if got.better_than(pick[1] if pick else best):
                    pick = (trial, got)
            if pick:
                taken.append(Move(g.name, current[g.name], pick[0][g.name], best.step_s, pick[1].step_s,
                                  pick[1].peak_bytes))
                current, best, improved = pick[0], pick[1], True
    return current, best, taken, len(seen), refused[0], refused[1]


def predict(program, hardware: Hardware) -> Prediction:
    """The slowest rank's predicted step (every rank up to 8, else ranks 0 and last) and the peak."""
    size = program.mesh.size
    ranks = range(size) if size <= 8 else (0, size - 1)
    worst = max((program.estimate(hardware, r) for r in ranks), key=lambda e: e.step_s)
    return Prediction(worst.step_s, worst.peak_bytes, worst.fits)


def _refusal(e: Exception) -> Prediction:
    return Prediction(None, None, False, f"{type(e).__name__}: {str(e).split(';')[0][:200]}")


def _check_fits(found: Prediction, hardware: Hardware, what: str, evaluations: int) -> None:
    if not found.fits:
        raise ValueError(f"autoshard_tensors found no layout of {what} that fits in "
                         f"{hardware.memory_bytes / 2**30:.3f} GiB per device (the profile's memory_bytes "
                         f"{hardware.memory_bytes}); got the smallest peak {found.peak_bytes / 2**30:.3f} GiB after "
                         f"{evaluations} evaluations (add devices, micro-batches or remat, or a larger budget)")


def _as_hardware(hardware, devices: int) -> Hardware:
    hardware = hardware if isinstance(hardware, Hardware) else Hardware.load(hardware)
    if hardware.devices is not None and hardware.devices != devices:
        raise ValueError(f"autoshard_tensors plans {devices} devices on hardware {hardware.name!r} of "
                         f"{hardware.devices} devices; got a mismatch (use hardware.with_nodes(n) or a profile "
                         f"without 'nodes')")
    return hardware.with_nodes(None)


# ---------------------------------------------------------------- a training step
def autoshard_tensors(cfg, devices: int, hardware, *, start=None, mesh_shape=None, optimizer=None, presets=None,
                      budget: int = 150, verbose: bool = True) -> TensorSearch:
    """Per-tensor shardings of ``cfg``'s training step (an ``LMConfig`` or a ``Model``) on ``devices`` ranks of
    ``hardware`` (a ``Hardware`` or a profile name / path), searched from ``start``: an ``autoshard``
    ``Candidate`` or ``(preset, mesh_shape[, microbatches])``; default the best preset ``autoshard`` finds
    (among ``presets``, on ``mesh_shape`` when given; when none fits, the one with the smallest peak). At most
    ``budget`` layouts are evaluated. Prints the table of moves unless ``verbose`` is False; ``result.build(cfg)``
    builds the found layout. Raises when no layout found fits, naming the device's memory."""
    clock = time.process_time()
    hw = _as_hardware(hardware, devices)
    base = _start_candidate(cfg, devices, hw, start, mesh_shape, optimizer, presets)
    if math.prod(base.mesh_shape) != devices:
        raise ValueError(f"autoshard_tensors' start layout must have {devices} devices; got mesh {base.mesh_shape}")
    run_cfg = dataclasses.replace(cfg, remat=base.remat) if hasattr(cfg, "remat") else cfg
    first = build_train_step(run_cfg, train_mesh(base.mesh_shape, base.preset), base.preset, optimizer,
                             base.microbatches)
    layout, mesh = first.layout, first.mesh
    held = {io.name[len("params."):]: (io.shape, io.dtype) for io in first.program.inputs
            if io.name.startswith("params.")}
    groups = param_groups(layout, held)
    start_choices = {g.name: _current(layout, g) for g in groups}

    def evaluate(choices):
        try:
            step = build_train_step(run_cfg, mesh, base.preset, first.optimizer, base.microbatches,
                                    layout=with_choices(layout, groups, choices))
        except REFUSALS as e:
            return _refusal(e)
        return predict(step.program, hw)

    choices, found, taken, n, refused, why = descend(groups, start_choices, lambda g, c: train_moves(g, c, mesh),
                                                     evaluate, budget)
    result = TensorSearch(hw, predict(first.program, hw), found, taken, choices, n, refused, why,
                          time.process_time() - clock, base, first.optimizer, with_choices(layout, groups, choices))
    if verbose:
        print(result.format())
    _check_fits(found, hw, f"{cfg} on {base.mesh_shape}", n)
    return result


def _start_candidate(cfg, devices, hw, start, mesh_shape, optimizer, presets) -> Candidate:
    if isinstance(start, Candidate):
        return start
    if start is not None:
        preset, shape, *rest = start
        return Candidate(preset, tuple(shape), *rest[:1], remat=getattr(cfg, "remat", "none"))
    try:
        found = autoshard(cfg, devices, hw, optimizer=optimizer, presets=presets, verbose=False)
    except ValueError:  # nothing fits: start from the smallest peak, found with the memory limit lifted
        found = autoshard(cfg, devices, dataclasses.replace(hw, memory_bytes=1 << 62), optimizer=optimizer,
                          presets=presets, microbatches=(1,), verbose=False)
        found = sorted(found, key=lambda c: (c.peak_bytes is None, c.peak_bytes or 0))
    found = [c for c in found if c.step_s is not None and (mesh_shape is None or c.mesh_shape == tuple(mesh_shape))]
    if not found:
        raise ValueError(f"autoshard_tensors needs a preset layout to start from; got none built on "
                         f"{mesh_shape or devices} (pass start=(preset, mesh_shape))")
    return found[0]


def param_groups(layout: Layout, held: dict) -> list[Group]:
    """The parameters grouped by kind and held shape (``l0_wq`` ... ``l7_wq`` one group), a stacked layer dim
    fixed as the layout holds it. ``held``: parameter name -> (held shape, dtype), the step's inputs'."""
    groups: dict = {}
    for name in layout.update:
        groups.setdefault((param_kind(name), tuple(held[name][0])), []).append(name)
    found = []
    for (kind, shape), members in groups.items():
        fixed = {0: canon(layout.use[members[0]], len(shape))[0]} if layout.roles[members[0]].stacked else {}
        label = kind if sum(k == kind for k, _ in groups) == 1 else f"{kind}{list(shape)}"
        nbytes = len(members) * math.prod(shape) * np.dtype(held[members[0]][1]).itemsize
        found.append(Group(label, tuple(members), shape, nbytes, fixed))
    return found


def _current(layout: Layout, g: Group) -> Choice:
    n, k = g.members[0], len(g.shape)
    return Choice(canon(layout.specs[f"params.{n}"], k), canon(layout.use[n], k), canon(layout.update[n], k))


def with_choices(layout: Layout, groups: list[Group], choices: dict) -> Layout:
    """``layout`` with each group's parameters (and their optimizer state) laid out as chosen."""
    use, update, specs = dict(layout.use), dict(layout.update), dict(layout.specs)
    for g in groups:
        c = choices[g.name]
        for n in g.members:
            use[n], update[n], specs[f"params.{n}"] = c.use, c.update, c.held
    for slot in layout.slots:
        specs[state_leaf_name(slot)] = slot_spec(slot, update)
    return dataclasses.replace(layout, specs=specs, update=update, use=use)


# ---------------------------------------------------------------- a jitted function
def autoshard_jit(fn, *args, mesh: Mesh, hardware, in_specs=None, out_specs=None, budget: int = 100,
                  verbose: bool = True) -> TensorSearch:
    """Per-input shardings of ``fn(*args)`` on ``mesh``: ``args`` abstract (``sr.TensorSpec`` or anything with
    ``.shape`` and ``.dtype``) or arrays, traced once; each evaluation partitions the traced graph with the
    candidate in_specs (``out_specs`` as ``sr.jit`` takes them). Starts from ``in_specs`` (a prefix of the
    arguments as ``sr.jit``'s; None entries: the sharding propagation gives them). The result's ``in_specs``
    (one ``P`` per leaf, in the arguments' structure) go to ``sr.jit(fn, mesh=mesh, in_specs=...)``; its
    ``program`` is the found one."""
    clock = time.process_time()
    hw = _as_hardware(hardware, mesh.size)
    paths, tree = pytree.flatten_with_path(tuple(args))
    leaves = [TensorSpec(tuple(x.shape), np.dtype(x.dtype).name) for _, x in paths]
    names = [pytree.keystr(p, "args") for p, _ in paths]
    with mesh:
        graph = trace(fn, *tree.unflatten(leaves))
    starts = _leaf_specs(in_specs, tuple(args), len(leaves))
    outs = None if out_specs is None else pytree.broadcast_prefix(
        out_specs, graph.out_tree.unflatten([0] * len(graph.outputs)), lambda x: isinstance(x, P), "out_specs")

    def program_of(flat):
        with mesh:
            return partition(graph, mesh, in_specs=list(flat), out_specs=outs)

    first = program_of(starts)
    groups = input_groups(names, leaves)
    # the start as the partitioned program holds it: a None entry as propagation chose
    start_choices = {g.name: Choice(canon(first.inputs[g.members[0]].sharding.dims, len(g.shape))) for g in groups}

    def specs_of(choices):
        flat = [None] * len(leaves)
        for g in groups:
            for k in g.members:
                flat[k] = choices[g.name].held
        return flat

    def evaluate(choices):
        try:
            return predict(program_of(specs_of(choices)), hw)
        except REFUSALS as e:
            return _refusal(e)

    choices, found, taken, n, refused, why = descend(groups, start_choices, lambda g, c: input_moves(g, c, mesh),
                                                     evaluate, budget)
    start = predict(first, hw)
    if not found.better_than(start):  # the start's own program (None entries propagated) is as good: keep it
        flat, found, taken, choices, program = starts, start, [], start_choices, first
    else:
        flat = specs_of(choices)
        program = program_of(flat)
    result = TensorSearch(hw, start, found, taken, choices, n, refused, why, time.process_time() - clock,
                          in_specs=tree.unflatten(None if s is None else P(*s) for s in flat), program=program)
    if verbose:
        print(result.format())
    _check_fits(found, hw, f"{getattr(fn, '__name__', 'fn')} on {mesh}", n)
    return result


def input_groups(names: list[str], leaves: list) -> list[Group]:
    """Input leaves grouped by path with list indices wildcarded (past the argument's own position), and shape
    and dtype: ``args.0.3.w`` with ``args.0.0.w``."""
    groups: dict = {}
    for k, (name, x) in enumerate(zip(names, leaves)):
        head, _, rest = name.partition(".")
        arg, _, path = rest.partition(".")
        label = ".".join(filter(None, (head, arg, re.sub(r"(?<![^.])\d+(?![^.])", "*", path))))
        groups.setdefault((label, x.shape, x.dtype), []).append(k)
    return [Group(label, tuple(ks), tuple(shape), len(ks) * math.prod(shape) * np.dtype(dtype).itemsize)
            for (label, shape, dtype), ks in groups.items()]


def _leaf_specs(in_specs, args: tuple, n: int) -> list:
    if in_specs is None:
        return [None] * n
    flat = pytree.broadcast_prefix(tuple(in_specs) if isinstance(in_specs, list) else in_specs, args,
                                   lambda x: isinstance(x, P), "in_specs")
    return list(flat)
