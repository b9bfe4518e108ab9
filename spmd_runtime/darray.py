"""DArray: a distributed array, one block per rank (JAX's sharded ``jax.Array``, DTensor's ``DTensor``).

A DArray knows its global shape and dtype, its mesh and sharding, and holds
this rank's TRUE local block (uneven tails are short, as ``run_local`` takes
them). ``sr.jit`` functions take and return DArrays, so a chain of calls never
materialises a global array; ``gather()`` / ``np.asarray(d)`` build the global
value on every rank (a collective unless the array is replicated).

Constructors: ``device_put`` (every rank has the global array, or a DArray to
reshard), ``from_local`` (every rank has its own block), ``scatter_from_root``
(only the root has the data: it sends each rank its block). All of them check
collectively, so bad input raises on every rank; ``device_put`` also compares a
digest of the global array across ranks (``check_inputs``), so ranks holding
different arrays fail instead of each keeping its block of another one.
"""
from __future__ import annotations

import numpy as np

from .comm import watchdog
from .comm.agreement import DifferentValuesError, agree, capture, check_same, digests, plain_data_error
from .devices import is_device_array
from .exec.backend import get_array_module, to_host
from .exec.runner import SKIP, Runtime, block_slices, communicator, run_local, shard, unshard
from .graph import TensorSpec
from .partition import partition
from .trace import trace
from .mesh import Mesh, get_mesh
from .sharding import P, Sharding, parse_spec, to_spec


class DArray:
    """Global ``shape``/``dtype`` on ``mesh`` laid out as ``sharding``; ``local`` is this rank's block."""
    __array_priority__ = 1000

    def __init__(self, local, shape, dtype, mesh: Mesh, sharding: Sharding, comm=None):
        self.local, self.shape, self.dtype = local, tuple(shape), np.dtype(dtype)
        self.mesh, self.sharding, self.comm = mesh, sharding, comm
        self._deleted: str | None = None

    @property
    def local(self):
        """This rank's block. A DArray donated to a call (``jit(donate_argnums=...)``) has none: its buffer
        holds that call's result now."""
        if self._deleted is not None:
            raise RuntimeError(f"this DArray was {self._deleted}: its buffer now holds that call's result; use the "
                               f"result instead (or do not donate the argument)")
        return self._local

    @local.setter
    def local(self, value) -> None:
        self._local = value

    def delete(self, why: str = "deleted") -> None:
        """Give up this DArray's block (JAX's ``Array.delete``): any later use raises, saying ``why``."""
        self._local, self._deleted = None, why

    def is_deleted(self) -> bool:
        return self._deleted is not None

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    spec = property(lambda self: to_spec(self.sharding))

    def __repr__(self):
        local = f"{self._deleted}" if self._deleted else f"local {self.dtype.name}{list(self.local.shape)}"
        return f"DArray({self.dtype.name}{list(self.shape)} {self.sharding} on {self.mesh}, {local})"

    def gather(self):
        """The global array on every rank (collective: all-gathers the split dims, reduces partial sums)."""
        mc = communicator(self.mesh, self.comm)
        return _global_value(self, mc)

    def __array__(self, dtype=None, copy=None):
        out = to_host(self.gather())
        return out if dtype is None else out.astype(dtype)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """The global value as a DLPack capsule (the Array API's interchange; collective, as ``gather()``: a split
        DArray is gathered on every rank, so every rank must export it)."""
        asked = {"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy}
        value = self.gather()
        if not getattr(getattr(value, "flags", None), "writeable", True):  # a read-only block: older DLPack
            value = value.copy()  # consumers cannot be told, so they get a copy
        return value.__dlpack__(**{k: v for k, v in asked.items() if v is not None})

    def __dlpack_device__(self):
        """(device type, id) of this rank's block: DLPack's CPU (1, 0) for host memory."""
        return self.local.__dlpack_device__()

    def block_slices(self, rank: int | None = None) -> tuple[slice, ...]:
        """The global index of ``rank``'s block (default: this rank)."""
        if rank is None:
            rank = communicator(self.mesh, self.comm).rank
        return block_slices(self.shape, self.sharding, self.mesh, rank)


def _global_value(d: DArray, mc):
    xp = get_array_module("cupy" if is_device_array(d.local) else "numpy")
    x = xp.asarray(d.local)
    padded = d.sharding.local_shape(d.shape, d.mesh)
    widths = [(0, want - have) for have, want in zip(x.shape, padded)]
    if any(w for _, w in widths):
        x = xp.pad(x, widths)
    return unshard(x, d.sharding, d.shape, mc)


def _mesh(mesh, what: str) -> Mesh:
    """``mesh``, or the context mesh for None (the same on every rank: raised before any exchange)."""
    mesh = mesh if mesh is not None else get_mesh(required_by=what)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what} needs a Mesh; got {type(mesh).__name__}")
    return mesh


