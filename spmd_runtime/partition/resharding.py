"""The one resharding planner: (source sharding, target sharding) -> collectives.

Every change of layout in a partitioned program is planned here, as a shortest path
over sharding states (DTensor's redistribute planner, GSPMD_NOTES.md section 3):
each state is a Sharding, each edge one step below, weighted by the cost model
(``cost.CostModel``: ring-formula wire bytes by default, GSPMD_NOTES.md section 5,
or alpha-beta seconds measured by ``python -m spmd_runtime calibrate``). The
greedy plan (the fixed order at the bottom of the table) bounds the search and is
kept whenever the search finds nothing strictly cheaper. Plans are cached per
(source, target, shape, mesh, itemsize, model).

Transition table (the search's edges; step: when -> emits):

| step        | when                                                          | emits                        |
|-------------|---------------------------------------------------------------|------------------------------|
| slice       | an axis the state does not use yet goes innermost on dim j    | shard_slice (no traffic)     |
| reduce      | partial axes go innermost on dim j                            | reduce_scatter along them    |
|             | every partial axis at once                                    | all_reduce along them        |
| gather      | dim i drops its innermost axes                                | all_gather                   |
| move        | the innermost axes of dim i go innermost on dim j             | all_to_all (split j, concat i)|
| permute     | every dim keeps its shard count (axes reordered, or the target| collective_permute           |
|             | itself), nothing to reduce                                    |                              |
| exchange    | straight to the target, nothing to reduce: each rank sends    | all_to_allv over the joint   |
|             | every other rank exactly the intersection of their blocks    | group (several dims at once) |

Greedy order (the bound): slice unused axes, reduce (reduce-scatter where the target
splits next), permute, move or gather innermost-first, slice.

Uneven dims (size n not divisible by the shards k): every shard holds ceil(n/k)
elements, padding at the end. A step that splits or joins the blocks of an already
split dim is only taken when the blocks line up (``fits``); otherwise the dim is
gathered whole and split again (or exchanged, which handles any blocks). An unsplit
dim is padded (``resize``) before a collective that cuts it into equal blocks, and
trimmed back after a gather.

A plan that gathers an axis and slices it again is a rematerialisation, reported in
``Plan.notes``.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..collective_kinds import KINDS
from ..cost import DEFAULT_MODEL, CostModel, active_model, group_size
from ..mesh import Mesh
from ..ops.spmd import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALLV, COLLECTIVE_PERMUTE, REDUCE_SCATTER, RESIZE,
                        SHARD_SLICE)
from ..sharding import Sharding
from .exchange import exchange_cost, receive_lower_bound

# Most states the search expands before it settles for the best plan found (or the greedy one).
SEARCH_LIMIT = 400


@dataclass(frozen=True)
class Step:
    op: str  # the name of a collective (collective_kinds.KINDS), of SHARD_SLICE or of RESIZE
    attrs: dict = field(hash=False)
    result: Sharding = None  # the layout after this step
    local: tuple = ()  # the local shape after this step (a gathered uneven dim is longer until trimmed)


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    notes: tuple[str, ...]
    cost: float = 0.0  # in the cost model's units (wire bytes per rank by default)


def plan_reshard(src: Sharding, dst: Sharding, shape: tuple[int, ...], mesh: Mesh, itemsize: int = 4,
                 model: CostModel | None = None) -> Plan:
    """The cheapest steps found that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``."""
    if not reachable(src, dst):
        raise ValueError(f"resharding can keep pending (partial) reductions as they are or complete them, not "
                         f"create them or change their axes; got {src} -> {dst} (a value declared partial over "
                         f"{','.join(dst.partial)} must come from a reduction over a dim split on those axes, or "
                         f"from an input declared so; declare it without partial= to get final values)")
    return _plan(src, dst, tuple(shape), mesh, int(itemsize), model or active_model())


def plan_cost(src: Sharding, dst: Sharding, shape, dtype, mesh: Mesh, model: CostModel | None = None) -> float:
    """Cost of the plan src -> dst (wire bytes per rank under the default model; the model of the partition()
    call in progress unless ``model`` is given)."""
    if src == dst:
        return 0.0
    if not reachable(src, dst):
        return math.inf  # a strategy that cannot end in the wanted layout is never chosen
    return plan_reshard(src, dst, shape, mesh, np.dtype(dtype).itemsize, model).cost


def reachable(src: Sharding, dst: Sharding) -> bool:
    """Whether a plan src -> dst exists: a pending reduction is kept as it is or completed, never created."""
    return not dst.partial or (dst.partial, dst.reduce_op) == (src.partial, src.reduce_op)


@lru_cache(maxsize=1 << 16)
def _plan(src, dst, shape, mesh, itemsize, model) -> Plan:
    greedy = _merge_gathers(_greedy(src, dst, shape, mesh))
    bound = _steps_cost(greedy, src.local_shape(shape, mesh), mesh, itemsize, model)
    steps, cost = greedy, bound
    if _worth_searching(greedy, src, dst, shape, mesh, bound / itemsize, model):
        found = _Search(src, dst, shape, mesh, itemsize, model).run(bound)
        if found is not None:
            steps, cost = tuple(_merge_gathers(found[0])), found[1]
    steps = tuple(steps)
    return Plan(steps, tuple(_notes(steps, src, dst, shape)), cost)


def _worth_searching(greedy, src, dst, shape, mesh, elements, model) -> bool:
    """Skip the search where the greedy plan is already the cheapest (most plans, keeping partitioning fast):
    one collective that slices nothing after it (slicing first is free), or, under the ring model, as few
    wire elements as the busiest rank must receive anyway (what it needs and does not hold)."""
    ops = [s.op for s in greedy if s.op != RESIZE.name]
    colls = [k for k, op in enumerate(ops) if op in KINDS]
    if not colls or (len(colls) == 1 and SHARD_SLICE.name not in ops[colls[0]:]):
        return False
    return src.partial or model != DEFAULT_MODEL or elements > receive_lower_bound(src.dims, dst.dims, shape, mesh)


def _greedy(src, dst, shape, mesh) -> list[Step]:
    p = _Planner(src, shape, mesh)
    p.slice_unused_axes(dst)
    if src.partial and not dst.partial:
        p.reduce(dst)
    if p.cur != dst and all(set(c) == set(d) for c, d in zip(p.cur.dims, dst.dims)):
        p.permute(dst)
    p.move_and_gather(dst)
    p.slice(dst)
    if p.cur != dst:
        raise AssertionError(f"internal: resharding plan ended at {p.cur}, not {dst} (from {src})")
    return p.steps


def _steps_cost(steps, local, mesh, itemsize, model) -> float:
    total = 0.0
    for s in steps:
        if s.op in KINDS:
            b_in, b_out = math.prod(local) * itemsize, math.prod(s.local) * itemsize
            total += model.collective(s.op, group_size(s.op, s.attrs, mesh), b_in, b_out, s.attrs.get("wire_bytes"))
        local = s.local
    return total


class _Search:
    """Dijkstra over sharding states from ``src`` to ``dst``; ties go to fewer collectives."""

    def __init__(self, src, dst, shape, mesh, itemsize, model):
        self.src, self.dst, self.shape, self.mesh, self.itemsize, self.model = src, dst, shape, mesh, itemsize, model
        self.axes = tuple(a for a in mesh.axis_names if a in set(src.axes + src.partial + dst.axes))

    def run(self, bound):
        """(steps, cost) of the cheapest plan strictly under ``bound``, or None."""
        limit = bound * (1 - 1e-9)
        tie = itertools.count()
        heap, done, best = [(0.0, 0, next(tie), self.src, [])], set(), {self.src: (0.0, 0)}
        while heap and len(done) < SEARCH_LIMIT:
            cost, ncoll, _, cur, steps = heapq.heappop(heap)
            if cur == self.dst:
                return steps, cost
            if cur in done:
                continue
            done.add(cur)
            local = cur.local_shape(self.shape, self.mesh)
            for edge in self.edges(cur):
                nxt = edge[-1].result
                c = cost + _steps_cost(edge, local, self.mesh, self.itemsize, self.model)
                key = (c, ncoll + sum(s.op in KINDS for s in edge))
                if c < limit and nxt not in done and key < best.get(nxt, (math.inf, 0)):
                    best[nxt] = key
                    heapq.heappush(heap, (*key, next(tie), nxt, steps + edge))
        return None

    def edges(self, cur):
        """Every single step out of ``cur``, each as the list of steps it emits (resizes included)."""
        p = lambda: _Planner(cur, self.shape, self.mesh)
        nd, dst = len(self.shape), self.dst
        if cur.partial and not dst.partial:
            yield _emitted(p(), lambda q: q.emit(ALL_REDUCE, partial=(), axes=cur.partial, op=cur.reduce_op))
            for n in range(1, len(cur.partial) + 1):
                for axes, j in itertools.product(itertools.permutations(cur.partial, n), range(nd)):
                    if p()._fits(j, cur.dims[j], axes):
                        yield _emitted(p(), lambda q: q.reduce_scatter(j, axes))
        busy = set(cur.axes + cur.partial)
        for j, a in itertools.product(range(nd), self.axes):
            if a not in busy and p()._fits(j, cur.dims[j], (a,)):
                yield _emitted(p(), lambda q: q.emit(SHARD_SLICE, q._append(j, (a,)), dim=j, axes=(a,)))
        for i in range(nd):
            for n in range(1, len(cur.dims[i]) + 1):
                keep, moving = cur.dims[i][:-n], cur.dims[i][-n:]
                if p()._fits(i, keep, moving):
                    yield _emitted(p(), lambda q: q.gather(i, keep))
                for j in range(nd):
                    if j != i and p()._fits(i, keep, moving) and p()._fits(j, cur.dims[j], moving):
                        yield _emitted(p(), lambda q: q.move(i, j, moving))
        if cur.partial == dst.partial or not dst.partial:
            yield from self.permutes(cur, p)
        if (cur.partial, cur.reduce_op) == (dst.partial, dst.reduce_op) or not (cur.partial or dst.partial):
            yield _emitted(p(), lambda q: q.exchange(dst, self.itemsize))

    def permutes(self, cur, p):
        """Reorder the axes within dims, or jump to a target with the same shard counts per dim."""
        targets = {Sharding(dims, cur.partial, cur.reduce_op)
                   for dims in itertools.product(*(itertools.permutations(d) for d in cur.dims))} - {cur}
        same_counts = [self.mesh.axis_size(c) for c in cur.dims] == [self.mesh.axis_size(d) for d in self.dst.dims]
        if same_counts and set(self.dst.axes) == set(cur.axes) and self.dst.partial == cur.partial and self.dst != cur:
            targets.add(self.dst)
        for t in sorted(targets, key=str):
            yield _emitted(p(), lambda q: q.permute(t))


def _emitted(planner, action) -> list[Step]:
    action(planner)
    return planner.steps


def fits(n: int, outer: int, inner: int) -> bool:
    """Whether splitting each of ``outer`` blocks of a dim of size n into ``inner`` blocks gives the
    canonical blocks of ``outer * inner`` shards (block i = [i*c, (i+1)*c), c = ceil(n / shards)).

    Always true for even splits; for an unsplit dim (outer == 1) the planner pads or trims locally
    (``resize``); otherwise an uneven dim must be gathered whole and split again.
    """
    return outer == 1 or inner * -(-n // (outer * inner)) == -(-n // outer)


class _Planner:
    def __init__(self, src: Sharding, shape: tuple[int, ...], mesh: Mesh):
        self.cur, self.shape, self.mesh, self.steps = src, shape, mesh, []
        self.local = src.local_shape(shape, mesh)

    def emit(self, kind, dims=None, partial=None, local=None, **attrs):
        """A step of ``kind`` (an op record) to the layout ``dims`` / ``partial`` (default: as now)."""
        dims = self.cur.dims if dims is None else dims
        partial = self.cur.partial if partial is None else partial
        self.cur = Sharding(tuple(dims), tuple(partial), self.cur.reduce_op if partial else "sum")
        self.local = tuple(local) if local is not None else self.cur.local_shape(self.shape, self.mesh)
        self.steps.append(Step(kind.name, attrs, self.cur, self.local))

    def _scaled(self, dim, factor=1, divisor=1) -> list[int]:
        local = list(self.local)
        local[dim] = local[dim] * factor // divisor
        return local

    def k(self, axes) -> int:
        return self.mesh.axis_size(axes)

    def _fits(self, dim, outer, inner) -> bool:
        return fits(self.shape[dim], self.k(outer), self.k(inner))

    def _resize(self, dim, size):
        """Pad (zeros) or trim an unsplit dim locally so a collective sees equal blocks, or the true size."""
        if self.local[dim] != size:
            local = list(self.local)
            local[dim] = size
            self.emit(RESIZE, local=local, dim=dim, size=size)

    def _padded(self, dim, inner) -> int:
        """Local size of unsplit ``dim`` padded to ``inner`` equal blocks."""
        return self.k(inner) * -(-self.shape[dim] // self.k(inner))

    def _appendable(self, dst, j):
        """Axes dst adds after cur's dim j, or None when cur's dim j is not a prefix of dst's."""
        c, d = self.cur.dims[j], dst.dims[j]
        return d[len(c):] if d[:len(c)] == c else None

    def _append(self, j, axes):
        return [d + tuple(axes) if i == j else d for i, d in enumerate(self.cur.dims)]

    def slice_unused_axes(self, dst):
        for j in range(len(dst.dims)):
            busy = set(self.cur.axes) | set(self.cur.partial)
            add = _prefix_while(self._appendable(dst, j) or (), lambda a: a not in busy)
            if add and self._fits(j, self.cur.dims[j], add):
                self.emit(SHARD_SLICE, self._append(j, add), dim=j, axes=add)

    def reduce(self, dst):
        for j in range(len(dst.dims)):
            add = _prefix_while(self._appendable(dst, j) or (), lambda a: a in self.cur.partial)
            if add and self._fits(j, self.cur.dims[j], add):
                self.reduce_scatter(j, add)
        if self.cur.partial:
            self.emit(ALL_REDUCE, partial=(), axes=self.cur.partial, op=self.cur.reduce_op)

    def reduce_scatter(self, j, axes):
        """Partial sums over ``axes`` reduced and scattered innermost on dim j."""
        if self.k(self.cur.dims[j]) == 1:
            self._resize(j, self._padded(j, axes))
        rest = tuple(a for a in self.cur.partial if a not in axes)
        self.emit(REDUCE_SCATTER, self._append(j, axes), rest, self._scaled(j, 1, self.k(axes)),
                  axes=axes, dim=j, op=self.cur.reduce_op)

    def permute(self, dst):
        self.emit(COLLECTIVE_PERMUTE, dst.dims, pairs=permute_pairs(self.cur, dst, self.mesh))

    def move_and_gather(self, dst):
        while any(self._removed(dst, i) for i in range(len(dst.dims))):
            if not self._try_move(dst):
                i = next(i for i in range(len(dst.dims)) if self._removed(dst, i))
                outer = self.cur.dims[i][:-1]
                self.gather(i, outer if self._fits(i, outer, self.cur.dims[i][-1:]) else ())

    def gather(self, i, keep):
        """all_gather dim i down to its leading axes ``keep`` (trimmed to the true size when unsplit)."""
        axes = self.cur.dims[i][len(keep):]
        self.emit(ALL_GATHER, [keep if k == i else d for k, d in enumerate(self.cur.dims)],
                  local=self._scaled(i, self.k(axes)), axes=axes, dim=i)
        if self.k(keep) == 1:
            self._resize(i, self.shape[i])

    def _removed(self, dst, i):
        c, d = self.cur.dims[i], dst.dims[i]
        n = next((k for k in range(min(len(c), len(d))) if c[k] != d[k]), min(len(c), len(d)))
        return c[n:]

    def _try_move(self, dst) -> bool:
        for i in range(len(dst.dims)):
            removed = self._removed(dst, i)
            for n in range(len(removed), 0, -1):
                moving, rest = self.cur.dims[i][-n:], self.cur.dims[i][:-n]
                for j in range(len(dst.dims)):
                    add = self._appendable(dst, j)
                    if j != i and add is not None and add[:n] == moving and self._fits(i, rest, moving) \
                            and self._fits(j, self.cur.dims[j], moving):
                        self.move(i, j, moving)
                        return True
        return False

    def move(self, i, j, moving):
        """all_to_all: ``moving`` (innermost axes of dim i) go to split dim j instead."""
        if self.k(self.cur.dims[j]) == 1:
            self._resize(j, self._padded(j, moving))
        dims = [d[:-len(moving)] if k == i else d + moving if k == j else d for k, d in enumerate(self.cur.dims)]
        local = self._scaled(j, 1, self.k(moving))
        local[i] *= self.k(moving)
        self.emit(ALL_TO_ALL, dims, local=local, axes=moving, split_dim=j, concat_dim=i)
        if self.k(self.cur.dims[i]) == 1:
            self._resize(i, self.shape[i])

    def slice(self, dst):
        for j in range(len(dst.dims)):
            add = self._appendable(dst, j)
            if add and not self._fits(j, self.cur.dims[j], add):
                self.gather(j, ())
                add = dst.dims[j]
            if add:
                self.emit(SHARD_SLICE, self._append(j, add), dim=j, axes=add)

    def exchange(self, dst, itemsize):
        """all_to_allv: every rank sends each other rank the intersection of their blocks, all dims at once."""
        cost = exchange_cost(self.cur.dims, dst.dims, self.shape, self.mesh, self.cur.partial)
        self.emit(ALL_TO_ALLV, dst.dims, axes=cost.axes, src_dims=self.cur.dims, dst_dims=dst.dims,
                  partial_axes=self.cur.partial, wire_bytes=cost.busiest * itemsize)


