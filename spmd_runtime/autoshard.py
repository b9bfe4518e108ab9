"""``sr.autoshard``: choose a training layout by prediction, before spending an allocation (issue 27).

For a model config, a device count and a hardware profile, every candidate layout -- each preset on every
mesh shape it can take for that device count (1-d, every 2-d factorisation, and for the pipelines every
stage x data x model one whose stage count divides the layers), each micro-batch count and remat policy asked
for -- is partitioned (abstract shapes; nothing runs), predicted with ``program.estimate`` (the slowest
rank's step), pruned when its peak bytes exceed the device's memory, and ranked by predicted step time.
The table of candidates is printed; the result is the list, best first: ``result[0].build()`` builds it.

Prunings keep a search over thousands of devices to seconds: a layout whose parameters and optimizer state
alone (from its specs, before anything is traced) exceed the device's memory is refused unpartitioned;
unless micro-batch counts are given, each layout tries 1, 2, 4, ... micro-batches (dividing its per-data-rank
batch) and stops at the first that fits, or, for a pipeline (whose bubble shrinks with more), starts near its
stage count and stops once more stop being faster; and a branch and bound (``_Search``) skips what a bound
from below says cannot beat the best layout built so far: the compute bound (``compute_bound``: the model's
matmul FLOPs at the device's peak, a pipeline's bubble included), a layout's step at fewer micro-batches, and,
on meshes of more than a few hundred ranks, a probe (``probe_layout``: the same per-rank program with the data
axis cut to 2 ranks, cheap to partition). ``autoshard(prune=False)`` builds every candidate at full size.

Candidates a preset refuses (experts that do not divide, a stage count that does not divide the layers, ...)
are listed with the reason, not dropped silently.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from .hardware import Hardware
from .models.lm import LMConfig, param_kind, param_shapes
from .optim import AdamW
from .sharding import parse_spec
from .train import (PRESETS, SP_COMBINED, as_preset, build_train_step, input_specs, make_layout, state_leaf_name,
                    train_mesh)

MOE_PRESETS = ("moe", "moe_megatron")
ONE_AXIS = ("dp", "wus", "seq", "fsdp")
MEGATRON_FAMILY = ("megatron", "megatron_wus", "megatron_sp", "fsdp_megatron")  # a pipeline's layers, unstaged
# a pipeline (S, d, t) has the work and model collectives of (S d, t) unstaged, but fewer data-parallel bytes: on
# Megatron's 18B / 256-GPU row every pipeline stepped in at least 0.77 x the fastest unstaged (S d, t)
UNPIPED_MARGIN = 2.0  # presets whose roles use every axis alike: the 1-d mesh says it all


@dataclass(frozen=True)
class Candidate:
    """One layout and its prediction (``step_s`` None when it could not be built: ``error`` says why)."""
    preset: str
    mesh_shape: tuple
    microbatches: int = 1
    remat: str = "none"
    step_s: float | None = None
    peak_bytes: int | None = None
    fits: bool = False
    error: str | None = None
    held_bytes: int | None = None  # parameters + optimizer state per rank, from the specs (before any partition)
    pruned: str | None = None  # why the search did not build it: a bound says it cannot beat the best
    probe: tuple | None = None  # the mesh of the probe that predicted it, when not built at full size

    def __repr__(self):
        what = f"{self.step_s * 1e3:.2f} ms" if self.step_s is not None else \
            f"pruned: {self.pruned}" if self.pruned else f"refused: {self.error}"
        return f"Candidate({self.preset} {self.mesh_shape} M={self.microbatches} remat={self.remat}: {what})"

    def build(self, cfg: LMConfig, optimizer=None):
        """The TrainStep of this layout."""
        return build_train_step(dataclasses.replace(cfg, remat=self.remat), train_mesh(self.mesh_shape, self.preset),
                                self.preset, optimizer, self.microbatches)


def mesh_shapes(preset: str, devices: int, cfg: LMConfig) -> list[tuple]:
    """The mesh shapes ``preset`` can take on ``devices``."""
    if preset in ONE_AXIS:
        return [(devices,)]
    pairs = [(a, devices // a) for a in range(1, devices + 1) if devices % a == 0]
    if not PRESETS[preset].stage:
        return pairs
    return [(s, d, devices // (s * d)) for s, d in itertools.product(range(2, devices + 1), range(1, devices + 1))
            if devices % (s * d) == 0 and cfg.layers % s == 0]


def autoshard(cfg: LMConfig, devices: int, hardware, *, optimizer=None, presets=None, microbatches=None,
              remats=None, verbose: bool = True, prune: bool = True, probe_above: int = 256) -> list[Candidate]:
    """Every candidate layout for ``cfg`` on ``devices`` ranks of ``hardware`` (a ``Hardware`` or a profile
    name/path), best predicted first; those that do not fit or were refused last. ``microbatches``: the counts
    to try (default: ascending powers of two, as the module doc says); ``remats``: the policies (default: the
    config's). Prints the table unless ``verbose`` is False. ``prune``: the branch and bound of the module doc
    (False: every candidate built at full size); ``probe_above``: layouts of more ranks are predicted on a probe
    first (``probe_layout``: up to a few hundred ranks a build costs about the same, beyond it grows with
    them). Raises if no candidate fits, naming the smallest peak and the
    device's memory."""
    hardware = hardware if isinstance(hardware, Hardware) else Hardware.load(hardware)
    if hardware.devices is not None and hardware.devices != devices:
        raise ValueError(f"autoshard plans {devices} devices on hardware {hardware.name!r} of {hardware.devices} "
                         f"devices; got a mismatch (use hardware.with_nodes(n) or a profile without 'nodes')")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"autoshard needs a positive device count; got {devices!r}")
    # the SP combinations only when asked for: by default they near double the candidates (18B: 3.7x the CPU
    # seconds) for runners-up to megatron_sp
    names = presets or [p for p in PRESETS if (p in MOE_PRESETS) == bool(cfg.moe_every) and p not in SP_COMBINED]
    unknown = [p for p in names if p not in PRESETS]
    if unknown:
        raise ValueError(f"autoshard presets must be among {sorted(PRESETS)}; got {unknown}")
    optimizer = optimizer or AdamW()
    layouts = [(p, shape, r) for p in names for shape in mesh_shapes(p, devices, cfg) for r in remats or (cfg.remat,)]
    if prune:
        found = _Search(cfg, devices, hardware, optimizer, microbatches, probe_above).run(layouts)
    else:
        found = [c for p, shape, r in layouts for c in _search_microbatches(cfg, p, shape, microbatches, r, hardware,
                                                                           optimizer)]
    found.sort(key=lambda c: (c.step_s is None, not c.fits, c.step_s or 0.0))
    if verbose:
        print(format_table(found, hardware))
    if not any(c.fits for c in found):
        raise ValueError(f"autoshard found no layout of {cfg} on {devices} devices that fits in "
                         f"{hardware.memory_bytes / 2**30:.2f} GiB per device; got {_closest(found)} (add devices, "
                         f"micro-batches or remat, or a smaller batch)")
    return found


