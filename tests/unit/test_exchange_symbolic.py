"""The block exchange's cost in closed form equals the table that enumerates every rank (issue 26): the busiest
rank's elements of every (source, target) pair of shardings on 1-8 rank meshes, uneven shapes, partial sources
and window maps; and each rank's own rounds, resolved alone, deliver exactly its target block.

The reference below is the planner as it was before it became symbolic: every rank's target block cut into its
intersections with the source blocks, each remote piece given (biggest first, in receiver order) to the least
loaded of its holders, the busiest rank's sent or received elements taken over all N ranks."""
import itertools

import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.partition.exchange import _block, _count, _overlaps, exchange_cost, exchange_rounds


def enumerated_busiest(src_dims, dst_dims, shape, mesh, partial=(), maps=None) -> int:
    maps = maps or (None,) * len(shape)
    out_shape = tuple(n if m is None else m[2] for n, m in zip(shape, maps))
    split = {a for d in src_dims for a in d}
    free = [a for a in mesh.axis_names if a not in split and a not in partial]
    remote = []
    for q in mesh.devices:
        coords = mesh.coords(q)
        want = [_block(m, d, mesh, mesh.index_along(q, d)) for m, d in zip(out_shape, dst_dims)]
        per_dim = [_overlaps(n, d, mesh, lo, hi, f) for n, d, (lo, hi), f in zip(shape, src_dims, want, maps)]
        if any(len({p[0] for p in pieces}) < len(pieces) for pieces in per_dim):
            raise ValueError("two pieces of one source block for one target block")
        for combo in itertools.product(*per_dim):
            fixed = dict(coords)
            for d, (index, _, _) in zip(src_dims, combo):
                for a in reversed(d):
                    index, fixed[a] = divmod(index, mesh.axis_size(a))
            if fixed == coords:
                continue
            holders = [mesh.rank_at({**fixed, **dict(zip(free, f))})
                       for f in itertools.product(*(range(mesh.axis_size(a)) for a in free))]
            size = _count(tuple(c[2] for c in combo))
            remote.append((-size, mesh.devices.index(q), q, mesh.rank_at(fixed), holders))
    load, received = dict.fromkeys(mesh.devices, 0), dict.fromkeys(mesh.devices, 0)
    for size, _, q, default, holders in sorted(remote, key=lambda t: t[:2]):
        h = min(holders, key=lambda c: (load[c], c != default, mesh.devices.index(c)))
        load[h] -= size
        received[q] -= size
    return max(max(load.values()), max(received.values()))


def shardings(mesh, ndim=2):
    per_dim = [p for r in range(len(mesh.axis_names) + 1) for p in itertools.permutations(mesh.axis_names, r)]
    for dims in itertools.product(per_dim, repeat=ndim):
        flat = [a for d in dims for a in d]
        if len(flat) == len(set(flat)):
            yield dims


MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    sr.Mesh((2, 2), ("x", "y")), sr.Mesh((2, 3), ("x", "y")), sr.Mesh((3, 2), ("x", "y")),
    sr.Mesh((2, 4), ("x", "y")), sr.Mesh((2, 2), ("x", "y"), devices=(3, 1, 2, 0))]
