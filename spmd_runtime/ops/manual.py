"""Manual SPMD regions: ``shard_map`` and the explicit collectives written inside one (JAX's ``shard_map``,
DTensor's ``local_map``, the GSPMD paper's manual / partially manual sharding).

``shard_map(fn, mesh, in_specs, out_specs, axis_names)(*args)`` traces ``fn`` ONCE on the local blocks
of its arguments (block shape = global shape / shards of the spec, even splits only) into a body graph
held by ONE ``shard_map`` node, like a loop body (``ops/control.py``); its results are read by
``loop_out`` nodes. Inside ``fn`` the collectives below name mesh axes that are *manual* in the region
(``axis_names``, default every mesh axis); the other axes stay automatic: the partitioner splits the body
over them like any program (``partition/manual.py``).

Records: ``shard_map`` (the region), and the collectives ``psum`` (sum / max / min), ``pall_gather``,
``psum_scatter``, ``pall_to_all``, ``ppermute``, ``axis_index``. Their reference kernels are *group
kernels*: ``kernel(xp, *per_shard_operands, shards=Shards) -> [block per shard]``; the region's own
kernel runs its body shard by shard in lockstep and calls them across the shards (the reference
evaluator simulates per-shard execution). A collective is legal only at the top level of a region body
(not inside a scan / cond body within it): the check is at trace time, on every rank alike.

Replication typing (JAX's ``check_vma``): every body value varies over a set of manual axes (a block
split over them) or is the same on every shard along the others. A block varies over its in_spec's axes;
psum / pmax / pmin make a value the same along their axes; the other collectives and axis_index make it
vary. Where a value that is the same along some axes meets one that varies (an add, a collective over
those axes), the body is rewritten with an explicit ``pbroadcast`` (identity on values). An output not
split over a manual axis is shard 0's block along it (each shard is assumed to hold the same, unchecked);
when its type says it varies there, its cotangent goes to shard 0 along it (the exact derivative).

Autodiff: the VJP of a region is a region running the body's VJP (the forward recomputed inside it).
With the typing the transposes are exact and communication-free where they can be: psum <-> pbroadcast
(the cotangent of a psum is already the same on every shard), all_gather <-> psum_scatter, ppermute ->
the inverse permutation, all_to_all -> the inverse all_to_all, axis_index: no gradient; a value
replicated into the region gets its cotangent summed by the transpose of its pbroadcast.

This file defines the records, the traced functions (``trace_region`` traces and emits a region, for
``shard_map`` and for the region's VJP) and the reference kernels. The layers above own the other parts,
in their rule tables: propagation and partitioning in ``partition/rules/manual.py`` (each collective one
``ops/spmd.py`` collective; the region's machinery: ``partition/manual.py``), the VJPs in
``autodiff/rules/manual.py``, the region's binder in ``exec/rules/manual.py`` (``exec/loops.py``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import product

import numpy as np

from .. import opdef
from ..bodies import BodyGraph, leaves_as_tensors, pytree_unflatten, trace_body, tracing
from ..dtypes import is_floating, is_low_precision
from ..graph import TensorSpec
from ..mesh import Mesh, get_mesh
from ..opdef import define
from ..sharding import P, Sharding, parse_spec
from ..trace import Tensor, current_graph, emit
from . import core
from .control import LOOP_OUT

SHARD_MAP = define("shard_map")
PSUM = define("psum")  # attrs: axes, op ("sum" | "max" | "min")
PALL_GATHER = define("pall_gather")  # attrs: axes, dim
PSUM_SCATTER = define("psum_scatter")  # attrs: axes, dim
PALL_TO_ALL = define("pall_to_all")  # attrs: axes, split_dim, concat_dim
PPERMUTE = define("ppermute")  # attrs: axes, perm ((source, destination) shard numbers along axes)
AXIS_INDEX = define("axis_index")  # attrs: axes
PBROADCAST = define("pbroadcast")  # attrs: axes; the same value, now typed as varying over axes
COLLECTIVES = (PSUM, PALL_GATHER, PSUM_SCATTER, PALL_TO_ALL, PPERMUTE)
GROUP_OPS = frozenset(op.name for op in COLLECTIVES + (AXIS_INDEX, PBROADCAST))
REDUCIBLE = ("float16", "bfloat16", "float32", "float64", "int32", "int64")  # what every reduction path sums


# ---------------------------------------------------------------- the region being traced
@dataclass(frozen=True)
class Region:
    mesh: Mesh
    manual: tuple[str, ...]  # in mesh order
    parent: object  # the graph the region was called in: its body's parent


_regions = threading.local()


def _enclosing(what: str, axis_name) -> tuple[Region, tuple[str, ...]]:
    """The region a collective is traced in, and its axes (checked to be manual there)."""
    stack = getattr(_regions, "stack", [])
    g = current_graph()
    if not stack or not isinstance(g, BodyGraph) or g.parent is not stack[-1].parent:
        where = "inside a loop or cond body within it" if stack else "outside any region"
        raise ValueError(f"sr.{what} runs at the top level of a sr.shard_map body (a manual SPMD region), where "
                         f"blocks are local; got a call {where}")
    region = stack[-1]
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    bad = [a for a in axes if a not in region.manual]
    if not axes or bad or len(set(axes)) != len(axes):
        auto = [a for a in bad if a in region.mesh.axis_names]
        hint = f"; {auto} stay automatic in this region: name them in shard_map's axis_names" if auto else ""
        raise ValueError(f"sr.{what} runs over mesh axes that are manual in the enclosing shard_map "
                         f"{region.manual}, each once; got axis_name={axis_name!r}{hint}")
    return region, axes


def _dim(dim: int, x: Tensor, what: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"sr.{what} needs a dim of its operand {x.node.spec}; got {dim}")
    return dim % x.ndim


def _divisible(x: Tensor, dim: int, k: int, what: str, axes) -> None:
    if x.shape[dim] % k:
        raise ValueError(f"sr.{what} splits dim {dim} of its block into {k} equal parts (the size of {axes}); "
                         f"got a block {x.node.spec}, whose dim {dim} is not divisible by {k}")


# ---------------------------------------------------------------- the collectives (traced)
def _reduce(x, axis_name, op: str):
    x = core.asarray(x)
    what = {"sum": "psum", "max": "pmax", "min": "pmin"}[op]
    _, axes = _enclosing(what, axis_name)
    if x.dtype.name not in REDUCIBLE:
        raise TypeError(f"sr.{what} reduces {', '.join(REDUCIBLE)} blocks; got {x.dtype.name} "
                        f"({x.node.spec}); cast first, e.g. x.astype('float32')")
    return emit(PSUM, [x], {"axes": axes, "op": op}, x.shape, x.dtype)


def psum(x, axis_name):
    """The sum of ``x`` over the shards along the manual ``axis_name`` (a name or a tuple), on every one."""
    return _reduce(x, axis_name, "sum")


def pmax(x, axis_name):
    """The elementwise max of ``x`` over the shards along ``axis_name``, on every one."""
    return _reduce(x, axis_name, "max")


def pmin(x, axis_name):
    """The elementwise min of ``x`` over the shards along ``axis_name``, on every one."""
    return _reduce(x, axis_name, "min")


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """The blocks along ``axis_name`` in shard order: stacked on a new dim ``axis`` (``tiled=False``, JAX's
    default) or concatenated along dim ``axis`` (``tiled=True``)."""
    x = core.asarray(x)
    region, axes = _enclosing("all_gather", axis_name)
    if not tiled:
        x = core.expand_dims(x, axis)
    dim = _dim(axis, x, "all_gather")
    shape = list(x.shape)
    shape[dim] *= region.mesh.axis_size(axes)
    return emit(PALL_GATHER, [x], {"axes": axes, "dim": dim}, tuple(shape), x.dtype)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False):
    """The sum over ``axis_name``, of which shard i keeps block i along ``scatter_dimension`` (``tiled=True``)
    or index i of it (``tiled=False``: that dim must equal the axis size and is removed)."""
    x = core.asarray(x)
    region, axes = _enclosing("psum_scatter", axis_name)
    if x.dtype.name not in REDUCIBLE:
        raise TypeError(f"sr.psum_scatter reduces {', '.join(REDUCIBLE)} blocks; got {x.dtype.name} "
                        f"({x.node.spec}); cast first")
    dim, k = _dim(scatter_dimension, x, "psum_scatter"), region.mesh.axis_size(axes)
    if not tiled and x.shape[dim] != k:
        raise ValueError(f"sr.psum_scatter(tiled=False) needs scatter_dimension's size to equal the shard count "
                         f"{k} of {axes}; got {x.node.spec} with dim {dim} of size {x.shape[dim]}")
    _divisible(x, dim, k, "psum_scatter", axes)
    shape = list(x.shape)
    shape[dim] //= k
    out = emit(PSUM_SCATTER, [x], {"axes": axes, "dim": dim}, tuple(shape), x.dtype)
    return out if tiled else core.squeeze(out, dim)


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = True):
    """Block j of ``x`` along ``split_axis`` goes to shard j; the received blocks are concatenated along
    ``concat_axis`` in source order (JAX's ``all_to_all(..., tiled=True)``)."""
    x = core.asarray(x)
    region, axes = _enclosing("all_to_all", axis_name)
    if not tiled:
        raise NotImplementedError("sr.all_to_all supports tiled=True (blocks concatenated); got tiled=False")
    split, concat, k = _dim(split_axis, x, "all_to_all"), _dim(concat_axis, x, "all_to_all"), \
        region.mesh.axis_size(axes)
    _divisible(x, split, k, "all_to_all", axes)
    shape = list(x.shape)
    shape[split] //= k
    shape[concat] *= k
    return emit(PALL_TO_ALL, [x], {"axes": axes, "split_dim": split, "concat_dim": concat}, tuple(shape), x.dtype)


def ppermute(x, axis_name, perm):
    """Shard ``src`` sends its ``x`` to shard ``dst`` for each (src, dst) in ``perm`` (shard numbers along
    ``axis_name``); a shard nobody sends to gets zeros."""
    x = core.asarray(x)
    region, axes = _enclosing("ppermute", axis_name)
    k = region.mesh.axis_size(axes)
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or not all(0 <= v < k for v in srcs + dsts):
        raise ValueError(f"sr.ppermute needs (source, destination) pairs of shard numbers in [0, {k}) along "
                         f"{axes}, each source and each destination once; got perm={list(perm)}")
    return emit(PPERMUTE, [x], {"axes": axes, "perm": pairs}, x.shape, x.dtype)


def pbroadcast(x, axis_name):
    """``x`` unchanged, typed as varying over ``axis_name`` (inserted for you where needed; its transpose is psum)."""
    x = core.asarray(x)
    _, axes = _enclosing("pbroadcast", axis_name)
    return emit(PBROADCAST, [x], {"axes": axes}, x.shape, x.dtype)


def axis_index(axis_name):
    """This shard's number along ``axis_name`` (an int32 scalar; major first over a tuple of axes)."""
    _, axes = _enclosing("axis_index", axis_name)
    return emit(AXIS_INDEX, [], {"axes": axes}, (), "int32")


# ---------------------------------------------------------------- shard_map (traced)
def shard_map(f, mesh: Mesh | None = None, in_specs=None, out_specs=None, axis_names=None):
    """``f`` run per shard on local blocks, inside a traced, auto-partitioned function.

    ``in_specs`` / ``out_specs``: ``P`` specs (or None: replicated) naming manual axes, one per argument /
    output, or pytrees of them matching the arguments / outputs (a spec applies to every leaf below it).
    Splits must be even. ``axis_names``: the manual axes (default: every axis of ``mesh``, the context mesh
    when None); the others stay automatic. An output not split over a manual axis is taken from shard 0
    along it (each shard is assumed to hold the same value, unchecked; the gradient is that of shard 0's)."""
    def wrapped(*args):
        m = mesh if mesh is not None else get_mesh(required_by="sr.shard_map")
        manual = _manual_axes(m, axis_names)
        leaves, tree = leaves_as_tensors(args)
        specs = _leaf_specs(in_specs, tree, "in_specs")
        in_sh = [_parse(s, m, manual, x.shape, f"in_specs of argument leaf {k} {x.node.spec}")
                 for k, (s, x) in enumerate(zip(specs, leaves))]
        outs, out_tree = trace_region(lambda *p: f(*pytree_unflatten(tree, p)), m, manual, leaves, in_sh,
                                      lambda out_def: _leaf_specs(out_specs, out_def, "out_specs"))
        return pytree_unflatten(out_tree, outs)
    wrapped.__name__ = f"shard_map_{getattr(f, '__name__', 'fn')}"
    return wrapped


def _manual_axes(mesh: Mesh, axis_names) -> tuple[str, ...]:
    names = mesh.axis_names if axis_names is None else \
        ((axis_names,) if isinstance(axis_names, str) else tuple(axis_names))
    bad = [a for a in names if a not in mesh.axis_names]
    if bad or not names:
        raise ValueError(f"shard_map's axis_names are axes of its mesh {mesh}; got {axis_names!r}")
    return tuple(a for a in mesh.axis_names if a in names)


def _leaf_specs(specs, treedef, what: str) -> list:
    """One spec per leaf: ``specs`` is a pytree prefix of the value whose structure is ``treedef``."""
    if specs is None or isinstance(specs, (P, Sharding)):
        return [specs] * _leaf_count(treedef)
    if treedef == "leaf" or treedef is None:
        raise ValueError(f"shard_map's {what} gives a P (or None) per array; got {specs!r} where the value is "
                         f"{'an array' if treedef == 'leaf' else 'None'}")
    kind, children = treedef
    if kind is dict:
        if not isinstance(specs, dict) or sorted(specs) != [k for k, _ in children]:
            raise ValueError(f"shard_map's {what} must match the value's dict keys {[k for k, _ in children]}; "
                             f"got {specs!r}")
        return [s for k, c in children for s in _leaf_specs(specs[k], c, what)]
    if not isinstance(specs, (tuple, list)) or len(specs) != len(children):
        raise ValueError(f"shard_map's {what} needs one spec per element of a {kind.__name__} of {len(children)}; "
                         f"got {specs!r} (a spec is a P; use P() or None for a replicated one)")
    return [s for spec, c in zip(specs, children) for s in _leaf_specs(spec, c, what)]


def _leaf_count(treedef) -> int:
    if treedef is None or treedef == "leaf":
        return int(treedef == "leaf")
    kind, children = treedef
    return sum(_leaf_count(c[1] if kind is dict else c) for c in children)


def _parse(spec, mesh: Mesh, manual, shape, what: str) -> Sharding:
    s = Sharding.replicated(len(shape)) if spec is None else parse_spec(spec, mesh, len(shape), what)
    auto = [a for a in s.axes + s.partial if a not in manual]
    if s.partial or auto:
        raise ValueError(f"a shard_map spec splits dims over manual axes {manual} only (no partial); got {spec!r} "
                         f"for {what}")
    return s


def _local(shape, s: Sharding, mesh: Mesh, what: str) -> tuple[int, ...]:
    for d, (n, axes) in enumerate(zip(shape, s.dims)):
        if n % mesh.axis_size(axes):
            raise ValueError(f"shard_map splits evenly: {what} splits dim {d} over {axes} "
                             f"({mesh.axis_size(axes)} shards); got size {n}, not divisible (pad it first)")
    return s.local_shape(tuple(shape), mesh)


def trace_region(flat_fn, mesh, manual, leaves, in_sh, out_specs_for):
    """Trace ``flat_fn(*blocks)`` as a region body and emit the region; returns (result tensors, out treedef).
    ``out_specs_for(out_treedef)`` gives one spec (or Sharding) per output leaf."""
    local = [TensorSpec(_local(x.shape, s, mesh, f"argument leaf {k} {x.node.spec}"), x.dtype)
             for k, (x, s) in enumerate(zip(leaves, in_sh))]
    stack = _regions.__dict__.setdefault("stack", [])
    if stack:
        raise NotImplementedError("a shard_map inside another shard_map's body is not supported; got a nested "
                                  "call (merge the regions, or name more axes in the outer one's axis_names)")
    stack.append(Region(mesh, manual, current_graph()))
    try:
        body, out_def = trace_body(flat_fn, local, [f"block{k}" for k in range(len(local))], "a shard_map body")
    finally:
        stack.pop()
    _check_body_annotations(body, manual)
    out_sh = [_parse(s, mesh, manual, body.nodes[o].shape, f"out_specs of output leaf {k} {body.nodes[o].spec}")
              for k, (s, o) in enumerate(zip(out_specs_for(out_def), body.outputs))]
    body, out_varying = _typed(body, in_sh, out_sh, mesh, manual)
    results = [TensorSpec(tuple(n * mesh.axis_size(axes) for n, axes in zip(body.nodes[o].shape, s.dims)),
                          body.nodes[o].dtype) for o, s in zip(body.outputs, out_sh)]
    captured = [Tensor(current_graph(), c) for c in body.captured]
    in_sh = list(in_sh) + [Sharding.replicated(t.ndim) for t in captured]  # closed-over values: whole on every shard
    node = emit(SHARD_MAP, leaves + captured, {"body": body, "mesh": mesh, "manual": manual, "in_specs": tuple(in_sh),
                                               "out_specs": tuple(out_sh), "results": tuple(results),
                                               "out_varying": out_varying},
                (), "float32")
    return [emit(LOOP_OUT, [node], {"index": k}, s.shape, s.dtype) for k, s in enumerate(results)], out_def


def _typed(body, in_sh, out_sh, mesh, manual) -> tuple[BodyGraph, tuple]:
    """``body`` re-emitted with a ``pbroadcast`` wherever a value the same along some manual axes meets one that
    varies over them (so every transpose is exact), and per output the manual axes it varies over though its
    out_spec does not split it (its forward value is shard 0's there)."""
    size1 = {a for a in manual if mesh.axis_size(a) == 1}  # nothing varies over a single shard
    typed = BodyGraph(parent=body.parent)
    typed.captured, env, vary, widened = list(body.captured), {}, {}, {}
    with tracing(typed):
        for k, p in enumerate(body.params):
            t = typed.add_param(body.nodes[p].spec, body.param_names[k])
            env[p], vary[t.id] = t, frozenset(in_sh[k].axes) - size1 if k < len(in_sh) else frozenset()
        typed.param_of = {c: env[body.param_of[c]].id for c in body.captured}

        def widen(t, want):
            missing = tuple(a for a in manual if a in want - vary[t.id])
            if not missing or not is_floating(t.dtype):
                return t
            if (t.id, missing) not in widened:
                widened[t.id, missing] = out = emit(PBROADCAST, [t], {"axes": missing}, t.shape, t.dtype)
                vary[out.id] = vary[t.id] | set(missing)
            return widened[t.id, missing]

        for node in body.nodes:
            if node.id in env:
                continue
            ins = [env[i] for i in node.inputs]
            axes = frozenset(node.attrs.get("axes", ())) - size1 if node.op in GROUP_OPS else frozenset()
            if node.op in (op.name for op in COLLECTIVES):
                ins = [widen(ins[0], vary[ins[0].id] | axes)]
            want = frozenset().union(*(vary[t.id] for t in ins))
            ins = [widen(t, want) for t in ins]
            out = emit(node.op, ins, dict(node.attrs), node.shape, node.dtype)
            vary[out.id] = (want - axes) if node.op == PSUM.name else (want | axes)
            env[node.id] = out
    typed.outputs = [env[o].id for o in body.outputs]
    return typed, tuple(tuple(a for a in manual if a in vary[o] - set(s.axes)) for o, s in zip(typed.outputs, out_sh))


def _check_body_annotations(body, manual):
    for n in body.nodes:
        if n.op == core.MESH_SPLIT.name and set(n.attrs["sharding"].axes + n.attrs["sharding"].partial) & set(manual):
            raise ValueError(f"inside a shard_map body, mesh_split may name only automatic axes (not {manual}); "
                             f"got {n.attrs['sharding']} on %{n.id} {n.spec}")


# ---------------------------------------------------------------- the reference: shards in lockstep
class Shards:
    """The shards of a region: one per combination of manual-axis coordinates (row-major over ``manual``)."""

    def __init__(self, mesh: Mesh, manual):
        self.mesh, self.manual = mesh, tuple(manual)
        sizes = [mesh.axis_size(a) for a in self.manual]
        self.coords = [dict(zip(self.manual, c)) for c in product(*map(range, sizes))]

    def __len__(self):
        return len(self.coords)

    def index(self, s: int, axes) -> int:
        """Shard ``s``'s number along ``axes`` (major first), as ``Mesh.index_along``."""
        i = 0
        for a in axes:
            i = i * self.mesh.axis_size(a) + self.coords[s][a]
        return i

    def groups(self, axes) -> list[list[int]]:
        """The shards that share every coordinate off ``axes``, each group ordered by its number along them."""
        out = {}
        for s in range(len(self)):
            key = tuple(self.coords[s][a] for a in self.manual if a not in axes)
            out.setdefault(key, []).append(s)
        return [sorted(g, key=lambda s: self.index(s, axes)) for g in out.values()]

    def block(self, s: int, sharding: Sharding, shape) -> tuple[slice, ...]:
        out = []
        for n, axes in zip(shape, sharding.dims):
            b = n // self.mesh.axis_size(axes)
            i = self.index(s, axes)
            out.append(slice(i * b, (i + 1) * b))
        return tuple(out)


def run_shards(body, args: list[list], shards: Shards, xp) -> list[list]:
    """``body`` on every shard in lockstep: ``args[p][s]`` is parameter p's block on shard s; returns the
    outputs' blocks the same way. Group ops run across the shards, every other op shard by shard."""
    env = dict(zip(body.params, args))
    for node in body.nodes:
        if node.id in env:
            continue
        ins = [env[i] for i in node.inputs]
        if node.op in GROUP_OPS:
            env[node.id] = opdef.lookup(node.op).kernel(xp, *ins, shards=shards, **node.attrs)
        else:
            kernel = opdef.lookup(node.op).kernel
            env[node.id] = [kernel(xp, *[x[s] for x in ins], **node.attrs) for s in range(len(shards))]
    return [env[o] for o in body.outputs]


# ``mesh``, the specs and ``results`` are graph attributes; a program's region instruction (run by its binder) has
# only its partitioned body and the manual axes
@opdef.kernel(SHARD_MAP)
def _shard_map_kernel(xp, *operands, body, manual, mesh=None, in_specs=(), out_specs=(), results=(), out_varying=()):
    shards = Shards(mesh, manual)
    args = [[x[shards.block(s, spec, x.shape)] for s in range(len(shards))] for x, spec in zip(operands, in_specs)]
    outs = []
    for blocks, spec, res in zip(run_shards(body, args, shards, xp), out_specs, results):
        out = xp.empty(res.shape, res.dtype)
        for s in range(len(shards)):  # an unsplit manual axis: shard 0's block along it
            if all(shards.coords[s][a] == 0 for a in manual if a not in spec.axes):
                out[shards.block(s, spec, res.shape)] = blocks[s]
        outs.append(out)
    return tuple(outs)


def _accumulate(xp, blocks, op):
    """The group's elementwise ``op``; 16-bit floats summed in float32 and rounded once, as on the wire."""
    stacked = xp.stack(blocks)
    if op == "sum":
        wide = stacked.astype("float32") if is_low_precision(stacked.dtype) else stacked
        return wide.sum(axis=0).astype(stacked.dtype)
    return stacked.max(axis=0) if op == "max" else stacked.min(axis=0)


def _per_group(shards, axes, blocks, fn) -> list:
    """``fn(group blocks) -> group results`` over every group along ``axes``."""
    out = [None] * len(shards)
    for g in shards.groups(axes):
        for s, r in zip(g, fn([blocks[s] for s in g])):
            out[s] = r
    return out


@opdef.kernel(PSUM)
def _psum_group(xp, blocks, *, shards, axes, op):
    return _per_group(shards, axes, blocks, lambda bs: [_accumulate(xp, bs, op)] * len(bs))


@opdef.kernel(PALL_GATHER)
def _all_gather_group(xp, blocks, *, shards, axes, dim):
    return _per_group(shards, axes, blocks, lambda bs: [xp.concatenate(bs, axis=dim)] * len(bs))


@opdef.kernel(PSUM_SCATTER)
def _psum_scatter_group(xp, blocks, *, shards, axes, dim):
    return _per_group(shards, axes, blocks, lambda bs: xp.split(_accumulate(xp, bs, "sum"), len(bs), axis=dim))


@opdef.kernel(PALL_TO_ALL)
def _all_to_all_group(xp, blocks, *, shards, axes, split_dim, concat_dim):
    def exchange(bs):
        parts = [xp.split(b, len(bs), axis=split_dim) for b in bs]
        return [xp.concatenate([p[j] for p in parts], axis=concat_dim) for j in range(len(bs))]
    return _per_group(shards, axes, blocks, exchange)


@opdef.kernel(PPERMUTE)
def _ppermute_group(xp, blocks, *, shards, axes, perm):
    def send(bs):
        out = [xp.zeros_like(b) for b in bs]
        for src, dst in perm:
            out[dst] = bs[src]
        return out
    return _per_group(shards, axes, blocks, send)


@opdef.kernel(PBROADCAST)
def _pbroadcast_group(xp, blocks, *, shards, axes):
    return list(blocks)


@opdef.kernel(AXIS_INDEX)
def _axis_index_group(xp, *, shards, axes):
    return [xp.asarray(shards.index(s, axes), "int32") for s in range(len(shards))]


__all__ = ["shard_map", "psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute", "axis_index",
           "pbroadcast"]