def _closest(found: list[Candidate]) -> str:
    peaks = [c.peak_bytes for c in found if c.peak_bytes is not None]
    if peaks:
        return f"the smallest peak {min(peaks) / 2**30:.2f} GiB"
    held = [c.held_bytes for c in found if c.held_bytes is not None]
    if held:
        return f"no layout built: the smallest parameters and optimizer state {min(held) / 2**30:.2f} GiB per rank"
    return "no layout built"


def _search_microbatches(cfg, preset, shape, counts, remat, hardware, optimizer) -> list[Candidate]:
    """The candidates of one layout over micro-batch counts: ``counts`` as given, or ascending powers of two
    until one fits (a pipeline: until more stop being faster)."""
    held = held_bytes(cfg, shape, preset, optimizer)
    if held is not None and held > hardware.memory_bytes:
        return [Candidate(preset, shape, 1, remat, held_bytes=held, error=f"parameters and optimizer state alone take "
                          f"{held / 2**30:.2f} GiB per rank, over the device's {hardware.memory_bytes / 2**30:.2f} GiB")]
    found: list[Candidate] = []
    stages = shape[0] if PRESETS[preset].stage else 1  # fewer micro-batches than stages: mostly bubble
    for m in counts or [m for m in _powers_of_two(cfg.batch // _data_ranks(shape, preset)) if 2 * m > stages]:
        found.append(_try(cfg, preset, shape, m, remat, hardware, optimizer))
        if counts is None and _done(found, pipelined=PRESETS[preset].stage != ()):
            break
    return found


def _done(found: list[Candidate], pipelined: bool) -> bool:
    fitting = [c for c in found if c.fits]
    if not pipelined:
        return bool(fitting) or found[-1].error is not None
    return len(fitting) >= 2 and fitting[-1].step_s >= fitting[-2].step_s


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(limit, 1).bit_length())]


