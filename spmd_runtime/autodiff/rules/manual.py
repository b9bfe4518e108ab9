"""The VJP rules of the ``ops/manual.py`` family, registered in ``table.py``. The body of a region is typed
(``ops/manual.py``), so each collective's transpose is exact: psum <-> pbroadcast, all_gather <-> psum_scatter,
ppermute -> the inverse permutation, all_to_all -> the inverse all_to_all, axis_index: no gradient; the VJP of
a region is a region running the body's VJP (the forward recomputed inside it)."""
from __future__ import annotations

from ...bodies import inline
from ...ops import core
from ...ops.manual import (AXIS_INDEX, PALL_GATHER, PALL_TO_ALL, PBROADCAST, PPERMUTE, PSUM, PSUM_SCATTER, SHARD_MAP,
                           all_gather, all_to_all, axis_index, pbroadcast, ppermute, psum, psum_scatter, trace_region)
from ...trace import current_graph
from ..engine import backward_from
from ..loops import floating, zeros_like
from .table import vjp


@vjp(PSUM)
def _psum_vjp(node, g, ops, y):
    """``g`` is the same on every shard along the axes (so is the psum): it is each summand's cotangent."""
    a = node.attrs
    if a["op"] == "sum":
        return [lambda: pbroadcast(g, a["axes"])]
    return [lambda: core.where(core.equal(ops[0], y), pbroadcast(g, a["axes"]), core.zeros(g.shape, g.dtype))]


@vjp(PBROADCAST)
def _pbroadcast_vjp(node, g, ops, y):
    return [lambda: psum(g, node.attrs["axes"])]


@vjp(PALL_GATHER)
def _all_gather_vjp(node, g, ops, y):
    return [lambda: psum_scatter(g, node.attrs["axes"], scatter_dimension=node.attrs["dim"], tiled=True)]


@vjp(PSUM_SCATTER)
def _psum_scatter_vjp(node, g, ops, y):
    return [lambda: all_gather(g, node.attrs["axes"], axis=node.attrs["dim"], tiled=True)]


@vjp(PALL_TO_ALL)
def _all_to_all_vjp(node, g, ops, y):
    a = node.attrs
    return [lambda: all_to_all(g, a["axes"], a["concat_dim"], a["split_dim"])]


@vjp(PPERMUTE)
def _ppermute_vjp(node, g, ops, y):
    a = node.attrs
    return [lambda: ppermute(g, a["axes"], [(d, s) for s, d in a["perm"]])]


@vjp(AXIS_INDEX)
def _axis_index_vjp(node, g, ops, y):
    return []


@vjp(SHARD_MAP)
def _shard_map_vjp(node, ct, operands, result):
    """A region running the body's VJP (the forward recomputed inside it): operands' blocks and the results'
    cotangent blocks in, the floating operands' cotangent blocks out. The body is typed, so a cotangent is
    the same along the axes its value is (an output's, by its out_spec; an operand's, by the psum that
    transposes its pbroadcast)."""
    a = node.attrs
    body, mesh, manual, in_sh, out_sh = a["body"], a["mesh"], a["manual"], a["in_specs"], a["out_specs"]
    float_res = [k for k, s in enumerate(a["results"]) if floating(s.dtype)]
    float_ops = [i for i, o in enumerate(operands) if floating(o.dtype)]
    cts = [ct.parts[k] if ct.parts.get(k) is not None else zeros_like(a["results"][k]) for k in float_res]
    n = len(operands)

    def backward_body(*blocks):
        start = len(current_graph().nodes)
        outs = inline(body, list(blocks[:n]))
        seeds = {}
        for k, c in zip(float_res, blocks[n:]):
            c = _from_shard_zero(c, a["out_varying"][k])
            seeds[outs[k].id] = seeds[outs[k].id] + c if outs[k].id in seeds else c
        return backward_from(seeds, [blocks[i] for i in float_ops], start)

    outs, _ = trace_region(backward_body, mesh, manual, list(operands) + cts,
                           list(in_sh) + [out_sh[k] for k in float_res], lambda _: [in_sh[i] for i in float_ops])
    grads = [None] * n
    for i, gr in zip(float_ops, outs):
        grads[i] = gr
    return grads


def _from_shard_zero(ct, axes):
    """``ct`` on the shards at coordinate 0 along ``axes``, zeros elsewhere: the cotangent of an output that the
    forward took from shard 0 along axes it varies over."""
    for a in axes:
        ct = core.where(core.equal(axis_index(a), 0), ct, core.zeros(ct.shape, ct.dtype))
    return ct
