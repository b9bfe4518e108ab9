"""Program ops: what only the partitioner emits. Collectives over mesh axes and the layout ops that
move between a global value and this rank's block (take a block, mask the padding of an uneven one,
this rank's shard number, resize a dim). ONE record each; their binders (``exec/rules/spmd.py``) resolve
the rank-dependent parts (block bounds, peers) once, when the interpreter binds the program.

The collectives' records are made from the kinds table (``collective_kinds.KINDS``), one per kind and, for
a kind with a nonblocking split, its start and done (``partition/schedule.py``): a kind added there gets its
records here without an edit.
"""
from __future__ import annotations

from .. import collective_kinds as kinds, opdef
from ..opdef import define

# all_reduce may reduce into its dying operand (MPI.IN_PLACE); all_to_allv is the planner's block exchange.
# The records are made from the kinds table, whose module is then where their names may be written.
HOME = kinds.__name__
COLLECTIVES = {kind: define(kind.name, "program", module=HOME, fresh=True, collective=True, in_place=kind.in_place)
               for kind in kinds.KINDS.values()}  # kind -> its record
# A kind's nonblocking split, keyed by its record: a start's value is the request handle (read only, never a
# buffer); a done's is the fresh result (or, in place, its operand's buffer: ``donate`` 1).
STARTS = {COLLECTIVES[kind]: define(kind.pair[0], "program", module=HOME, read_only=True, collective=True)
          for kind in kinds.KINDS.values() if kind.pair}
DONES = {COLLECTIVES[kind]: define(kind.pair[1], "program", module=HOME, fresh=True)
         for kind in kinds.KINDS.values() if kind.pair}
ALL_REDUCE, ALL_GATHER = COLLECTIVES[kinds.ALL_REDUCE], COLLECTIVES[kinds.ALL_GATHER]
REDUCE_SCATTER, ALL_TO_ALL = COLLECTIVES[kinds.REDUCE_SCATTER], COLLECTIVES[kinds.ALL_TO_ALL]
COLLECTIVE_PERMUTE, ALL_TO_ALLV = COLLECTIVES[kinds.COLLECTIVE_PERMUTE], COLLECTIVES[kinds.ALL_TO_ALLV]
BROADCAST = COLLECTIVES[kinds.BROADCAST]
SHARD_SLICE = define("shard_slice", "program", fresh=True)  # this rank's block of a whole dim (or ``shift`` on)
ROTATED_CONCAT = define("rotated_concat", "program", fresh=True)  # k blocks, operand t at block (i + t) mod k
SHARD_INDEX = define("shard_index", "program", read_only=True)  # this rank's shard number along some axes
MASK_PADDING = define("mask_padding", "program")  # the padding of an uneven block set to a fill value
RESIZE = define("resize", "program")  # a dim trimmed, or zero-padded, to a size
# The fused instruction: a fresh result, or written into a dying operand of its shape (``donate``). Made by
# partition/fusion.py; its binder (one kernel for the chain) is exec/rules/fusion.py's.
FUSION = define("fusion", "program", fresh=True, in_place=True)
# A reduction over the trailing dims of a chain nothing else reads: the chain computed and reduced in one pass,
# its values never stored (XLA's loop fusion with a reduction at its root). Attributes: the chain's (code,
# consts, dtypes, shapes), its shape (``chain_shape``) and the reduction's ``kind`` and ``axes``. Binder:
# exec/rules/fusion.py.
FUSED_REDUCE = define("fused_reduce", "program", fresh=True)


def block_pairs(mesh, axes, sign: int, shift: int, cyclic: bool = False) -> list[tuple[int, int]]:
    """(sender, receiver) world ranks: the rank holding block j receives block sign*j + shift along
    ``axes`` from the rank with the same coordinates elsewhere; blocks outside [0, k) send nothing, unless
    ``cyclic`` (a rotation: block numbers taken modulo k)."""
    k, pairs = mesh.axis_size(axes), []
    for rank in mesh.devices:
        src = sign * mesh.index_along(rank, axes) + shift
        src = src % k if cyclic else src
        if 0 <= src < k:
            coords = mesh.coords(rank)
            for a in reversed(axes):
                src, coords[a] = divmod(src, mesh.axis_size(a))
            pairs.append((mesh.rank_at(coords), rank))
    return sorted(pairs)


@opdef.kernel(RESIZE)
def _resize_kernel(xp, x, dim, size):
    """Trim ``dim`` to ``size``, or pad it with zeros up to ``size`` (uneven shards)."""
    n = x.shape[dim]
    if size <= n:
        return x[(slice(None),) * dim + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[dim] = (0, size - n)
    return xp.pad(x, pad)
