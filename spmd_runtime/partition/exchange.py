"""The block exchange (all_to_allv) without per-rank tables: its cost in closed form over the block layout, its
rounds for one rank at bind time.

Rank q's target block is cut into its intersections with the source blocks; a piece q holds stays local, any
other comes from one of its holders: the ranks of that source block that match q on the ``partial`` axes.

Mesh axes fall into A (split the source), B (split the target), P (partial) and the rest; C = A & B. Along the
axes that neither shardings split (R) every rank has identical twins, and identical P copies run side by side:
neither changes what the busiest rank moves, so nothing here enumerates them. The work is over per-dim blocks
and, where both shardings split an axis (C), over the coordinates of C: the exchange's own group, never N; of
those, only coordinate 0 of an axis that splits one dim alike in both (``_aligned``).

Who sends: a receiver's own replica of the block (its "default" holder: same coordinates off A) where that is as
good as spreading the sending; otherwise, per source block and R/P copy, the greedy that gives the biggest
pieces first to the least loaded holder (ties: the default, then the lowest position). The greedy's loads are
longest-processing-time scheduling, whose load multiset does not depend on how ties are broken: its busiest
holder is computed from the multiset of piece sizes alone (``_lpt_max``), equal to the old table that ran the
greedy over all N ranks at once (tests/unit/test_exchange_symbolic.py keeps that table as the reference).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from ..mesh import Mesh


@dataclass(frozen=True)
class ExchangeCost:
    axes: tuple[str, ...]  # the axes in which some sender and its receiver differ (the joint group)
    busiest: int  # elements the busiest rank sends to others or receives from them (its time on the wire)
    received: int  # elements the busiest receiver gets (no plan moves less)
    balanced: bool  # whether holders share the sending (else each receiver reads its own replica of a block)


def exchange_cost(src_dims, dst_dims, shape, mesh: Mesh, partial=(), maps=None) -> ExchangeCost:
    """Axes and busiest-rank elements of the all_to_allv src_dims -> dst_dims (``maps``: per dim None or a window
    map, see ``window_parts``)."""
    return _cost(*_normalised(src_dims, dst_dims, shape, partial, maps), mesh)


@lru_cache(maxsize=1 << 12)  # bounded, and each entry is a few integers
def _cost(src_dims, dst_dims, shape, partial, maps, mesh) -> ExchangeCost:
    return _Layout(src_dims, dst_dims, shape, mesh, partial, maps).cost()


def _normalised(src_dims, dst_dims, shape, partial, maps) -> tuple:
    """Hashable spellings (a program file gives lists)."""
    maps = (None,) * len(shape) if maps is None else tuple(None if m is None else tuple(int(v) for v in m)
                                                           for m in maps)
    return (tuple(map(tuple, src_dims)), tuple(map(tuple, dst_dims)), tuple(int(n) for n in shape), tuple(partial),
            maps)


def exchange_rounds(src_dims, dst_dims, shape, mesh: Mesh, rank: int, partial=(), maps=None):
    """(sends, recvs) of ``rank``: round 0 is the local piece, then every round in which it sends or receives,
    in round order (round s pairs mesh position p with p + s to send, p - s to receive): (peer, local slices or
    None). Work: the blocks this rank needs and holds, over the exchange's group."""
    src_dims, dst_dims, shape, partial, maps = _normalised(src_dims, dst_dims, shape, partial, maps)
    return _Layout(src_dims, dst_dims, shape, mesh, partial, maps).rounds(rank)


def receive_lower_bound(src_dims, dst_dims, shape, mesh: Mesh) -> int:
    """Elements the busiest rank must receive to go from src_dims to dst_dims: its target block less what of
    it it already holds. No plan moves less (a ring collective sends what it receives)."""
    return exchange_cost(src_dims, dst_dims, shape, mesh).received


