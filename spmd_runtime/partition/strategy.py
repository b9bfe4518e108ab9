"""Partition strategies: rules propose candidates with their costs, ONE chooser picks.

Like DTensor's ``OpStrategy`` + ``redistribute_cost``: a partition rule lists the ways it could
compute its op locally (``Strategy``: operand shardings, the result sharding, the bytes each rank
moves to get there and on to the wanted result, the local flops), and ``choose`` takes the cheapest
under the one cost function, ``cost.strategy_cost`` (bytes + BYTES_PER_FLOP * flops); ties go to
fewer bytes, then less work, then the candidate listed first.

The letter-split helpers serve every op whose dims can be named by letters (einsum, take,
scatter_add, ...): each letter is unsplit or split as an operand or the wanted result splits it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from ..cost import strategy_cost
from ..mesh import Mesh
from ..sharding import Sharding, block_size
from .resharding import plan_cost


@dataclass(frozen=True)
class Strategy:
    wire: float  # bytes each rank moves: operands in, result on to the wanted sharding
    flops: float = 0.0  # local compute per rank
    operands: tuple[Sharding, ...] = ()  # the layout each operand is brought to
    result: Sharding | None = None  # what the local op produces (may be partial)
    plan: Any = None  # rule-specific detail of how to run it
    tiebreak: Any = 0  # last resort among equal costs (e.g. how many layouts change); smaller wins

    @property
    def cost(self) -> float:
        return strategy_cost(self.wire, self.flops)

    def key(self):
        return (self.cost, self.wire, self.flops, self.tiebreak)


def choose(candidates) -> Strategy:
    """The cheapest candidate (first listed on ties)."""
    best = None
    for cand in candidates:
        if best is None or cand.key() < best.key():
            best = cand
    if best is None:
        raise ValueError("a partition rule proposes at least one strategy; got none")
    return best


def letter_options(sizes: dict, termed, mesh: Mesh) -> dict[str, list[tuple[str, ...]]]:
    """Candidate axes per letter: unsplit, or as any of ``termed`` ((term, sharding) pairs) splits it,
    never into more shards than elements."""
    opts = {c: [()] for c in sizes}
    for term, s in termed:
        for c, axes in zip(term, s.dims):
            if axes and axes not in opts[c] and mesh.axis_size(axes) <= sizes[c]:
                opts[c].append(axes)
    return opts


def distinct(split: dict) -> bool:
    """No mesh axis splits two letters."""
    used = [a for axes in split.values() for a in axes]
    return len(used) == len(set(used))


def letter_strategies(ctx, operands, out_term: str, node, operand_cost=None, flops_per_point: float = 2):
    """Every per-letter split of ``operands`` ((term, LocalValue) pairs) as a Strategy: operand shardings,
    the result (partial over the axes of letters absent from ``out_term``), bytes moved, local work.

    ``operand_cost(k, value, sharding, result)`` prices bringing operand k to ``sharding`` (default: the
    planner's bytes); local work is ``flops_per_point`` per point of the letters' local iteration space."""
    target, mesh = ctx.sharding(node.id), ctx.mesh
    price = operand_cost or (lambda k, value, sharding, result: ctx.cost(value, sharding))
    sizes = {c: n for term, v in operands for c, n in zip(term, v.shape)}
    options = letter_options(sizes, [(t, v.sharding) for t, v in operands] + [(out_term, target)], mesh)
    for choice in itertools.product(*options.values()):
        split = dict(zip(options, choice))
        if not distinct(split):
            continue
        shardings = tuple(Sharding(tuple(split[c] for c in term)) for term, _ in operands)
        summed = {a for c in split if c not in out_term for a in split[c]}
        result = Sharding(tuple(split[c] for c in out_term), tuple(a for a in mesh.axis_names if a in summed))
        moved = sum(price(k, v, s, result) for k, ((_, v), s) in enumerate(zip(operands, shardings)))
        moved += plan_cost(result, target, node.shape, node.dtype, mesh)
        work = math.prod(block_size(sizes[c], mesh.axis_size(split[c])) for c in sizes)
        yield Strategy(moved, flops_per_point * work, shardings, result)