def _notes(steps, src, dst, shape) -> list[str]:
    gathered = {a for s in steps if s.op == ALL_GATHER.name for a in s.attrs["axes"]}
    sliced = {a for s in steps if s.op == SHARD_SLICE.name for a in s.attrs["axes"]}
    again = sorted(gathered & sliced)
    return [f"resharding {list(shape)} from {src} to {dst} gathers and re-slices mesh axes {again} "
            f"(a rematerialisation)"] if again else []


def _prefix_while(axes, keep) -> tuple[str, ...]:
    out = []
    for a in axes:
        if not keep(a):
            break
        out.append(a)
    return tuple(out)


def _merge_gathers(steps: list[Step]) -> list[Step]:
    """all_gather(dim i, b) then all_gather(dim i, a) == one all_gather(dim i, (a, b)): same bytes, one call.
    (Only the last gather of a dim can be followed by a resize, so merging never skips one.)"""
    out: list[Step] = []
    for s in steps:
        prev = out[-1] if out else None
        if prev and s.op == prev.op == ALL_GATHER.name and s.attrs["dim"] == prev.attrs["dim"]:
            out[-1] = Step(ALL_GATHER.name, {"axes": s.attrs["axes"] + prev.attrs["axes"], "dim": s.attrs["dim"]},
                           s.result, s.local)
        else:
            out.append(s)
    return out