class _Layout:
    def __init__(self, src_dims, dst_dims, shape, mesh, partial, maps):
        self.src, self.dst, self.shape, self.partial, self.maps = src_dims, dst_dims, shape, partial, maps
        self.mesh = mesh
        out_shape = tuple(n if m is None else m[2] for n, m in zip(shape, maps))
        A, B = {a for d in self.src for a in d}, {a for d in self.dst for a in d}
        names = mesh.axis_names
        self.C = tuple(a for a in names if a in A and a in B)
        self.AB = tuple(a for a in names if a in A and a not in B)
        self.BA = tuple(a for a in names if a in B and a not in A)
        self.free = tuple(a for a in names if a not in A and a not in self.partial)  # who may hold a piece
        # per dim, per target block j that holds entries: [(source block i, source slice, target slice)]; their
        # counts by i, and per source block i that some target reads: [(j, count)] and the multiset of counts.
        # Only blocks with entries are listed: a dim of n entries has at most n of them, however many shards.
        self.pieces = [{j: _checked(_overlaps(n, s, mesh, *_block(m, d, mesh, j), w), w, s, d)
                        for j in range(min(mesh.axis_size(d), _nonempty(m, mesh.axis_size(d))))}
                       for n, m, s, d, w in zip(shape, out_shape, self.src, self.dst, self.maps)]
        self.count = [{j: {i: _count((t,)) for i, _, t in per_j} for j, per_j in dim.items() if per_j}
                      for dim in self.pieces]
        self.by_source = []
        for dim in self.count:
            inv: dict = {}
            for j, counts in dim.items():
                for i, c in counts.items():
                    inv.setdefault(i, []).append((j, c))
            self.by_source.append(inv)
        self.every = [{i: tuple(sorted(Counter(n for _, n in pairs).items())) for i, pairs in inv.items()}
                      for inv in self.by_source]

    # ------------------------------------------------------------------ indices of blocks
    def _indices(self, axes, fixed):
        """Linear indices over ``axes`` (major first) of the coordinates that agree with ``fixed`` (a range when
        ``fixed`` names none of them, else a set)."""
        if not any(a in fixed for a in axes):
            return range(self.mesh.axis_size(axes))
        ranges = [(fixed[a],) if a in fixed else range(self.mesh.axis_size(a)) for a in axes]
        sizes = [self.mesh.axis_size(a) for a in axes]
        out = []
        for coords in itertools.product(*ranges):
            index = 0
            for c, s in zip(coords, sizes):
                index = index * s + c
            out.append(index)
        return set(out)

    def _digits(self, index, axes) -> dict:
        out = {}
        for a in reversed(axes):
            index, out[a] = divmod(index, self.mesh.axis_size(a))
        return out

    def _groups(self, axes, fixed=()):
        """Every coordinate assignment of ``axes`` (one empty one for none); the ``fixed`` ones at 0 only."""
        return (dict(zip(axes, c)) for c in itertools.product(*((0,) if a in fixed else range(self.mesh.axis_size(a))
                                                                for a in axes)))

    def _aligned(self) -> set:
        """C axes of a dim split alike in both shardings (the same axes, no window): along them target block j
        reads source block j only, so each coordinate's exchange is the first one's with every piece's extent on
        that dim scaled from the first block's length (the largest, in the layout rule) to block j's, and so are
        its loads: coordinate 0 is the busiest. Skipping the others keeps the work off the group's size (an SP
        reshard over stage x data x model splits every axis)."""
        return {a for s, d, m in zip(self.src, self.dst, self.maps) if s == d and m is None for a in s} & set(self.C)

    # ------------------------------------------------------------------ the cost
    def cost(self) -> ExchangeCost:
        received = sent_default = sent_lpt = 0
        differ = set()
        lpt = {}
        for c in self._groups(self.C, fixed=self._aligned()):
            src_ix = [self._indices(s, c) for s in self.src]
            dst_ix = [self._indices(d, c) for d in self.dst]
            if all(_present(js, self.count[d]) for d, js in enumerate(dst_ix)):  # they read something
                differ |= {a for a in self.AB if self.mesh.axis_size(a) > 1}
                differ |= {a for a in self.C if self._reads_elsewhere(a, c, dst_ix)}
                received = max(received, self._received(src_ix, dst_ix))
            own = [self._by_target(d, c) for d in range(len(self.shape))]
            sent_default = max(sent_default, self._default_load(src_ix, own))
            sent_lpt = max(sent_lpt, self._lpt_load(src_ix, own, lpt))
        busiest = max(received, sent_lpt)
        balanced = max(received, sent_default) != busiest
        if balanced:
            differ |= {a for a in self.BA if self.mesh.axis_size(a) > 1}
        return ExchangeCost(tuple(a for a in self.mesh.axis_names if a in differ), busiest, received, balanced)

    def _reads_elsewhere(self, axis, c, dst_ix) -> bool:
        """Whether receivers at C coordinates ``c`` read a source block whose ``axis`` coordinate is not theirs."""
        d = next(d for d, s in enumerate(self.src) if axis in s)
        return any(self._digits(i, self.src[d])[axis] != c[axis]
                   for j in _present(dst_ix[d], self.count[d]) for i in self.count[d][j])

    def _received(self, src_ix, dst_ix) -> int:
        """The most a receiver at these C coordinates gets: its target entries that read something, less its own
        block's piece (per dim the Pareto front of (entries, own piece): the maximum is monotone in both)."""
        fronts = []
        for d, (si, dj) in enumerate(zip(src_ix, dst_ix)):
            read = _present(dj, self.count[d])
            pairs = {(0, 0)} if len(read) < len(dj) else set()  # a target block that reads nothing
            for j in read:
                counts = self.count[d][j]
                total, mine = sum(counts.values()), [n for i, n in counts.items() if i in si]
                pairs.update((total, m) for m in mine)
                if len(mine) < len(si):
                    pairs.add((total, 0))
            fronts.append(_pareto(pairs))
        return max((math.prod(t for t, _ in combo) - math.prod(m for _, m in combo)
                    for combo in itertools.product(*fronts)), default=0)

    def _by_target(self, d, c) -> dict:
        """Dim d: B-minus-A coordinates g -> the target block of a receiver at C coordinates ``c`` and g."""
        ba = tuple(a for a in self.dst[d] if a in self.BA)
        return {tuple(g[a] for a in ba): _index({**c, **g}, self.dst[d], self.mesh) for g in self._groups(ba)}

    def _default_load(self, src_ix, own) -> int:
        """The most a holder of a block at these C coordinates sends when every receiver reads its own replica:
        K * prod(entries its block gives the receivers of its B-minus-A coordinates) - prod(its own piece)."""
        k = self.mesh.axis_size(self.AB)
        fronts = []
        for d, si in enumerate(src_ix):
            ba = tuple(a for a in self.dst[d] if a in self.BA)
            pairs = set()  # source blocks nobody reads give nothing: left out
            for i in _present(si, self.by_source[d]):
                gives = Counter()
                for j, n in self.by_source[d][i]:
                    gives[tuple(self._digits(j, self.dst[d])[a] for a in ba)] += n
                pairs.update((gives[g], self.count[d].get(j, {}).get(i, 0)) for g, j in own[d].items())
            fronts.append(_pareto(pairs))
        return max((k * math.prod(x for x, _ in combo) - math.prod(y for _, y in combo)
                    for combo in itertools.product(*fronts)), default=0)

    def _lpt_load(self, src_ix, own, memo) -> int:
        """The busiest holder of the greedy, per distinct source block at these C coordinates: the block's pieces
        (K copies of every target block's, less its own replicas' local ones) over its B-minus-A replicas."""
        k, holders = self.mesh.axis_size(self.AB), self.mesh.axis_size(self.BA)
        classes = []
        for d, si in enumerate(src_ix):
            keys = set()  # source blocks nobody reads have no pieces: left out
            for i in _present(si, self.by_source[d]):
                local = Counter(n for n in (self.count[d].get(j, {}).get(i, 0) for j in own[d].values()) if n)
                keys.add((self.every[d][i], tuple(sorted(local.items()))))
            classes.append(list(keys))
        best = 0
        for combo in itertools.product(*classes):
            if combo not in memo:
                sizes = _product([dict(every) for every, _ in combo], k)
                sizes.subtract(_product([dict(local) for _, local in combo], 1))
                memo[combo] = _lpt_max(sizes, holders)
            best = max(best, memo[combo])
        return best

    # ------------------------------------------------------------------ one rank's rounds
    def rounds(self, rank):
        mesh, coords = self.mesh, self.mesh.coords(rank)
        balanced = exchange_cost(self.src, self.dst, self.shape, mesh, self.partial, self.maps).balanced
        mine = tuple(mesh.index_along(rank, s) for s in self.src)
        local, sends, recvs = (None, None), {}, {}
        for block, piece in self._wanted(coords):
            if block == mine:
                local = piece
                continue
            recvs[self._holder(block, rank, coords, balanced)] = piece[1]
        for receiver, piece in self._served(rank, coords, mine, balanced):
            sends[receiver] = piece[0]
        return _in_rounds(mesh, rank, local, sends, recvs)

    def _wanted(self, coords):
        """(source block, (source slices, target slices)) of every piece of this receiver's target block."""
        per_dim = [self.pieces[d].get(_index(coords, dst, self.mesh), []) for d, dst in enumerate(self.dst)]
        for combo in itertools.product(*per_dim):
            yield tuple(i for i, _, _ in combo), (tuple(s for _, s, _ in combo), tuple(t for _, _, t in combo))

    def _rank_of(self, block, coords):
        """The rank with source block ``block`` and ``coords`` elsewhere."""
        fixed = dict(coords)
        for i, s in zip(block, self.src):
            fixed.update(self._digits(i, s))
        return self.mesh.rank_at(fixed)

    def _holder(self, block, rank, coords, balanced):
        if not balanced:
            return self._rank_of(block, coords)
        return _greedy(self, block, _copy_key(self, coords))[rank][0]

    def _served(self, rank, coords, mine, balanced):
        """(receiver, piece) of every piece this rank sends."""
        if balanced:
            for receiver, (holder, piece) in _greedy(self, mine, _copy_key(self, coords)).items():
                if holder == rank:
                    yield receiver, piece
            return
        for a in self._groups(tuple(x for x in self.mesh.axis_names if x in self.C + self.AB)):
            q = {**coords, **a}
            if q == coords:
                continue
            piece = self._piece(mine, q)
            if piece is not None:
                yield self.mesh.rank_at(q), piece

    def _piece(self, block, coords):
        """Receiver ``coords``'s piece of source block ``block`` (None: none)."""
        parts = []
        for d, i in enumerate(block):
            hit = [p for p in self.pieces[d].get(_index(coords, self.dst[d], self.mesh), ()) if p[0] == i]
            if not hit:
                return None
            parts.append(hit[0])
        return tuple(s for _, s, _ in parts), tuple(t for _, _, t in parts)


