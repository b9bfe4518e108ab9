"""Array-level collectives over mesh axes, the ones the SPMD interpreter emits.

Every function takes a ``MeshCommunicator`` ``mc``, the local array ``x``
(NumPy, CuPy, or anything with the array module API that ``mc.transport``
resolves) and the mesh axes the collective runs over. With ``k =
mesh.axis_size(axes)`` ranks per group, shard ``i`` belongs to the rank whose
``index_along(axes)`` is ``i``, which is also its sub-communicator rank.

MPI collectives split buffers along their first axis, so each function moves
the collective's dim to axis 0 in a contiguous buffer (free when it already is
there), calls one MPI primitive with a preallocated receive buffer, and moves
the dim back. With k == 1 the result is computed locally, without MPI.

Wire bytes (per rank, ring algorithms, S = local bytes) are in each docstring;
they are the denominators of the cost model and of the bus-bandwidth figures.
"""
from __future__ import annotations

from spmd_runtime.comm.communicator import mpi_op


def all_reduce(mc, x, axes, op: str = "sum"):
    """Elementwise ``op`` ('sum' | 'max' | 'min') of ``x`` over the group; same shape as ``x``.

    Wire bytes: 2 (k-1)/k * S.
    """
    xp, k = mc.transport.array_module(x), mc.axis_size(axes)
    mpi_op(op)  # reject a bad op even where k == 1 needs no MPI call
    if k == 1:
        return x.copy()
    send = _contiguous(xp, x)
    recv = xp.empty(send.shape, send.dtype)
    mc.transport.run(lambda s, r: mc.Allreduce(axes, s, r, op), send, recv)
    return recv


def all_gather(mc, x, axes, dim: int):
    """The group's ``x`` concatenated along ``dim`` in shard order: ``shape[dim]`` grows k times.

    Wire bytes: (k-1)/k * S_out.
    """
    xp, k = mc.transport.array_module(x), mc.axis_size(axes)
    dim = _normalize_dim(dim, x.ndim, "all_gather dim")
    if k == 1:
        return x.copy()
    send = _to_front(xp, x, dim)
    recv = xp.empty((k * send.shape[0],) + send.shape[1:], send.dtype)
    mc.transport.run(lambda s, r: mc.Allgather(axes, s, r), send, recv)
    return _move_axis(xp, recv, 0, dim)


def reduce_scatter(mc, x, axes, dim: int, op: str = "sum"):
    """Block ``index_along(axes)`` along ``dim`` of the group's elementwise ``op``: ``shape[dim]`` shrinks k times.

    Wire bytes: (k-1)/k * S_in.
    """
    xp, k = mc.transport.array_module(x), mc.axis_size(axes)
    dim = _normalize_dim(dim, x.ndim, "reduce_scatter dim")
    _check_divisible(x.shape, dim, k, "reduce_scatter")
    mpi_op(op)
    if k == 1:
        return x.copy()
    send = _to_front(xp, x, dim)
    recv = xp.empty((send.shape[0] // k,) + send.shape[1:], send.dtype)
    mc.transport.run(lambda s, r: mc.Reduce_scatter_block(axes, s, r, op), send, recv)
    return _move_axis(xp, recv, 0, dim)


def all_to_all(mc, x, axes, split_dim: int, concat_dim: int):
    """Split ``x`` into k blocks along ``split_dim``; block j goes to shard j; the received
    blocks are concatenated along ``concat_dim`` in source shard order.

    Resharding use: an array sharded on ``concat_dim`` over ``axes`` becomes sharded on ``split_dim``.
    Wire bytes: (k-1)/k * S.
    """
    xp, k = mc.transport.array_module(x), mc.axis_size(axes)
    split_dim = _normalize_dim(split_dim, x.ndim, "all_to_all split_dim")
    concat_dim = _normalize_dim(concat_dim, x.ndim, "all_to_all concat_dim")
    _check_divisible(x.shape, split_dim, k, "all_to_all")
    if k == 1:
        return x.copy()
    # (..., k, n/k, ...) with the block index in front: send[j] is block j, contiguous.
    blocked = x.reshape(x.shape[:split_dim] + (k, x.shape[split_dim] // k) + x.shape[split_dim + 1:])
    send = xp.ascontiguousarray(_move_axis(xp, blocked, split_dim, 0))
    recv = xp.empty(send.shape, send.dtype)
    mc.transport.run(lambda s, r: mc.Alltoall(axes, s, r), send, recv)
    # recv[i] came from shard i: merge the source index into concat_dim, major.
    block = recv.shape[1:]
    merged = _move_axis(xp, recv, 0, concat_dim)
    return merged.reshape(block[:concat_dim] + (k * block[concat_dim],) + block[concat_dim + 1:])


def collective_permute(mc, x, pairs):
    """Each (source, dest) pair of world ranks sends the source's ``x`` to dest.

    Returns what this rank receives, or zeros shaped like ``x`` when no pair
    targets it (XLA semantics). Sources and destinations must each be unique.
    One Sendrecv per rank (MPI_PROC_NULL for a missing partner) cannot deadlock.
    Wire bytes: S.
    """
    xp = mc.transport.array_module(x)
    dest, source = _permute_partners(pairs, mc.rank, mc.mesh.size)
    if source == mc.rank:
        return x.copy()
    if source is None:
        recv = xp.zeros(x.shape, x.dtype)
        if dest is None:
            return recv
    else:
        recv = xp.empty(x.shape, x.dtype)  # fully overwritten: skip the memset
    send = None if dest is None else _contiguous(xp, x)
    mc.transport.run(lambda s, r: mc.Sendrecv(s, dest, r, source), send, None if source is None else recv)
    return recv


def _permute_partners(pairs, rank: int, world_size: int) -> tuple[int | None, int | None]:
    """(where this rank sends, where it receives from), None when it has no partner. One pass: it runs every call."""
    dest = source = None
    sources, dests = set(), set()
    for s, d in pairs:
        if s in sources or d in dests or not (0 <= s < world_size and 0 <= d < world_size):
            raise ValueError(
                f"collective_permute pairs must have unique sources and unique destinations, all ranks in "
                f"[0, {world_size}); got pairs {list(pairs)}"
            )
        sources.add(s)
        dests.add(d)
        dest = d if s == rank else dest
        source = s if d == rank else source
    return dest, source


def _contiguous(xp, x):
    # ascontiguousarray returns ndim >= 1: a 0-d array would come back with shape (1,).
    c = xp.ascontiguousarray(x)
    return c if c.shape == x.shape else c.reshape(x.shape)


def _to_front(xp, x, dim: int):
    """``x`` with ``dim`` moved to axis 0, C-contiguous; no copy when that already holds."""
    return xp.ascontiguousarray(_move_axis(xp, x, dim, 0))


def _move_axis(xp, x, source: int, destination: int):
    # np.moveaxis costs microseconds of argument checking: skip it when it is the identity.
    return x if source == destination else xp.moveaxis(x, source, destination)


def _normalize_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what} must be in [-{ndim}, {ndim}) for a rank-{ndim} array; got {dim}")
    return dim % ndim


def _check_divisible(shape, dim: int, k: int, what: str) -> None:
    if shape[dim] % k:
        raise ValueError(
            f"{what} needs the size of dim {dim} divisible by the group size {k}; got shape {tuple(shape)}"
        )


__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"]