def _resolve(mesh, spec, ndim: int, what: str) -> tuple[Mesh, Sharding]:
    mesh = _mesh(mesh, what)
    return mesh, parse_spec(P() if spec is None else spec, mesh, ndim, what)


def _agree(mc, error: str | None, payload=None) -> list:
    """Every rank's payload; raises on every rank if any rank has an error."""
    return agree(mc.comm, error, "a distributed array's input", payload, ValueError,
                 rule="every rank must pass valid input")


def device_put(x, spec=None, mesh: Mesh | None = None, comm=None, check_inputs: bool | None = None) -> DArray:
    """``x`` laid out as ``spec`` (a ``P``; default replicated) on ``mesh`` (default: the context mesh).

    ``x`` is the same global array on every rank (each keeps its block: no
    communication) or a DArray (resharded by one partitioned program).
    ``check_inputs`` (default True, or ``$SPMD_CHECK_INPUTS=0``): the ranks agree on a digest of ``x`` in the
    exchange that checks its shape (one pass over its bytes; ``comm.agreement.digest``)."""
    if isinstance(x, DArray):
        return _reshard(x, spec if spec is not None else P(), mesh or x.mesh, comm or x.comm)
    mesh = _mesh(mesh, "device_put")
    mc = communicator(mesh, comm)
    check = Runtime.of(comm).checks_inputs(check_inputs)
    laid_out, error = capture(_put, x, spec, mesh, check, describe=str)
    x, sharding, sums = laid_out or (None, None, None)
    meta = None if error else (tuple(x.shape), np.dtype(x.dtype).name, str(sharding))
    views = _agree(mc, error, (meta, sums))  # one exchange checks the shapes, layouts and contents
    metas = [meta for meta, _ in views]
    if len(set(metas)) > 1:
        raise DifferentValuesError(f"device_put takes the same global array and layout on every rank; got (shape, "
                                   f"dtype, layout) {dict(enumerate(metas))}", list(range(len(metas))))
    check_same([s for _, s in views], ["x"], "device_put needs the same global array on every rank", SKIP)
    return DArray(shard(x, sharding, mesh, mc.rank), x.shape, x.dtype, mesh, sharding, comm)


def _put(x, spec, mesh: Mesh, check: bool):
    """(``x`` as an array, its Sharding, its digests or None): raises on this rank if it cannot be laid out."""
    x = np.asarray(x) if not hasattr(x, "__array_namespace__") and not hasattr(x, "shape") else x
    refused = plain_data_error(x, "x", "device_put")
    if refused:
        raise TypeError(refused)
    mesh, sharding = _resolve(mesh, spec, x.ndim, "device_put")
    _check_put(x, spec, sharding, mesh)
    return x, sharding, digests([x]) if check else None


def _check_put(x, spec, sharding: Sharding, mesh: Mesh) -> None:
    sharding.check(mesh, tuple(x.shape), what=f"device_put array {x.dtype}{list(x.shape)}")
    if sharding.partial:
        raise ValueError(f"device_put lays out a global value, which is not a partial sum; got spec {spec!r} "
                         f"(use sr.from_local for per-rank summands)")


def _reshard(x: DArray, spec, mesh: Mesh, comm) -> DArray:
    """``x`` laid out as ``spec``: one partitioned identity program (the resharding planner's collectives)."""
    if mesh != x.mesh:
        raise ValueError(f"device_put reshards a DArray on its own mesh {x.mesh}; got mesh {mesh} (save it with "
                         f"sr.save_checkpoint and load it onto the other mesh)")
    graph = trace(lambda a: a, TensorSpec(x.shape, x.dtype.name))
    program = partition(graph, mesh, in_specs=[x.sharding], out_specs=[spec])
    out, = run_local(program, x.local, comm=comm)
    return DArray(out, x.shape, x.dtype, mesh, program.outputs[0].sharding, comm)


def from_local(block, spec=None, mesh: Mesh | None = None, shape=None, comm=None) -> DArray:
    """A DArray from every rank's own true block (collective: ranks exchange block shapes and check them).

    ``shape``: the global shape; by default summed from the blocks along each split dim."""
    mesh = _mesh(mesh, "from_local")
    mc = communicator(mesh, comm)
    meta, error = capture(_block_meta, block, spec, shape, describe=str)
    blocks = _agree(mc, error, meta)
    error = _check_alike(blocks)
    if error is None:
        sharding, error = capture(parse_spec, P() if spec is None else spec, mesh, len(blocks[0][0]), "from_local",
                                  describe=str)  # the same on every rank: the blocks' ndim is agreed
    if error is None:
        error = _check_blocks(blocks, sharding, mesh, shape)
    if error is None:
        shape = tuple(shape) if shape is not None else _global_shape(blocks, sharding, mesh)
    _agree(mc, error)
    return DArray(block, shape, block.dtype, mesh, sharding, comm)


