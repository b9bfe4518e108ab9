"""Logical device mesh: an n-d array of MPI ranks with named axes.

Device id = rank in the world communicator. ``devices`` lists the rank at each
mesh position in row-major order (default: 0..N-1), so a mesh can reorder ranks
without changing any sharding.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices: tuple[int, ...] | None = None
    _position: dict = field(init=False, repr=False, compare=False, hash=False)
    _sizes: dict = field(init=False, repr=False, compare=False, hash=False)  # axes -> group size, memoised

    def __post_init__(self):
        shape = tuple(int(s) for s in (self.shape if isinstance(self.shape, Iterable) else (self.shape,)))
        names = (self.axis_names,) if isinstance(self.axis_names, str) else tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if len(shape) != len(names):
            raise ValueError(f"Mesh needs one axis name per mesh dim; got shape {shape} and axis_names {names}")
        if any(s < 1 for s in shape):
            raise ValueError(f"Mesh dims must be >= 1; got shape {shape}")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"Mesh axis names must be distinct non-empty strings; got {names}")
        devices = tuple(range(math.prod(shape))) if self.devices is None else tuple(int(d) for d in self.devices)
        if sorted(devices) != list(range(math.prod(shape))):
            raise ValueError(f"Mesh devices must be a permutation of 0..{math.prod(shape) - 1}; got {devices}")
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "_position", {d: i for i, d in enumerate(devices)})
        object.__setattr__(self, "_sizes", {})

    def __str__(self):
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        order = "" if self.devices == tuple(range(self.size)) else f", devices={list(self.devices)}"
        return f"Mesh({axes}{order})"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axes) -> int:
        """Number of shards over one axis name or a tuple of names (memoised: the partitioner asks often)."""
        try:
            return self._sizes[axes]
        except (KeyError, TypeError):  # first time, or an unhashable spelling (a list)
            names = (axes,) if isinstance(axes, str) else tuple(axes)
            size = math.prod(self.shape[self.axis_index(n)] for n in names)
        if isinstance(axes, (str, tuple)):
            self._sizes[axes] = size
        return size

    def axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise ValueError(f"mesh axis must be one of {self.axis_names}; got {name!r}")
        return self.axis_names.index(name)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinate of ``rank`` along every axis."""
        pos, out = self._position[rank], {}
        for name, size in reversed(list(zip(self.axis_names, self.shape))):
            pos, out[name] = divmod(pos, size)
        return {n: out[n] for n in self.axis_names}

    def rank_at(self, coords: dict[str, int]) -> int:
        pos = 0
        for name, size in zip(self.axis_names, self.shape):
            pos = pos * size + coords[name]
        return self.devices[pos]

    def index_along(self, rank: int, axes: tuple[str, ...]) -> int:
        """Linear index of ``rank`` over ``axes`` (major first): its shard number and sub-communicator rank."""
        c, idx = self.coords(rank), 0
        for name in axes:
            idx = idx * self.axis_size(name) + c[name]
        return idx

    def group_color(self, rank: int, axes: tuple[str, ...]) -> int:
        """Which sub-communicator over ``axes`` holds ``rank``: linear index over the other axes."""
        return self.index_along(rank, tuple(n for n in self.axis_names if n not in axes))

    def groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """All groups of ranks along ``axes``, each ordered by ``index_along``."""
        out: dict[int, list[int]] = {}
        for r in sorted(self.devices, key=lambda r: self.index_along(r, axes)):
            out.setdefault(self.group_color(r, axes), []).append(r)
        return [tuple(out[c]) for c in sorted(out)]

    # -- context mesh: ``with mesh:`` makes it the default of mesh_split, jit, device_put ... on this thread
    def __enter__(self) -> "Mesh":
        _context.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc) -> None:
        _context.stack.pop()

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "devices": list(self.devices)}

    @classmethod
    def from_json(cls, d: dict) -> "Mesh":
        return cls(tuple(d["shape"]), tuple(d["axis_names"]), tuple(d["devices"]))


_context = threading.local()  # per thread: the simulated world runs one rank per thread
_default_mesh: list = [None]


class _MeshSetting:
    def __init__(self, previous):
        self.previous = previous

    def __enter__(self):
        return _default_mesh[0]

    def __exit__(self, *exc):
        _default_mesh[0] = self.previous


def set_mesh(mesh: Mesh | None) -> _MeshSetting:
    """Make ``mesh`` the process-wide default mesh (``with mesh:`` overrides it on one thread).

    Returns a context manager that restores the previous default: ``with sr.set_mesh(mesh): ...``."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"set_mesh takes a Mesh or None; got {type(mesh).__name__}")
    previous, _default_mesh[0] = _default_mesh[0], mesh
    return _MeshSetting(previous)


def get_mesh(required_by: str | None = None) -> Mesh | None:
    """The innermost ``with mesh:`` on this thread, else the ``set_mesh`` default; with ``required_by``,
    raise when there is none."""
    stack = getattr(_context, "stack", None)
    mesh = stack[-1] if stack else _default_mesh[0]
    if mesh is None and required_by is not None:
        raise ValueError(f"{required_by} needs a mesh: pass mesh=..., use `with mesh:` or sr.set_mesh(mesh); "
                         f"got no context mesh")
    return mesh