def _copy_key(layout, coords) -> tuple:
    """The coordinates that pick one greedy problem besides the block: P and the axes no sharding splits."""
    return tuple((a, coords[a]) for a in layout.mesh.axis_names if a not in layout.C + layout.AB + layout.BA)


def _greedy(layout, block, copy) -> dict:
    """receiver rank -> (holder rank, piece) for source ``block`` in the R/P copy ``copy`` (one rank asks for
    the blocks it needs and its own: a few entries, kept while it binds its program)."""
    return _greedy_cached((layout.src, layout.dst, layout.shape, layout.mesh, layout.partial, layout.maps),
                          block, copy)


@lru_cache(maxsize=64)
def _greedy_cached(layout_args, block, copy):
    return _run_greedy(_Layout(*layout_args), block, dict(copy))


def _run_greedy(layout, block, copy) -> dict:
    """Biggest pieces first (ties: lower receiver position), each to the least loaded holder of the block in
    this copy (ties: the receiver's own replica, then the lowest position)."""
    mesh = layout.mesh
    pos = mesh._position
    fixed = dict(copy)
    for i, s in zip(block, layout.src):
        fixed.update(layout._digits(i, s))
    holders = [mesh.rank_at({**fixed, **g}) for g in layout._groups(layout.BA)]
    demands = []
    for a in layout._groups(tuple(x for x in mesh.axis_names if x in layout.C + layout.AB + layout.BA)):
        q = {**copy, **a}
        if all(q[x] == fixed[x] for x in layout.C + layout.AB):
            continue  # it holds this block itself
        piece = layout._piece(block, q)
        if piece is not None:
            rank = mesh.rank_at(q)
            default = mesh.rank_at({**q, **{x: fixed[x] for x in layout.C + layout.AB}})
            demands.append((-_count(piece[1]), pos[rank], rank, default, piece))
    load = dict.fromkeys(holders, 0)
    heap = [(0, pos[h], h) for h in holders]
    heapq.heapify(heap)
    out = {}
    for size, _, rank, default, piece in sorted(demands, key=lambda t: t[:2]):
        while heap[0][0] != load[heap[0][2]]:
            heapq.heappop(heap)  # stale
        h = default if load[default] == heap[0][0] else heap[0][2]
        load[h] -= size
        heapq.heappush(heap, (load[h], pos[h], h))
        out[rank] = (h, piece)
    return out


