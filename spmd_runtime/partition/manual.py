"""Propagation and partitioning of a manual SPMD region (``shard_map``, ``ops/manual.py``).

Entering the region reshards each operand (through the one planner) to its in_spec over the manual axes;
over the automatic axes it keeps its own split, where that split is also a split of every local block
(a dim split over manual axes keeps an automatic axis only when the block divides evenly). The body, on
local blocks, is then partitioned ONCE as its own SPMD program over the automatic axes (the manual ones
are already spent: the body's own collectives name them), like a loop body (``partition/loops.py``). A
result is split over its out_spec's manual axes, major, and the body output's automatic axes, minor.

Propagation: operands take their in_specs; results their out_specs, plus what the body's propagation
gives over the automatic axes from the operands' automatic splits.

The rules here are registered in the partition layer's tables by ``rules/manual.py`` (beside the rules of the
collectives inside a region).
"""
from __future__ import annotations

from ..sharding import Sharding
from .loops import TupleSharding, body_shardings, emit_control, partition_body


def _auto(s: Sharding | None, manual) -> Sharding | None:
    """``s`` over the automatic axes only (no partial sums: the region's body starts from whole values)."""
    return None if s is None else Sharding(tuple(tuple(a for a in d if a not in manual) for d in s.dims))


def _joined(manual_part: Sharding, auto_part: Sharding | None, local_shape, mesh) -> Sharding:
    """Manual axes major, automatic minor; an automatic split of a manually split dim only when even."""
    if auto_part is None:
        return manual_part
    dims = []
    for m, a, n in zip(manual_part.dims, auto_part.dims, local_shape):
        dims.append(m + a if not m or not a or n % mesh.axis_size(a) == 0 else m)
    return Sharding(tuple(dims))


def _inner(joined: Sharding, manual) -> Sharding:
    return _auto(joined, manual)


def _body_view(node, ins, mesh):
    """(operand shardings, body propagation) with the operands' automatic splits as the body's seeds."""
    a = node.attrs
    body, manual = a["body"], a["manual"]
    operands = [_joined(spec, _auto(s, manual), body.nodes[p].shape, mesh)
                for spec, s, p in zip(a["in_specs"], ins, body.params)]
    seeds = {p: _inner(s, manual) for p, s in zip(body.params, operands)}
    return operands, body_shardings(body, mesh, seeds)


def _results(node, sh, mesh) -> list[Sharding]:
    a = node.attrs
    body = a["body"]
    return [_joined(spec, _auto(sh[o], a["manual"]), body.nodes[o].shape, mesh)
            for spec, o in zip(a["out_specs"], body.outputs)]


def region_propagation():
    def fwd(node, ins, g, mesh):
        _, sh = _body_view(node, ins, mesh)
        return TupleSharding(tuple(_results(node, sh, mesh)))

    def bwd(node, out, ins, g, mesh):
        return _body_view(node, ins, mesh)[0]
    return fwd, bwd


def partition_region(ctx, node):
    a = node.attrs
    body, manual, mesh = a["body"], a["manual"], ctx.mesh
    if a["mesh"] != mesh:
        raise ValueError(f"a shard_map region runs on the mesh the function is partitioned for ({mesh}); got a "
                         f"region on {a['mesh']}")
    operands, sh = _body_view(node, [ctx.value(i).sharding for i in node.inputs], mesh)
    args = [ctx.reshard(ctx.value(i), s) for i, s in zip(node.inputs, operands)]
    results = _results(node, sh, mesh)
    program = partition_body(ctx, node, body, [_inner(s, manual) for s in operands],
                             [_inner(s, manual) for s in results], "shard_map body")
    return emit_control(ctx, node, args, {"body": program, "manual": manual}, results)