def permute_pairs(src: Sharding, dst: Sharding, mesh: Mesh) -> list[tuple[int, int]]:
    """(sender, receiver) world ranks so that each shard lands where ``dst`` places it: rank r sends to the rank
    whose ``dst`` shard index along each dim (and coordinates on the other axes) equal r's under ``src``.
    Vectorised over the ranks (the resharding search prices a permute per edge: a per-rank Python loop made
    it most of a 1536-rank partition); ``_shard_keys`` numbers those indices in one mixed radix."""
    coords = dict(zip(mesh.axis_names, np.unravel_index(np.arange(mesh.size), mesh.shape)))
    src_keys, src_radix = _shard_keys(src, mesh, coords)
    dst_keys, dst_radix = _shard_keys(dst, mesh, coords)
    if src_radix != dst_radix:
        raise ValueError(f"a collective_permute keeps the shard count of each dim; got {src} -> {dst} on {mesh}")
    ranks = np.asarray(mesh.devices)
    holder = np.empty(mesh.size, dtype=np.int64)
    holder[dst_keys] = ranks
    order = np.argsort(ranks, kind="stable")
    return list(zip(ranks[order].tolist(), holder[src_keys[order]].tolist()))


def _shard_keys(s: Sharding, mesh: Mesh, coords: dict) -> tuple[np.ndarray, tuple]:
    """Per mesh position: its shard index along each dim of ``s``, then its coordinates on the axes ``s`` does
    not use, as one mixed-radix number (a bijection onto 0..size-1), and the radices (the components' sizes)."""
    groups = [tuple(d) for d in s.dims] + [(a,) for a in mesh.axis_names if a not in s.axes]
    keys, radix = np.zeros(mesh.size, dtype=np.int64), []
    for axes in groups:
        radix.append(math.prod(mesh.axis_size(a) for a in axes))
        for a in axes:
            keys = keys * mesh.axis_size(a) + coords[a]
    return keys, tuple(radix)


def window_exchange(src: Sharding, dst_dims, shape, mesh: Mesh, maps, itemsize: int, fill=0) -> dict:
    """Attributes of one all_to_allv that moves, for every target block of ``dst_dims``, exactly the source
    entries ``maps`` sends it (see ``exchange.window_parts``): a slice, pad or shift along split dims as one exchange
    of the rows that change owner instead of a gather. Cost: its ``wire_bytes``."""
    maps = tuple(None if m is None else tuple(int(v) for v in m) for m in maps)
    dst_dims = tuple(map(tuple, dst_dims))
    cost = exchange_cost(src.dims, dst_dims, tuple(shape), mesh, src.partial, maps)
    return {"axes": cost.axes, "src_dims": src.dims, "dst_dims": dst_dims, "partial_axes": src.partial,
            "maps": maps, "fill": fill, "wire_bytes": cost.busiest * itemsize}
