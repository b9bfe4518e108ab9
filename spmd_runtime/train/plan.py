"""Plans: a training step traced and partitioned from shapes alone (nothing allocated, nothing run), and the
per-rank figures a cluster run is sized by: parameter and optimizer-state bytes, peak bytes, instructions,
partition seconds, and wire bytes per step by collective kind and mesh axis (``TrainStep.memory_report`` and
``TrainStep.comm_summary`` of the abstract program)."""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..mesh import Mesh
from ..models.lm import LMConfig
from ..optim import Optimizer
from .runtime import TrainStep, build_train_step, format_comm

GIB = 2.0 ** 30


def instruction_count(program) -> int:
    """Instructions of ``program``, those of its loop and branch bodies included (each once)."""
    bodies = [b for ins in program.instrs for v in ins.attrs.values()
              for b in (v if isinstance(v, tuple) else (v,)) if hasattr(b, "instrs")]
    return len(program.instrs) + sum(instruction_count(b) for b in bodies)


@dataclass
class Plan:
    """A partitioned (never run) training step and its per-rank figures."""
    step: TrainStep
    seconds: float  # tracing and partitioning, wall clock
    instructions: int
    memory: dict  # TrainStep.memory_report(): per-rank bytes
    comm: list  # TrainStep.comm_summary(): per (kind, axes) count, bytes in, wire bytes per rank per step
    microbatches: int = 1
    cpu_seconds: float = 0.0  # this process's CPU time in them (the wall clock counts a shared machine's waits)

    def wire_by_axis(self) -> "OrderedDict[str, float]":
        """Wire bytes per rank per step by mesh axes ("data", "model", "data,model", ...)."""
        out: "OrderedDict[str, float]" = OrderedDict()
        for g in self.comm:
            key = ",".join(g["axes"])
            out[key] = out.get(key, 0.0) + g["wire_bytes"]
        return out

    def format(self) -> str:
        m, cfg, mesh = self.memory, self.step.cfg, self.step.mesh
        rows = [f"plan: preset {self.step.preset.name} on mesh {dict(zip(mesh.axis_names, mesh.shape))} "
                f"({mesh.size} ranks), microbatches {self.microbatches}",
                f"  {_config(cfg)}",
                f"  partition seconds: {self.seconds:.2f} ({self.cpu_seconds:.2f} CPU)   instructions: "
                f"{self.instructions}",
                f"  per rank: parameters {_gib(m['params'])}  optimizer state {_gib(m['opt_state'])}  "
                f"batch {_gib(m['batch'])}  peak {_gib(m['peak'])}  (activations and temporaries at the peak "
                f"{_gib(m['activations'])})",
                f"  whole model: parameters {_gib(m['params_global'])}  optimizer state {_gib(m['opt_state_global'])}",
                "  wire bytes per rank per step by collective kind and mesh axes:", format_comm(self.comm)]
        if self.step.preset.stage:
            stages = mesh.axis_size(self.step.preset.stage[0])
            rows.insert(2, f"  pipeline: {stages} stages, {self.microbatches} micro-batches, GPipe bubble "
                           f"(S-1)/(M+S-1) = {self.bubble:.3f}")
        return "\n".join(rows)

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction, (S - 1) / (M + S - 1) for GPipe's M + S - 1 iterations; 0 without stages."""
        if not self.step.preset.stage:
            return 0.0
        stages = self.step.mesh.axis_size(self.step.preset.stage[0])
        return (stages - 1) / (self.microbatches + stages - 1)


def plan_train_step(cfg: "LMConfig | Model", mesh: Mesh, preset="dp", optimizer: Optimizer | None = None,
                    microbatches: int = 1, donate: bool = False) -> Plan:
    """``build_train_step`` from abstract inputs (it allocates no parameter or state slot), timed, with its
    per-rank figures; ``donate``: the step updates parameters and optimizer state in place (as
    ``build_train_step``'s), so its peak holds one copy of them."""
    start, cpu = time.perf_counter(), time.process_time()
    step = build_train_step(cfg, mesh, preset, optimizer, microbatches, donate)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Plan(step, seconds, instruction_count(step.program), step.memory_report(), step.comm_summary(),
                microbatches, cpu)


def _config(cfg: LMConfig) -> str:
    """``cfg`` by the fields that differ from their defaults (the full repr is long); a Model by its repr."""
    if not isinstance(cfg, LMConfig):
        return repr(cfg)
    changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != f.default]
    return f"LMConfig({', '.join(changed)})"


def _gib(n) -> str:
    return f"{n / GIB:.2f} GiB"


__all__ = ["Plan", "plan_train_step", "instruction_count"]