def _in_rounds(mesh, rank, local, sends, recvs):
    n, me = mesh.size, mesh._position[rank]
    order = mesh.devices
    rounds = sorted({(mesh._position[d] - me) % n for d in sends} | {(me - mesh._position[s]) % n for s in recvs})
    send_list, recv_list = [(rank, local[0])], [(rank, local[1])]
    for s in rounds:
        dest, source = order[(me + s) % n], order[(me - s) % n]
        send_list.append((dest, sends.get(dest)))
        recv_list.append((source, recvs.get(source)))
    return send_list, recv_list


def _present(ix, table) -> list:
    """The keys of ``table`` among the indices ``ix`` (a range or a set), in the cost of the smaller."""
    if len(ix) > len(table):
        return [i for i in table if i in ix]
    return [i for i in ix if i in table]


def _nonempty(n, k) -> int:
    """How many of the k blocks of a dim of n entries hold any: ceil(n / ceil(n / k))."""
    return -(-n // -(-n // k)) if n else 0


def _index(coords, axes, mesh) -> int:
    index = 0
    for a in axes:
        index = index * mesh.axis_size(a) + coords[a]
    return index


def _pareto(pairs) -> list:
    """The (high, low) pairs no other pair beats on both (a bigger first and a smaller second)."""
    front, best_low = [], math.inf
    for high, low in sorted(pairs, key=lambda p: (-p[0], p[1])):
        if low < best_low:
            front.append((high, low))
            best_low = low
    return front


def _product(per_dim, times) -> Counter:
    """Piece sizes (with multiplicity) of the box products of per-dim {size: count}, each ``times`` times."""
    out = Counter({1: times})
    for dim in per_dim:
        nxt = Counter()
        for size, n in out.items():
            for s, m in dim.items():
                nxt[size * s] += n * m
        out = nxt
    return out


def _lpt_max(sizes: Counter, holders: int) -> int:
    """The busiest holder's load when pieces of ``sizes`` (size -> count), biggest first, each go to a least
    loaded one of ``holders``: tracked as a multiset of loads (value -> holders), which ties do not change."""
    loads = {0: holders}
    for size in sorted((s for s, n in sizes.items() if n > 0 and s > 0), reverse=True):
        left = sizes[size]
        while left:
            low = min(loads)
            if max(loads) - low <= size:  # everyone within one piece: whole rounds give each holder one
                rounds = left // holders
                if rounds:
                    loads = {v + rounds * size: c for v, c in loads.items()}
                    left -= rounds * holders
                    continue
            count = loads.pop(low)
            above = min(loads, default=math.inf)
            times = (above - low) // size + 1 if above < math.inf else math.inf
            if left >= count * times:
                loads[low + times * size] = loads.get(low + times * size, 0) + count
                left -= count * times
            else:
                full, extra = divmod(left, count)
                for value, c in ((low + full * size, count - extra), (low + (full + 1) * size, extra)):
                    if c:
                        loads[value] = loads.get(value, 0) + c
                left = 0
    return max(loads)


def _checked(pieces, window, src_axes, dst_axes):
    if len({p[0] for p in pieces}) < len(pieces):
        raise ValueError(f"a wrapped window map reads one source block twice for one target block (map {window}, "
                         f"source axes {src_axes}, target axes {dst_axes}): one exchange cannot carry two pieces per "
                         f"pair")
    return pieces


def _block(n, axes, mesh, j):
    c = -(-n // mesh.axis_size(axes))
    return min(j * c, n), min((j + 1) * c, n)


def _overlaps(n, axes, mesh, lo, hi, window=None):
    """(block index, local source slice, local target slice) of each source block (``axes`` blocks of a dim of
    size n) holding entries of the target block [lo, hi); ``window`` maps target entries to source entries (see
    ``window_parts``; None: the identity)."""
    offset, stride, _, first_read, end_read, dilation, wrap = window_parts(window, n)
    if wrap and hi > lo:  # source index modulo n: one linear piece per period the target block spans
        periods = range((offset + stride * lo) // n, (offset + stride * (hi - 1)) // n + 1)
        return [p for t in periods for p in _overlaps(n, axes, mesh, lo, hi, (offset - t * n, stride, hi, 0, n))]
    k = mesh.axis_size(axes)
    c = -(-n // k)
    if hi <= lo:
        return []
    if window is None:
        first, last = lo // c, -(-hi // c)
    elif stride > 0:  # the blocks holding source entries (offset + stride * [lo, hi)) / dilation, rounded out
        first, last = max(0, (offset + stride * lo) // dilation // c), (offset + stride * (hi - 1)) // dilation // c + 1
    else:
        first, last = 0, k
    out = []
    for i in range(max(first, 0), min(k, last)):
        s_lo, s_hi = max(i * c, first_read), min((i + 1) * c, n, end_read)
        if s_hi <= s_lo:
            continue
        # target j reads source (offset + stride * j) / dilation: j = (dilation * s - offset) / stride
        j0 = max(lo, -(-(dilation * s_lo - offset) // stride))
        j1 = min(hi, (dilation * (s_hi - 1) - offset) // stride + 1)
        if dilation > 1:  # stride 1 here: only every dilation-th target entry reads the source
            j0 += (-(offset + j0)) % dilation
        if j1 > j0:
            count = (j1 - j0 - 1) // dilation + 1
            src = (offset + stride * j0) // dilation - i * c  # local index in block i
            step = stride if dilation == 1 else 1
            out.append((i, slice(src, src + step * (count - 1) + 1, step),
                        slice(j0 - lo, j0 - lo + dilation * (count - 1) + 1, dilation)))
    return out


def window_parts(window, n):
    """(offset, stride, size, first, end, dilation, wrap) of a window map: target entry j of the dim reads source
    entry (offset + stride * j) / dilation when that divides exactly and lies in [first, end) (default: the
    whole source); the rest keep the fill value. Dilation > 1 (interior padding) needs stride 1; ``wrap`` 1
    takes the source index modulo n (a rotation: np.roll)."""
    if window is None:
        return 0, 1, n, 0, n, 1, 0
    offset, stride, size, *rest = window
    first, end, dilation, wrap = (list(rest) + [0, n, 1, 0][len(rest):])[:4]
    if dilation > 1 and stride != 1:
        raise ValueError(f"a window map with dilation {dilation} needs stride 1; got stride {stride}")
    return offset, stride, size, first, end, dilation, wrap


def _count(slices) -> int:
    """Entries of a box of slices (target slices of a dilated window are strided)."""
    return math.prod(len(range(s.start, s.stop, s.step or 1)) for s in slices)