def _data_ranks(shape, preset: str) -> int:
    mesh = train_mesh(shape, preset)
    return mesh.axis_size(as_preset(preset).on(mesh).batch)


def held_bytes(cfg: LMConfig, shape, preset: str, optimizer) -> int | None:
    """Bytes per rank of the parameters and optimizer state of this layout, from its specs alone (nothing
    traced): a lower bound of its peak. None when the preset refuses the layout (``_try`` then says why)."""
    mesh = train_mesh(shape, preset)
    try:
        layout = make_layout(cfg, mesh, as_preset(preset).on(mesh), optimizer)
    except ValueError:
        return None
    params, _, _ = input_specs(cfg, optimizer)
    leaves = [(f"params.{n}", spec.shape, spec.dtype) for n, spec in params.items()]
    leaves += [(state_leaf_name(slot), slot.shape, slot.dtype) for slot in layout.slots]
    return sum(math.prod(parse_spec(layout.specs[name], mesh, len(shape)).local_shape(shape, mesh))
               * np.dtype(dtype).itemsize for name, shape, dtype in leaves)


def _try(cfg, preset, shape, microbatches, remat, hardware, optimizer) -> Candidate:
    base = Candidate(preset, shape, microbatches, remat)
    try:
        step = base.build(cfg, optimizer)
        ranks = range(step.mesh.size) if step.mesh.size <= 8 else (0, step.mesh.size - 1)
        worst = max((step.program.estimate(hardware.with_nodes(None), r) for r in ranks), key=lambda e: e.step_s)
    except ValueError as e:
        return dataclasses.replace(base, error=str(e).split(";")[0])
    return dataclasses.replace(base, step_s=worst.step_s, peak_bytes=worst.peak_bytes, fits=worst.fits)


MATMULS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # the dense block's projections: 2 FLOPs per weight and token


def compute_bound(cfg: LMConfig, devices: int, hardware: Hardware, stages: int = 1, microbatches: int = 1) -> float:
    """Seconds no layout of ``cfg`` on ``devices`` ranks can beat: the projections' and the head's matmul FLOPs
    (forward, twice that backward, the layers' forward again under full remat; attention and elementwise work
    left out, so it stays below the estimate's count) spread evenly at the device's peak, the layers' share
    stretched by a pipeline's bubble: its loop runs M + S - 1 iterations and every stage computes in each.
    0 for MoE (what experts compute depends on routing)."""
    if cfg.moe_every:
        return 0.0
    layers = sum(2 * math.prod(shape) for name, shape in param_shapes(cfg).items() if param_kind(name) in MATMULS)
    passes = 4 if cfg.remat == "full" else 3
    bubble = (microbatches + stages - 1) / microbatches
    flops = cfg.batch * cfg.seq * (passes * layers * bubble + 3 * 2 * cfg.vocab * cfg.d)
    return flops / (devices * hardware.peak_flops(cfg.dtype))


