"""Cost model of collectives: bytes each rank puts on the wire (GSPMD_NOTES.md section 5).

Bandwidth-optimal algorithms over k ranks; the latency model is alpha + beta * bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .mesh import Mesh

# all_to_allv: the resharding planner's exchange of block intersections (point-to-point rounds within a group).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute", "all_to_allv")

# What one local flop costs in bytes on the wire: ~10 GB/s between ranks vs ~100 GFLOP/s per rank.
# Strategies trade the two: gathering operands to skip an all-reduce replicates the matmul on every rank.
BYTES_PER_FLOP = 0.1


def strategy_cost(wire: float, flops: float) -> float:
    """Comparable cost of a partitioning strategy: bytes each rank moves plus its local compute."""
    return wire + BYTES_PER_FLOP * flops


def wire_bytes(op: str, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
    """Bytes each rank sends for one collective over ``k`` ranks (GSPMD_NOTES.md section 5).

    An all_to_allv's bytes depend on the blocks, not on k: ``sent``, what its busiest rank sends or receives."""
    if op == "all_to_allv":
        return float(sent or 0)
    if k <= 1 or op not in COLLECTIVES:
        return 0.0
    return {"all_reduce": 2 * (k - 1) / k * bytes_in, "all_gather": (k - 1) / k * bytes_out,
            "reduce_scatter": (k - 1) / k * bytes_in, "all_to_all": (k - 1) / k * bytes_in,
            "collective_permute": float(bytes_in)}[op]


def group_size(step_op: str, attrs: dict, mesh: Mesh) -> int:
    return mesh.size if step_op == "collective_permute" else mesh.axis_size(attrs["axes"])


@dataclass(frozen=True)
class CostModel:
    """What one collective costs, in bytes-equivalent units (what plan and strategy costs add up).

    The default is the ring-formula wire bytes; a measured profile (stage: ``calibrate``) replaces it."""
    name: str = "ring"

    def collective(self, op: str, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
        return wire_bytes(op, k, bytes_in, bytes_out, sent)


DEFAULT_MODEL = CostModel()
