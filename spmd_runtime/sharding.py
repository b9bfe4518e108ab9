"""How one tensor is laid out over a mesh.

``dims[i]`` lists the mesh axes that split tensor dim i (major first), ``partial``
lists the mesh axes over which the local values are partial results still to be
combined with ``reduce_op``; the tensor is replicated over every other axis. This
covers XLA's replicated, tiled and partially replicated forms and DTensor's
Shard / Replicate / Partial placements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .mesh import Mesh

REDUCE_OPS = ("sum", "max", "min", "prod")


# ---------------------------------------------------------------- the layout rule
# A dim of n elements split k ways is held in k blocks of ceil(n/k): block i covers global indices
# [i*c, i*c + c), its entries past n are padding. Every module asks these three functions.
def block_size(n: int, k: int) -> int:
    """Elements per block of a dim of ``n`` split ``k`` ways: ceil(n / k) (trailing blocks padded)."""
    return -(-n // k)


def block_span(n: int, block: int, i: int) -> tuple[int, int]:
    """[start, stop) of the true entries of block ``i`` (blocks of ``block``) of a dim of size ``n``;
    stop - start is short or zero for the trailing blocks."""
    start = min(i * block, n)
    return start, min(start + block, n)


def block_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, stop) of block ``i`` of a dim of size ``n`` in ``k`` blocks (the tail may be short or empty)."""
    return block_span(n, block_size(n, k), i)


@dataclass(frozen=True)
class Sharding:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    reduce_op: str = "sum"

    def __post_init__(self):
        dims, partial = self.dims, self.partial
        if type(partial) is not tuple:
            partial = tuple(partial)
            object.__setattr__(self, "partial", partial)
        try:  # tuples of tuples (what propagation builds) concatenate; anything else is normalised first
            used = sum(dims, partial) if type(dims) is tuple else None
        except TypeError:
            used = None
        if used is None:
            dims = tuple(tuple(d) for d in dims)
            object.__setattr__(self, "dims", dims)
            used = sum(dims, partial)
        if len(used) != len(set(used)):
            raise ValueError(f"a mesh axis may shard a tensor at most once; got {self}")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op must be one of {REDUCE_OPS}; got {self.reduce_op!r}")

    @classmethod
    def replicated(cls, ndim: int) -> "Sharding":
        return cls(((),) * ndim)

    def __str__(self):
        dims = ", ".join("R" if not d else d[0] if len(d) == 1 else "(" + ",".join(d) + ")" for d in self.dims)
        part = f" P{self.reduce_op}({','.join(self.partial)})" if self.partial else ""
        return f"[{dims}]{part}"

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis that splits some dim, in dim order."""
        return sum(self.dims, ())

    @property
    def is_replicated(self) -> bool:
        return not self.axes and not self.partial

    def with_dims(self, dims) -> "Sharding":
        return Sharding(tuple(dims), self.partial, self.reduce_op)

    def without_partial(self) -> "Sharding":
        return Sharding(self.dims)

    def on_split_axes(self, mesh: Mesh) -> "Sharding":
        """This sharding without the mesh axes of size 1: a split or a pending sum over one rank is none, so two
        shardings equal here hold the same blocks on every rank."""
        split = lambda axes: tuple(a for a in axes if mesh.axis_size(a) > 1)
        return Sharding(tuple(split(d) for d in self.dims), split(self.partial), self.reduce_op)

    def num_shards(self, mesh: Mesh, dim: int) -> int:
        return mesh.axis_size(self.dims[dim])

    def local_shape(self, shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
        """Shape of one shard (ceil division: trailing shards are padded)."""
        return tuple(block_size(n, mesh.axis_size(d)) for n, d in zip(shape, self.dims))

    def block_index(self, mesh: Mesh, rank: int) -> tuple[int, ...]:
        """``rank``'s shard number along each dim (0 on unsplit dims)."""
        return tuple(mesh.index_along(rank, axes) for axes in self.dims)

    def block_bounds(self, shape: tuple[int, ...], mesh: Mesh, index) -> list[tuple[int, int]]:
        """Global [start, stop) along each dim of the TRUE block with shard numbers ``index``."""
        return [block_bounds(n, mesh.axis_size(axes), i) for n, axes, i in zip(shape, self.dims, index)]

    def block_slices(self, shape: tuple[int, ...], mesh: Mesh, rank: int) -> tuple[slice, ...]:
        """Where ``rank``'s TRUE block (uneven tails short, no padding) lies in the global array."""
        return tuple(slice(a, b) for a, b in self.block_bounds(shape, mesh, self.block_index(mesh, rank)))

    def check(self, mesh: Mesh, shape: tuple[int, ...], what: str = "tensor") -> None:
        """Raise unless this sharding fits ``shape`` on ``mesh`` (known axes, one entry per dim).

        Uneven splits are allowed: each shard holds ceil(n/k) elements, the trailing ones padded."""
        if len(self.dims) != len(shape):
            raise ValueError(f"a sharding needs one entry per dim of {what}; got {len(self.dims)} entries "
                             f"for shape {shape}")
        for a in self.axes + self.partial:
            mesh.axis_index(a)

    def is_even(self, shape: tuple[int, ...], mesh: Mesh, dim: int) -> bool:
        return shape[dim] % mesh.axis_size(self.dims[dim]) == 0

    def to_json(self):
        return {"dims": [list(d) for d in self.dims], "partial": list(self.partial), "reduce_op": self.reduce_op}

    @classmethod
    def from_json(cls, d) -> "Sharding":
        return cls(tuple(tuple(x) for x in d["dims"]), tuple(d["partial"]), d["reduce_op"])