def probe_layout(cfg: LMConfig, preset: str, shape: tuple, ranks: int = 2) -> tuple[LMConfig, tuple]:
    """A cheaper layout whose ranks run this one's program but for the "data" axis: that axis cut to ``ranks``
    and the batch with it (each rank's share unchanged). Its collectives over "data" span fewer ranks, so they
    are no slower and its step is a bound from below (under wus/fsdp its parameters, gradients and optimizer
    state are split ``ranks`` ways, not d: ``_Search`` extrapolates the peak from probes of 2 and 4 ranks;
    their update, larger than at d ranks, is a small error of the bound). The layout itself when "data" has
    ``ranks`` or fewer, or splits more than the batch."""
    mesh = train_mesh(shape, preset)
    roles = as_preset(preset).on(mesh)
    if "data" not in roles.batch or "data" in roles.seq + roles.model + roles.experts + roles.stage:
        return cfg, shape
    i = mesh.axis_names.index("data")
    if shape[i] <= ranks or cfg.batch % shape[i]:
        return cfg, shape
    return dataclasses.replace(cfg, batch=cfg.batch // shape[i] * ranks), shape[:i] + (ranks,) + shape[i + 1:]


def _state_over_data(preset: str, shape) -> bool:
    """Whether the layout splits parameters or optimizer state over "data" (wus, fsdp): bytes per rank that a
    probe, with fewer data ranks, holds more of."""
    return "data" in as_preset(preset).on(train_mesh(shape, preset)).update


def _extrapolated_peak(two: int, four: int, ranks: int) -> int:
    """Peak bytes at ``ranks`` data ranks from probes at 2 and 4: a + b / d (what is split over "data", b / d;
    the rest, a, each rank's batch share included, the same)."""
    return int(2 * four - two + 4 * (two - four) / ranks)


class _Search:
    """The pruned search (``autoshard(prune=True)``): a branch and bound whose bounds are probes.

    Layouts go in order of their compute bound (tensor parallelism inside a node first); each is predicted on
    its probe (``probe_layout``, a bound from below) over micro-batch counts. The first fitting probe faster
    than the best layout built so far is built at full size at once: the best built is a real prediction,
    and what is pruned is pruned against it. Skipped: a count whose compute bound, or a layout whose probed
    step, is no faster than the best built (more micro-batches only add to a step without a pipeline: smaller
    matmuls, more instructions, the same collectives); counts whose activations, at best 1/M of those at a
    count that did not fit, still cannot fit; more counts once the peak did not drop from one count to the
    next (what is over is not the activations); a model axis of more ranks than heads (each rank computes
    at least a head: the compute bound times ranks / heads); a pipeline whose step at M, less its bubble
    (S - 1) / (M + S - 1), is no faster than the best (more micro-batches only shrink the bubble); a pipeline
    (S, d, t) once a megatron-family layout (S d, t), whose ranks do the same work with the same model
    collectives but no bubble, took twice the best or more (``UNPIPED_MARGIN``: its data-parallel bytes are
    more, so this bound is empirical). Last, the fitting probes left, fastest first, are built at
    full size until a probe is no faster than the best built."""

    def __init__(self, cfg, devices, hardware, optimizer, counts, probe_above):
        self.cfg, self.devices, self.hw, self.optimizer, self.counts = cfg, devices, hardware, optimizer, counts
        self.probe_above = probe_above
        self.best = math.inf  # the fastest fitting layout built at full size
        self.rows: list[Candidate] = []
        self.pending: list[Candidate] = []  # probes not built at full size
        self.unpiped: dict[tuple, float] = {}  # (data, model) -> the fastest step of a megatron family layout

    def run(self, layouts) -> list[Candidate]:
        for layout in sorted(layouts, key=self._order):
            self._probe(*layout)
        for c in sorted(self.pending, key=lambda c: (not c.fits, c.step_s or 0.0)):
            if not c.fits or c.probe is None and c.step_s >= self.best:
                self.rows.append(c)  # its own figures, at full size or not fitting
            elif c.step_s >= self.best:
                self.rows.append(dataclasses.replace(c, step_s=None, fits=False, pruned=f"probed on {c.probe}: "
                                                     f"step {c.step_s:.3f} s >= best built {self.best:.3f} s"))
            else:
                self._build(c)
        return self.rows

    def _order(self, layout):
        preset, shape, remat = layout
        model = shape[-1] if len(shape) > 1 else 1
        return (compute_bound(self.cfg, self.devices, self.hw, _stages(preset, shape), self.cfg.batch),
                model > self.hw.ranks_per_node, -model)

    def _probe(self, preset, shape, remat) -> None:
        cfg, mem = dataclasses.replace(self.cfg, remat=remat), self.hw.memory_bytes
        held = held_bytes(cfg, shape, preset, self.optimizer)
        if held is not None and held > mem:
            self.rows.append(Candidate(preset, shape, 1, remat, held_bytes=held, error=f"parameters and optimizer "
                                       f"state alone take {held / 2**30:.2f} GiB per rank, over the device's "
                                       f"{mem / 2**30:.2f} GiB"))
            return
        model = train_mesh(shape, preset).axis_size(as_preset(preset).on(train_mesh(shape, preset)).model)
        if model > cfg.heads and not cfg.moe_every:
            return self._prune(preset, shape, 1, remat, f"its model axis of {model} ranks splits {cfg.heads} heads: "
                               f"the ranks past the heads hold padding, and every rank computes a head")
        unpiped = self.unpiped.get((shape[0] * shape[1], shape[2]) if len(shape) == 3 else None, 0.0)
        if unpiped >= UNPIPED_MARGIN * self.best:
            return self._prune(preset, shape, 1, remat, f"the same tensor-parallel split without stages, "
                               f"{(shape[0] * shape[1], shape[2])}, steps in {unpiped:.3f} s >= {UNPIPED_MARGIN} x "
                               f"best {self.best:.3f} s: each rank has that work, its model collectives, and a bubble")
        pcfg, pshape = probe_layout(cfg, preset, shape) if self.devices > self.probe_above else (cfg, shape)
        stages, tried, at_least = _stages(preset, shape), [], 1
        for m in self.counts or [m for m in _powers_of_two(cfg.batch // _data_ranks(shape, preset)) if 2 * m > stages]:
            if m < at_least:
                continue
            bound = compute_bound(cfg, self.devices, self.hw, stages, m)
            if bound >= self.best:
                if stages > 1:
                    continue  # more micro-batches shrink the bubble
                return self._prune(preset, shape, m, remat, f"compute bound {bound:.3f} s >= best {self.best:.3f} s")
            c = self._probed(cfg, preset, shape, pcfg, pshape, m, remat, held)
            tried.append(c)
            if preset in MEGATRON_FAMILY and len(shape) == 2 and len(tried) == 1 and c.step_s is not None:
                self.unpiped[shape] = min(self.unpiped.get(shape, math.inf), c.step_s)  # its fewest micro-batches
            if c.fits and c.step_s < self.best:
                self._build(c)
            else:
                self.pending.append(c)
            if self.counts is not None:
                continue
            if stages > 1:
                floor = (c.step_s or 0.0) * m / (m + stages - 1)
                if floor >= self.best:
                    return self._prune(preset, shape, 2 * m, remat, f"at M={m} its step without the bubble, "
                                       f"{floor:.3f} s, >= best {self.best:.3f} s: more micro-batches only shrink "
                                       f"the bubble")
                if _done(tried, pipelined=True):
                    return
                continue
            if c.fits or c.step_s is None:
                return
            if c.step_s >= self.best:
                return self._prune(preset, shape, 2 * m, remat, f"at M={m} its step {c.step_s:.3f} s >= best "
                                   f"{self.best:.3f} s, and more micro-batches only add")
            if len(tried) > 1 and tried[-2].peak_bytes is not None and c.peak_bytes >= tried[-2].peak_bytes:
                return self._prune(preset, shape, 2 * m, remat, f"its peak did not drop from M={tried[-2].microbatches}"
                                   f" to {m} ({c.peak_bytes / 2**30:.2f} GiB): not the activations")
            at_least = _fitting_count(c, held or 0, mem, m)

    def _probed(self, cfg, preset, shape, pcfg, pshape, m, remat, held) -> Candidate:
        """The candidate at ``m`` predicted on its probe, its peak brought to the full size."""
        c = _try(pcfg, preset, pshape, m, remat, self.hw, self.optimizer)
        c = dataclasses.replace(c, mesh_shape=shape, probe=pshape if pshape != shape else None, held_bytes=held)
        if c.step_s is None or c.probe is None:
            return c
        peak = c.peak_bytes + (held or 0) - (held_bytes(pcfg, pshape, preset, self.optimizer) or 0)
        if _state_over_data(preset, shape):
            four = probe_layout(cfg, preset, shape, 4)
            more = _try(four[0], preset, four[1], m, remat, self.hw, self.optimizer) if four[1] != shape else None
            data = train_mesh(shape, preset).axis_size("data")
            peak = max(_extrapolated_peak(c.peak_bytes, more.peak_bytes, data), held or 0) if more and more.peak_bytes \
                else peak
        return dataclasses.replace(c, peak_bytes=peak, fits=peak <= self.hw.memory_bytes)

    def _prune(self, preset, shape, m, remat, why) -> None:
        self.rows.append(Candidate(preset, shape, m, remat, pruned=why))

    def _build(self, c: Candidate) -> None:
        """``c`` at full size; while it does not fit and is faster than the best, at twice the micro-batches."""
        m, limit = c.microbatches, self.cfg.batch // _data_ranks(c.mesh_shape, c.preset)
        while True:
            full = c if c.probe is None and m == c.microbatches else \
                _try(dataclasses.replace(self.cfg, remat=c.remat), c.preset, c.mesh_shape, m, c.remat, self.hw,
                     self.optimizer)
            self.rows.append(full)
            if full.fits:
                self.best = min(self.best, full.step_s)
            if full.fits or full.step_s is None or full.step_s >= self.best or 2 * m > limit \
                    or _stages(c.preset, c.mesh_shape) > 1 or self.counts is not None:
                return
            m *= 2


def _stages(preset: str, shape) -> int:
    return shape[0] if PRESETS[preset].stage else 1


def _fitting_count(c: Candidate, held: int, memory: int, m: int) -> int:
    """The fewest micro-batches that could fit, were the activations of ``c`` (at ``m``) to shrink as 1/M."""
    return max(2 * m, m * math.ceil((c.peak_bytes - held) / max(memory - held, 1)))


def format_table(found: list[Candidate], hardware: Hardware) -> str:
    rows = [f"autoshard on {hardware.name}: {len(found)} candidates, best predicted first",
            f"{'preset':14s} {'mesh':12s} {'M':>3s} {'remat':6s} {'step ms':>9s} {'peak GiB':>9s}  verdict"]
    for c in found:
        if c.pruned:
            rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.remat:6s} {'':>9s} "
                        f"{'':>9s}  pruned: {c.pruned}")
            continue
        if c.step_s is None:
            rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.remat:6s} {'':>9s} "
                        f"{'':>9s}  refused: {c.error}")
            continue
        rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.remat:6s} "
                    f"{c.step_s * 1e3:9.3f} {c.peak_bytes / 2**30:9.3f}  {'fits' if c.fits else 'does not fit'}"
                    + (f" (probed on {c.probe})" if c.probe else ""))
    return "\n".join(rows)
