"""``sr.autoshard``: choose a training layout by prediction, before spending an allocation (issue 27).

For a model config, a device count and a hardware profile, every candidate layout -- each preset on every
mesh shape it can take for that device count (1-d, every 2-d factorisation, and for ``pipeline`` every
stage x data x model one whose stage count divides the layers), each micro-batch count and remat policy asked
for -- is partitioned (abstract shapes; nothing runs), predicted with ``program.estimate`` (the slowest
rank's step), pruned when its peak bytes exceed the device's memory, and ranked by predicted step time.
The table of candidates is printed; the result is the list, best first: ``result[0].build()`` builds it.

Candidates a preset refuses (experts that do not divide, a stage count that does not divide the layers, ...)
are listed with the reason, not dropped silently.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from .hardware import Hardware
from .models.lm import LMConfig
from .train import PRESETS, build_train_step, train_mesh

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
    if preset != "pipeline":
        return pairs
    return [(s, d, devices // (s * d)) for s, d in itertools.product(range(2, devices + 1), range(1, devices + 1))
            if devices % (s * d) == 0 and cfg.layers % s == 0]


def autoshard(cfg: LMConfig, devices: int, hardware, *, optimizer=None, presets=None, microbatches=(1,),
              remats=("none",), verbose: bool = True) -> list[Candidate]:
    """Every candidate layout for ``cfg`` on ``devices`` ranks of ``hardware`` (a ``Hardware`` or a profile
    name/path), best predicted first; those that do not fit or were refused last. Prints the table unless
    ``verbose`` is False. Raises if no candidate fits, naming the smallest peak and the device's memory."""
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
    found = [_try(cfg, p, shape, m, r, hardware, optimizer) for p in names for shape in mesh_shapes(p, devices, cfg)
             for m in microbatches for r in remats]
    found.sort(key=lambda c: (c.step_s is None, not c.fits, c.step_s or 0.0))
    if verbose:
        print(format_table(found, hardware))
    if not any(c.fits for c in found):
        built = [c for c in found if c.peak_bytes is not None]
        smallest = min((c.peak_bytes for c in built), default=None)
        raise ValueError(f"autoshard found no layout of {cfg} on {devices} devices that fits in "
                         f"{hardware.memory_bytes / 2**30:.2f} GiB per device; got "
                         + (f"the smallest peak {smallest / 2**30:.2f} GiB" if smallest else "no layout built")
                         + " (add devices, micro-batches or remat, or a smaller batch)")
    return found


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