class _Unconstrained:
    """``sr.UNCONSTRAINED``: a spec entry that leaves the dim to propagation (JAX's P.UNCONSTRAINED)."""
    _instance = None

    def __new__(cls):
        cls._instance = cls._instance or super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "UNCONSTRAINED"

    def __reduce__(self):
        return (_Unconstrained, ())


UNCONSTRAINED = _Unconstrained()


class P(tuple):
    """A partition spec (JAX's ``PartitionSpec``): one entry per leading tensor dim, missing trailing
    entries replicated. An entry is None (replicated), a mesh axis name, a tuple of names (major first),
    ``UNCONSTRAINED`` (propagation decides), or an int mesh dim / -1 as in the GSPMD paper's dims_mapping.

    ``partial="model"`` (or a tuple of axes) declares the value a pending reduction over those axes, as
    DTensor's ``Partial()``: every rank along them holds a summand (``reduce_op``: sum, max or min).
    """

    def __new__(cls, *entries, partial=(), reduce_op: str = "sum"):
        spec = super().__new__(cls, entries)
        spec.partial = (partial,) if isinstance(partial, str) else tuple(partial)
        spec.reduce_op = reduce_op
        return spec

    def __repr__(self):
        items = [repr(e) for e in self]
        if self.partial:
            items.append(f"partial={self.partial[0]!r}" if len(self.partial) == 1 else f"partial={self.partial!r}")
        if self.reduce_op != "sum":
            items.append(f"reduce_op={self.reduce_op!r}")
        return f"P({', '.join(items)})"

    def __eq__(self, other):
        if not isinstance(other, tuple):
            return NotImplemented  # tuple.__eq__ would answer NotImplemented, which is truthy
        return tuple.__eq__(self, other) and (self.partial, self.reduce_op) == \
            (getattr(other, "partial", ()), getattr(other, "reduce_op", "sum"))

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), self.partial, self.reduce_op))

    def __reduce__(self):
        return (_make_p, (tuple(self), self.partial, self.reduce_op))


def _make_p(entries, partial, reduce_op):
    return P(*entries, partial=partial, reduce_op=reduce_op)


def parse_spec(spec, mesh: Mesh, ndim: int, what: str = "tensor") -> Sharding:
    """Turn a ``mesh_split`` spec into a Sharding.

    A ``P`` (missing trailing entries replicated) or a sequence with one entry per tensor dim: None or
    -1 (replicated), an axis name, a tuple of names (major first), or an int mesh dim as in the GSPMD
    paper. A Sharding passes through unchanged. ``UNCONSTRAINED`` entries need ``parse_spec_free``.
    """
    sharding, free = parse_spec_free(spec, mesh, ndim, what)
    if free:
        raise ValueError(f"UNCONSTRAINED entries are allowed in mesh_split and jit/partition in/out specs; "
                         f"got {spec!r} for {what}")
    return sharding


def parse_spec_free(spec, mesh: Mesh, ndim: int, what: str = "tensor") -> tuple[Sharding, tuple[int, ...]]:
    """(Sharding, dims marked UNCONSTRAINED): those dims are replicated in the Sharding, to be completed
    by propagation."""
    if isinstance(spec, Sharding):
        return spec, ()
    if isinstance(spec, (str, int)) or spec is None:
        raise TypeError(f"a sharding spec is a sequence with one entry per dim of {what}; got {spec!r}")
    entries = tuple(spec)
    if isinstance(spec, P) and len(entries) < ndim:
        entries += (None,) * (ndim - len(entries))
    if len(entries) != ndim:
        raise ValueError(f"a sharding spec needs one entry per dim of {what} (ndim {ndim}); got {len(entries)} "
                         f"entries in {spec}")
    free = tuple(d for d, e in enumerate(entries) if e is UNCONSTRAINED)
    dims = tuple(() if e is UNCONSTRAINED else _parse_entry(e, mesh, what) for e in entries)
    partial = tuple(a for e in getattr(spec, "partial", ()) for a in _parse_entry(e, mesh, what))
    return Sharding(dims, partial, getattr(spec, "reduce_op", "sum")), free


def to_spec(sharding: Sharding) -> P:
    """The ``P`` that parses back to ``sharding``."""
    return P(*(None if not d else d[0] if len(d) == 1 else d for d in sharding.dims),
             partial=sharding.partial, reduce_op=sharding.reduce_op)


def _parse_entry(entry, mesh: Mesh, what: str = "tensor") -> tuple[str, ...]:
    if entry is None or (isinstance(entry, int) and entry == -1):
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for e in entry for a in _parse_entry(e, mesh, what))
    if isinstance(entry, int) and not isinstance(entry, bool):
        if not 0 <= entry < len(mesh.shape):
            raise ValueError(f"an int spec entry must be a mesh dim in [0, {len(mesh.shape)}) or -1; got {entry}")
        return (mesh.axis_names[entry],)
    if isinstance(entry, str):
        if entry not in mesh.axis_names:
            raise ValueError(f"mesh axis must be one of {mesh.axis_names}; got {entry!r} in the spec of {what} "
                             f"(a spec may only name axes of its mesh, {mesh})")
        return (entry,)
    raise TypeError(f"a spec entry must be None, -1, a mesh axis name or int, or a tuple of them; got {entry!r}")


def shard_count(mesh: Mesh, axes) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)
