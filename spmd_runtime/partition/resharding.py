"""The one resharding planner: (source sharding, target sharding) -> collectives.

Every change of layout in a partitioned program is planned here. Transition
table, applied in this order (GSPMD_NOTES.md section 3; cost per rank in
section 5, ``wire_bytes``):

| step       | when                                                        | emits                      |
|------------|-------------------------------------------------------------|----------------------------|
| 1 slice    | target appends to dim j axes the source does not use at all | shard_slice (no traffic)   |
| 2 reduce   | source partial on axes the target appends to dim j next     | reduce_scatter along them  |
|            | source partial on other axes                                | all_reduce along them      |
| 3 permute  | every dim keeps its set of axes, in another order           | collective_permute         |
| 4 move     | innermost axes of dim i are the next axes target appends to | all_to_all along them      |
|            | dim j                                                       |   (split j, concat i)      |
| 5 gather   | target drops axes from dim i and no move applies            | all_gather, innermost axis |
|            |                                                             |   first; runs merged       |
| 6 slice    | target appends axes to dim j                                | shard_slice (no traffic)   |

Slicing early (1) shrinks what later reductions and gathers move; reduce-scatter
(2) moves half the bytes of all-reduce + slice. A plan that gathers an axis and
slices it again is a rematerialisation, reported in ``Plan.notes``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..mesh import Mesh
from ..cost import COLLECTIVES, group_size, wire_bytes
from ..sharding import Sharding



@dataclass(frozen=True)
class Step:
    op: str  # one of COLLECTIVES or "shard_slice"
    attrs: dict = field(hash=False)
    result: Sharding = None  # the layout after this step


@dataclass
class Plan:
    steps: list[Step]
    notes: list[str]


def plan_reshard(src: Sharding, dst: Sharding, shape: tuple[int, ...], mesh: Mesh) -> Plan:
    """The steps that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``."""
    if dst.partial and (dst.partial, dst.reduce_op) != (src.partial, src.reduce_op):
        raise ValueError(f"resharding can only keep partial sums as they are, not create them; got {src} -> {dst}")
    p = _Planner(src, mesh)
    p.slice_unused_axes(dst)
    if src.partial and not dst.partial:
        p.reduce(dst)
    if p.cur != dst and all(set(c) == set(d) for c, d in zip(p.cur.dims, dst.dims)):
        p.permute(dst)
    p.move_and_gather(dst)
    p.slice(dst)
    if p.cur != dst:
        raise AssertionError(f"internal: resharding plan ended at {p.cur}, not {dst} (from {src})")
    return Plan(_merge_gathers(p.steps), p.notes(src, dst, shape))


class _Planner:
    def __init__(self, src: Sharding, mesh: Mesh):
        self.cur, self.mesh, self.steps = src, mesh, []

    def emit(self, kind, dims=None, partial=None, **attrs):
        dims = self.cur.dims if dims is None else dims
        partial = self.cur.partial if partial is None else partial
        self.cur = Sharding(tuple(dims), tuple(partial), self.cur.reduce_op if partial else "sum")
        self.steps.append(Step(kind, attrs, self.cur))

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
            if add:
                self.emit("shard_slice", self._append(j, add), dim=j, axes=add)

    def reduce(self, dst):
        op = self.cur.reduce_op
        for j in range(len(dst.dims)):
            add = _prefix_while(self._appendable(dst, j) or (), lambda a: a in self.cur.partial)
            if add:
                rest = tuple(a for a in self.cur.partial if a not in add)
                self.emit("reduce_scatter", self._append(j, add), rest, axes=add, dim=j, op=op)
        if self.cur.partial:
            self.emit("all_reduce", partial=(), axes=self.cur.partial, op=op)

    def permute(self, dst):
        self.emit("collective_permute", dst.dims, pairs=permute_pairs(self.cur, dst, self.mesh))

    def move_and_gather(self, dst):
        while any(self._removed(dst, i) for i in range(len(dst.dims))):
            if not self._try_move(dst):
                i = next(i for i in range(len(dst.dims)) if self._removed(dst, i))
                axis = self.cur.dims[i][-1:]
                self.emit("all_gather", [d[:-1] if k == i else d for k, d in enumerate(self.cur.dims)],
                          axes=axis, dim=i)

    def _removed(self, dst, i):
        c, d = self.cur.dims[i], dst.dims[i]
        n = next((k for k in range(min(len(c), len(d))) if c[k] != d[k]), min(len(c), len(d)))
        return c[n:]

    def _try_move(self, dst) -> bool:
        for i in range(len(dst.dims)):
            removed = self._removed(dst, i)
            for n in range(len(removed), 0, -1):
                moving = self.cur.dims[i][-n:]
                for j in range(len(dst.dims)):
                    add = self._appendable(dst, j)
                    if j != i and add is not None and add[:n] == moving:
                        dims = [d[:-n] if k == i else d + moving if k == j else d
                                for k, d in enumerate(self.cur.dims)]
                        self.emit("all_to_all", dims, axes=moving, split_dim=j, concat_dim=i)
                        return True
        return False

    def slice(self, dst):
        for j in range(len(dst.dims)):
            add = self._appendable(dst, j)
            if add:
                self.emit("shard_slice", self._append(j, add), dim=j, axes=add)

    def notes(self, src, dst, shape) -> list[str]:
        gathered = {a for s in self.steps if s.op == "all_gather" for a in s.attrs["axes"]}
        sliced = {a for s in self.steps if s.op == "shard_slice" for a in s.attrs["axes"]}
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
    """all_gather(dim i, b) then all_gather(dim i, a) == one all_gather(dim i, (a, b)): same bytes, one call."""
    out: list[Step] = []
    for s in steps:
        prev = out[-1] if out else None
        if prev and s.op == prev.op == "all_gather" and s.attrs["dim"] == prev.attrs["dim"]:
            out[-1] = Step("all_gather", {"axes": s.attrs["axes"] + prev.attrs["axes"], "dim": s.attrs["dim"]},
                           s.result)
        else:
            out.append(s)
    return out


def permute_pairs(src: Sharding, dst: Sharding, mesh: Mesh) -> list[tuple[int, int]]:
    """(sender, receiver) world ranks so that each shard lands where ``dst`` places it."""
    def key(rank, s):
        rest = tuple(mesh.coords(rank)[a] for a in mesh.axis_names if a not in s.axes)
        return tuple(mesh.index_along(rank, d) for d in s.dims) + rest
    holder = {key(r, dst): r for r in mesh.devices}
    return [(r, holder[key(r, src)]) for r in sorted(mesh.devices)]


def plan_cost(src: Sharding, dst: Sharding, shape, dtype, mesh: Mesh) -> float:
    """Total wire bytes of the plan src -> dst."""
    if src == dst:
        return 0.0
    itemsize, total, cur = np.dtype(dtype).itemsize, 0.0, src
    for s in plan_reshard(src, dst, tuple(shape), mesh).steps:
        b_in = int(np.prod(cur.local_shape(shape, mesh))) * itemsize
        b_out = int(np.prod(s.result.local_shape(shape, mesh))) * itemsize
        total += wire_bytes(s.op, group_size(s.op, s.attrs, mesh), b_in, b_out)
        cur = s.result
    return total