SHAPES = [(24, 24), (10, 7), (5, 3), (1, 9)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_busiest_rank_equals_the_enumerated_table(mesh):
    checked = 0
    for shape in SHAPES:
        for src, dst in itertools.product(list(shardings(mesh)), repeat=2):
            unused = [a for a in mesh.axis_names if a not in sum(src, ()) + sum(dst, ())]
            for partial in [()] + [(a,) for a in unused[:1]]:
                want = enumerated_busiest(src, dst, shape, mesh, partial)
                assert exchange_cost(src, dst, shape, mesh, partial).busiest == want, (src, dst, shape, partial)
                checked += 1
    assert checked >= 4 * len(list(shardings(mesh))) ** 2


def test_busiest_rank_equals_the_enumerated_table_on_three_axes():
    mesh = sr.Mesh((2, 1, 3), ("x", "y", "z"))
    pairs = list(itertools.product(list(shardings(mesh)), repeat=2))[::7]  # every 7th pair: ~1000 of them
    for shape in [(10, 7), (1, 9)]:
        for src, dst in pairs:
            assert exchange_cost(src, dst, shape, mesh).busiest == enumerated_busiest(src, dst, shape, mesh)


# window maps (offset, stride, size[, first, end[, dilation[, wrap]]]) per dim: slices, pads, shifts, rotations
WINDOWS = [((1, 3, 5), None), ((5, 1, 2), None), ((-1, 1, 19), None), ((-1, 1, 16), None), ((2, 1, 7), None),
           ((-2, 1, 33, 0, 16, 2), None), ((3, 1, 16, 0, 16, 1, 1), None), ((2, 1, 12), (4, 1, 8))]


@pytest.mark.parametrize("mesh", [sr.Mesh((4,), ("x",)), sr.Mesh((3,), ("x",)), sr.Mesh((2, 3), ("x", "y")),
                                  sr.Mesh((2, 2), ("x", "y"))], ids=str)
@pytest.mark.parametrize("maps", WINDOWS, ids=str)
def test_window_exchanges_equal_the_enumerated_table(mesh, maps):
    shape = (16, 16)
    for src, dst in itertools.product(list(shardings(mesh)), repeat=2):
        try:
            want = enumerated_busiest(src, dst, shape, mesh, (), maps)
        except ValueError:  # a wrapped window reading one block twice: refused by both
            with pytest.raises(ValueError, match="reads one source block twice"):
                exchange_cost(src, dst, shape, mesh, (), maps)
            continue
        assert exchange_cost(src, dst, shape, mesh, (), maps).busiest == want, (src, dst)


def _padded_block(x, dims, mesh, rank):
    index = tuple(slice(*_block(n, d, mesh, mesh.index_along(rank, d))) for n, d in zip(x.shape, dims))
    block = x[index]
    return np.pad(block, [(0, -(-n // mesh.axis_size(d)) - b) for n, d, b in zip(x.shape, dims, block.shape)])


def exchanged(x, src, dst, mesh, partial=(), maps=None) -> dict:
    """Every rank's result of the exchange, from the rounds each rank resolved for itself alone."""
    rounds = {r: exchange_rounds(src, dst, x.shape, mesh, r, partial, maps) for r in mesh.devices}
    wire = {(r, dest): _padded_block(x, src, mesh, r)[sl]
            for r, (sends, _) in rounds.items() for dest, sl in sends[1:] if sl is not None}
    out_shape = [n if m is None else m[2] for n, m in zip(x.shape, maps or (None,) * x.ndim)]
    result = {}
    for r, (sends, recvs) in rounds.items():
        out = np.zeros([-(-n // mesh.axis_size(d)) for n, d in zip(out_shape, dst)])
        if sends[0][1] is not None:
            out[recvs[0][1]] = _padded_block(x, src, mesh, r)[sends[0][1]]
        for source, sl in recvs[1:]:
            if sl is not None:
                out[sl] = wire.pop((source, r))  # both sides agree on every piece
        result[r] = out
    assert not wire, f"pieces sent that nobody receives: {sorted(wire)[:4]}"
    return result


@pytest.mark.parametrize("mesh", [sr.Mesh((3,), ("x",)), sr.Mesh((2, 3), ("x", "y")),
                                  sr.Mesh((2, 2), ("x", "y"), devices=(3, 1, 2, 0)),
                                  sr.Mesh((2, 1, 2), ("x", "y", "z"))], ids=str)
@pytest.mark.parametrize("shape", [(10, 7), (1, 9)], ids=str)
def test_each_ranks_own_rounds_deliver_its_target_block(mesh, shape):
    x = np.arange(1, np.prod(shape) + 1, dtype=np.float64).reshape(shape)
    for src, dst in itertools.product(list(shardings(mesh)), repeat=2):
        out = exchanged(x, src, dst, mesh)
        for r in mesh.devices:
            assert np.array_equal(out[r], _padded_block(x, dst, mesh, r)), (src, dst, r)
