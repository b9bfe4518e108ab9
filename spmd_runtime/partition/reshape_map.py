"""How a sharding maps through a reshape.

Dims are grouped into minimal runs of equal element count (size-1 dims are left
out: they are never split). In a group, a split carries across only on the
major dim: merging (a, b) -> (a*b) keeps a's split, splitting (a*b) -> (a, b)
puts the split on a, because then each shard is one contiguous block in both
layouts. Anything else has no exact local equivalent.
"""
from __future__ import annotations

import math

from ..mesh import Mesh
from ..sharding import Sharding


def dim_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Minimal (src dims, dst dims) groups of equal size, ignoring size-1 dims."""
    s = [i for i, n in enumerate(src) if n != 1]
    d = [j for j, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(s) and j < len(d):
        gi, gj, pi, pj = [s[i]], [d[j]], src[s[i]], dst[d[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(s[i]); pi *= src[s[i]]; i += 1
            else:
                gj.append(d[j]); pj *= dst[d[j]]; j += 1
        groups.append((gi, gj))
    return groups


def map_reshape_sharding(sharding: Sharding, src: tuple[int, ...], dst: tuple[int, ...],
                         mesh: Mesh, exact: bool) -> Sharding | None:
    """The sharding of the reshaped tensor whose local reshape is exact.

    ``exact=True``: None when some split cannot carry across. ``exact=False``:
    such splits are dropped instead (for propagation, which only proposes).
    """
    out: list[tuple[str, ...]] = [()] * len(dst)
    for gi, gj in dim_groups(src, dst):
        sharded = [i for i in gi if sharding.dims[i]]
        if not sharded:
            continue
        axes = sharding.dims[gi[0]]
        k = mesh.axis_size(axes)
        one_to_one = len(gi) == 1 and len(gj) == 1  # same size: the local reshape only adds/drops 1s
        if sharded == [gi[0]] and (one_to_one or (dst[gj[0]] % k == 0 and src[gi[0]] % k == 0)):
            out[gj[0]] = axes
        elif exact:
            return None
    if exact and any(sharding.dims[i] for i, n in enumerate(src) if n == 1):
        return None
    return Sharding(tuple(out), sharding.partial, sharding.reduce_op)


def size_of(shape) -> int:
    return math.prod(shape)


def unaligned_group(sharding: Sharding, src: tuple[int, ...], dst: tuple[int, ...], mesh: Mesh):
    """The one dim group of a reshape whose split cannot carry across exactly, as (first, last) src dims and
    (first, last) dst dims, when the rest of the reshape is the identity, the group is split only on its
    major dim and nothing is a partial sum: its rows then move by one exchange over the flattened group
    (see ops/core.py). None otherwise."""
    groups = [(gi, gj) for gi, gj in dim_groups(src, dst) if len(gi) > 1 or len(gj) > 1]
    if len(groups) != 1 or sharding.partial:
        return None
    (gi, gj), = groups
    (a, b), (c, d) = (gi[0], gi[-1]), (gj[0], gj[-1])
    if src[:a] != dst[:c] or src[b + 1:] != dst[d + 1:] or any(sharding.dims[i] for i in range(a + 1, b + 1)) \
            or mesh.axis_size(sharding.dims[a]) == 1:
        return None
    return (a, b), (c, d)