def _block_meta(block, spec, shape) -> tuple:
    """(shape, dtype name) of this rank's block and the call's (spec, global shape) as written; raises if the
    block is no array of plain data."""
    if not (hasattr(block, "shape") and hasattr(block, "dtype")):
        raise TypeError(f"from_local takes this rank's block as an array; got a {type(block).__name__}")
    refused = plain_data_error(block, "this rank's block", "from_local")
    if refused:
        raise TypeError(refused)
    return tuple(block.shape), np.dtype(block.dtype).name, (str(spec), None if shape is None else tuple(shape))


def _check_alike(blocks) -> str | None:
    """What the ranks' blocks must share before their shapes are compared: the number of dims, and the call's
    spec and global shape."""
    if len({len(b[0]) for b in blocks}) > 1:
        return (f"from_local blocks share one number of dimensions; got shapes "
                f"{dict(enumerate(list(b[0]) for b in blocks))} by rank")
    if len({b[2] for b in blocks}) > 1:
        return (f"from_local takes the same spec and shape on every rank; got (spec, shape) "
                f"{dict(enumerate(b[2] for b in blocks))} by rank")
    return None


def _global_shape(blocks, sharding: Sharding, mesh: Mesh) -> tuple[int, ...]:
    shape = []
    for dim, axes in enumerate(sharding.dims):
        by_index = {mesh.index_along(r, axes): b[0][dim] for r, b in enumerate(blocks)}
        shape.append(sum(by_index.values()))
    return tuple(shape)


def _check_blocks(blocks, sharding, mesh, shape) -> str | None:
    dtypes = {b[1] for b in blocks}
    if len(dtypes) > 1:
        return f"from_local blocks share one dtype; got {dict(enumerate(b[1] for b in blocks))}"
    if len(blocks) != mesh.size:
        return f"from_local runs on the {mesh.size} ranks of {mesh}; got {len(blocks)} ranks"
    shape = tuple(shape) if shape is not None else _global_shape(blocks, sharding, mesh)
    try:
        sharding.check(mesh, shape, what=f"from_local array {list(shape)}")
    except ValueError as e:
        return str(e)
    for r, (got, *_) in enumerate(blocks):
        want = tuple(s.stop - s.start for s in block_slices(shape, sharding, mesh, r))
        if got != want:
            return (f"rank {r}'s block of a {list(shape)} array laid out as {sharding} on {mesh} must have shape "
                    f"{list(want)} (blocks of ceil(n/k), the tail short); got {list(got)}")
    return None


def scatter_from_root(x, spec=None, mesh: Mesh | None = None, root: int = 0, comm=None) -> DArray:
    """A DArray from data only ``root`` has (``x`` is ignored elsewhere): root sends each rank its block
    (point-to-point buffers, no pickled arrays)."""
    mesh = mesh if mesh is not None else get_mesh(required_by="scatter_from_root")
    mc = communicator(mesh, comm)
    meta, error = None, None
    if mc.rank == root:  # every rank must hear of an error at the root: it is broadcast with the layout
        laid_out, error = capture(_root_layout, x, spec, mesh)
        x, meta = laid_out or (x, None)
    error, meta = _from_root(mc.comm, (error, meta), root)
    if error is not None:
        raise ValueError(f"scatter_from_root: the root rank {root} could not lay out its array: {error}")
    shape, dtype = meta
    _, sharding = _resolve(mesh, spec, len(shape), "scatter_from_root")
    local = _scatter_blocks(mc.comm, mc.rank, x, shape, dtype, sharding, mesh, root)
    return DArray(local, shape, dtype, mesh, sharding, comm)


def _root_layout(x, spec, mesh: Mesh):
    """The root's array as a C-ordered host array and its (shape, dtype str); raises if it cannot take ``spec``."""
    x = np.ascontiguousarray(to_host(x))
    _resolve(mesh, spec, x.ndim, "scatter_from_root")[1].check(mesh, x.shape, "scatter_from_root array")
    return x, (tuple(x.shape), x.dtype.str)


@watchdog.collective(lambda frame: f"scatter_from_root's broadcast from rank {frame.f_locals['root']} (a bcast)")
def _from_root(comm, payload, root: int):
    return comm.bcast(payload, root=root)


@watchdog.collective(lambda frame: f"scatter_from_root's blocks from rank {frame.f_locals['root']} (Send/Recv)")
def _scatter_blocks(comm, rank: int, x, shape, dtype, sharding, mesh, root: int):
    """Root sends each rank its block (buffers, tag 77); returns this rank's block."""
    if rank == root:
        for r in range(mesh.size):
            if r != root:
                comm.Send(np.ascontiguousarray(x[block_slices(shape, sharding, mesh, r)]), dest=r, tag=77)
        return x[block_slices(shape, sharding, mesh, root)].copy()
    local = np.empty(tuple(s.stop - s.start for s in block_slices(shape, sharding, mesh, rank)), dtype)
    comm.Recv(local, source=root, tag=77)
    return local
