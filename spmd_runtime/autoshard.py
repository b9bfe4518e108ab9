"""``sr.autoshard``: choose a training layout by prediction, before spending an allocation (issue 27).

For a model config, a device count and a hardware profile, every candidate layout -- each preset on every
mesh shape it can take for that device count (1-d, every 2-d factorisation, and for the pipelines every
stage x data x model one whose stage count divides the layers), each micro-batch count and remat policy asked
for -- is partitioned (abstract shapes; nothing runs), predicted with ``program.estimate`` (the slowest
rank's step), pruned when its peak bytes exceed the device's memory, and ranked by predicted step time.
The table of candidates is printed; the result is the list, best first: ``result[0].build()`` builds it.

Two prunings keep a search over thousands of devices to seconds: a layout whose parameters and optimizer state
alone (from its specs, before anything is traced) exceed the device's memory is refused unpartitioned; and
unless micro-batch counts are given, each layout tries 1, 2, 4, ... micro-batches (dividing its per-data-rank
batch) and stops at the first that fits, or, for a pipeline (whose bubble shrinks with more), starts near its
stage count and stops once more stop being faster.

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
from .models.lm import LMConfig
from .optim import AdamW
from .sharding import parse_spec
from .train import PRESETS, as_preset, build_train_step, input_specs, make_layout, state_leaf_name, train_mesh

MOE_PRESETS = ("moe", "moe_megatron")
ONE_AXIS = ("dp", "wus", "seq", "fsdp")  # presets whose roles use every axis alike: the 1-d mesh says it all


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

    def __repr__(self):
        what = f"{self.step_s * 1e3:.2f} ms" if self.step_s is not None else f"refused: {self.error}"
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
              remats=None, verbose: bool = True) -> list[Candidate]:
    """Every candidate layout for ``cfg`` on ``devices`` ranks of ``hardware`` (a ``Hardware`` or a profile
    name/path), best predicted first; those that do not fit or were refused last. ``microbatches``: the counts
    to try (default: ascending powers of two, as the module doc says); ``remats``: the policies (default: the
    config's). Prints the table unless ``verbose`` is False. Raises if no candidate fits, naming the smallest
    peak and the device's memory."""
    hardware = hardware if isinstance(hardware, Hardware) else Hardware.load(hardware)
    if hardware.devices is not None and hardware.devices != devices:
        raise ValueError(f"autoshard plans {devices} devices on hardware {hardware.name!r} of {hardware.devices} "
                         f"devices; got a mismatch (use hardware.with_nodes(n) or a profile without 'nodes')")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"autoshard needs a positive device count; got {devices!r}")
    names = presets or [p for p in PRESETS if (p in MOE_PRESETS) == bool(cfg.moe_every)]
    unknown = [p for p in names if p not in PRESETS]
    if unknown:
        raise ValueError(f"autoshard presets must be among {sorted(PRESETS)}; got {unknown}")
    optimizer = optimizer or AdamW()
    found = [c for p in names for shape in mesh_shapes(p, devices, cfg) for r in remats or (cfg.remat,)
             for c in _search_microbatches(cfg, p, shape, microbatches, r, hardware, optimizer)]
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


def format_table(found: list[Candidate], hardware: Hardware) -> str:
    rows = [f"autoshard on {hardware.name}: {len(found)} candidates, best predicted first",
            f"{'preset':14s} {'mesh':12s} {'M':>3s} {'remat':6s} {'step ms':>9s} {'peak GiB':>9s}  verdict"]
    for c in found:
        if c.step_s is None:
            rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.remat:6s} {'':>9s} "
                        f"{'':>9s}  refused: {c.error}")
            continue
        rows.append(f"{c.preset:14s} {str(c.mesh_shape):12s} {c.microbatches:>3d} {c.remat:6s} "
                    f"{c.step_s * 1e3:9.3f} {c.peak_bytes / 2**30:9.3f}  {'fits' if c.fits else 'does not fit'}")
    return "\n".join(rows)
