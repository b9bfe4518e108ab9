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

Uneven dims (size n not divisible by the shards k): every shard holds ceil(n/k)
elements, padding at the end. A step that splits or joins the blocks of an already
split dim is only taken when the blocks line up (``fits``); otherwise the dim is
gathered whole and split again. An unsplit dim is padded (``resize``) before a
collective that cuts it into equal blocks, and trimmed back after a gather.

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
    op: str  # one of COLLECTIVES, "shard_slice" or "resize"
    attrs: dict = field(hash=False)
    result: Sharding = None  # the layout after this step
    local: tuple = ()  # the local shape after this step (a gathered uneven dim is longer until trimmed)


@dataclass
class Plan:
    steps: list[Step]
    notes: list[str]


def plan_reshard(src: Sharding, dst: Sharding, shape: tuple[int, ...], mesh: Mesh) -> Plan:
    """The steps that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``."""
    if dst.partial and (dst.partial, dst.reduce_op) != (src.partial, src.reduce_op):
        raise ValueError(f"resharding can only keep partial sums as they are, not create them; got {src} -> {dst}")
    p = _Planner(src, tuple(shape), mesh)
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
        dims = self.cur.dims if dims is None else dims
        partial = self.cur.partial if partial is None else partial
        self.cur = Sharding(tuple(dims), tuple(partial), self.cur.reduce_op if partial else "sum")
        self.local = tuple(local) if local is not None else self.cur.local_shape(self.shape, self.mesh)
        self.steps.append(Step(kind, attrs, self.cur, self.local))

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
            self.emit("resize", local=local, dim=dim, size=size)

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
                self.emit("shard_slice", self._append(j, add), dim=j, axes=add)

    def reduce(self, dst):
        op = self.cur.reduce_op
        for j in range(len(dst.dims)):
            add = _prefix_while(self._appendable(dst, j) or (), lambda a: a in self.cur.partial)
            if add and self._fits(j, self.cur.dims[j], add):
                if self.k(self.cur.dims[j]) == 1:
                    self._resize(j, self._padded(j, add))
                rest = tuple(a for a in self.cur.partial if a not in add)
                self.emit("reduce_scatter", self._append(j, add), rest, self._scaled(j, 1, self.k(add)),
                          axes=add, dim=j, op=op)
        if self.cur.partial:
            self.emit("all_reduce", partial=(), axes=self.cur.partial, op=op)

    def permute(self, dst):
        self.emit("collective_permute", dst.dims, pairs=permute_pairs(self.cur, dst, self.mesh))

    def move_and_gather(self, dst):
        while any(self._removed(dst, i) for i in range(len(dst.dims))):
            if not self._try_move(dst):
                i = next(i for i in range(len(dst.dims)) if self._removed(dst, i))
                outer = self.cur.dims[i][:-1]
                self.gather(i, outer if self._fits(i, outer, self.cur.dims[i][-1:]) else ())

    def gather(self, i, keep):
        """all_gather dim i down to its leading axes ``keep`` (trimmed to the true size when unsplit)."""
        axes = self.cur.dims[i][len(keep):]
        self.emit("all_gather", [keep if k == i else d for k, d in enumerate(self.cur.dims)],
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
        self.emit("all_to_all", dims, local=local, axes=moving, split_dim=j, concat_dim=i)
        if self.k(self.cur.dims[i]) == 1:
            self._resize(i, self.shape[i])

    def slice(self, dst):
        for j in range(len(dst.dims)):
            add = self._appendable(dst, j)
            if add and not self._fits(j, self.cur.dims[j], add):
                self.gather(j, ())
                add = dst.dims[j]
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
    """all_gather(dim i, b) then all_gather(dim i, a) == one all_gather(dim i, (a, b)): same bytes, one call.
    (Only the last gather of a dim can be followed by a resize, so merging never skips one.)"""
    out: list[Step] = []
    for s in steps:
        prev = out[-1] if out else None
        if prev and s.op == prev.op == "all_gather" and s.attrs["dim"] == prev.attrs["dim"]:
            out[-1] = Step("all_gather", {"axes": s.attrs["axes"] + prev.attrs["axes"], "dim": s.attrs["dim"]},
                           s.result, s.local)
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
    itemsize, total, local = np.dtype(dtype).itemsize, 0.0, src.local_shape(shape, mesh)
    for s in plan_reshard(src, dst, tuple(shape), mesh).steps:
        if s.op in COLLECTIVES:
            b_in, b_out = int(np.prod(local)) * itemsize, int(np.prod(s.local)) * itemsize
            total += wire_bytes(s.op, group_size(s.op, s.attrs, mesh), b_in, b_out)
        local = s.local
    return total
