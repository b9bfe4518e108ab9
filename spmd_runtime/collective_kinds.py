"""The collective kinds, ONE table: what every layer needs to know about each collective the partitioner emits.

One frozen ``CollectiveKind`` per kind, in ``KINDS`` (name -> kind):

- ``wire``: the bytes each rank puts on the wire (ring algorithms over k ranks, GSPMD_NOTES.md section 5), a key
  of ``WIRE``; ``"sent"``: what the planner's exchange table says its busiest rank moves (``cost.py``);
- ``steps``: the messages each rank sends one after another (the latency terms), a key of ``STEPS``: those of the
  logarithmic algorithms MPI libraries pick at scale (recursive halving / doubling, Rabenseifner's all-reduce;
  NCCL's trees likewise), whose bandwidth term equals the ring's; pairwise exchange for all-to-all;
- ``pair``: the (start, done) op names of its nonblocking split (MPI's ``I`` call posted at the start, waited
  for at the done; ``partition/schedule.py``, ``exec/rules/spmd.py``), or None: always blocking;
- ``sixteen_bit``: how float16 / bfloat16 buffers travel (``comm/low_precision.py``): ``BITS`` (viewed as uint16
  and moved, splittable like any move), ``FLOAT32`` (reduced in float32 over several collectives: blocking,
  never split) or ``AS_IS`` (the exchange's point-to-point rounds take the arrays as they are);
- ``attrs`` / ``optional`` / ``strings``: the attribute names an instruction of it must / may have, and the
  allowed values of its string attributes (``program_check.py``: a program file selects nothing by name);
- ``result``: how its local result shape follows from the operand's and the group size k (dims named by
  attributes grow or shrink k times), or None when the planner's table decides it (``result_shape``);
- ``group``: whom it runs over: ``AXES`` (the sub-communicator of its ``axes``) or ``WORLD`` (``pairs`` of world
  ranks); ``in_place``: it may reduce into its dying operand (``MPI.IN_PLACE``);
- ``rounds_of``: for an exchange (point-to-point rounds planned per program, not one MPI collective), the kind
  whose measured fit prices each of its k - 1 rounds; ``calibration``: the attributes ``calibrate.py`` times it
  with, besides its group.

The op records are made from this table in ``ops/spmd.py``; ``comm/collectives.py`` keys its binders by these
kinds. A floor module: it imports only the standard library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

AXES, WORLD = "axes", "world"  # a kind's group: the sub-communicator of its axes, or pairs of world ranks
BITS, FLOAT32, AS_IS = "bits", "float32", "as is"  # how 16-bit floats travel (module doc)
REDUCTIONS = ("sum", "max", "min", "prod")  # the elementwise ops a reducing collective takes (MPI.SUM, MAX, MIN, PROD)

# Bytes each rank sends for one collective over k > 1 ranks; S_in / S_out: its local bytes in / out.
WIRE = MappingProxyType({
    "2(k-1)/k*S_in": lambda k, s_in, s_out: 2 * (k - 1) / k * s_in,  # reduce-scatter + all-gather phases
    "(k-1)/k*S_in": lambda k, s_in, s_out: (k - 1) / k * s_in,
    "(k-1)/k*S_out": lambda k, s_in, s_out: (k - 1) / k * s_out,
    "S_in": lambda k, s_in, s_out: float(s_in),
})
# Messages each rank sends in sequence for one collective over k > 1 ranks (the algorithm's latency terms).
STEPS = MappingProxyType({
    "2log2(k)": lambda k: 2 * math.ceil(math.log2(k)),  # Rabenseifner: recursive halving, then doubling
    "log2(k)": lambda k: math.ceil(math.log2(k)),  # recursive doubling (all-gather) / halving (reduce-scatter)
    "k-1": lambda k: k - 1,  # pairwise exchange
    "1": lambda k: 1,
})
SENT = "sent"  # an exchange's wire bytes: its busiest rank's pieces, from the planner's table (not from k)


@dataclass(frozen=True, repr=False)
class CollectiveKind:
    name: str
    wire: str  # a key of WIRE, or SENT
    sixteen_bit: str  # BITS | FLOAT32 | AS_IS
    attrs: tuple[str, ...]  # required attribute names
    optional: tuple[str, ...] = ()  # optional attribute names
    strings: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (string attribute, its allowed values)
    pair: tuple[str, str] | None = None  # (start, done) op names of its nonblocking split; None: blocking only
    result: tuple[tuple[str, str], ...] | None = ()  # (attribute naming a dim, "*k" | "/k"), in order; None: planned
    group: str = AXES
    in_place: bool = False
    rounds_of: str | None = None  # an exchange: priced as k - 1 rounds of this kind's measured fit
    calibration: tuple[tuple[str, object], ...] = ()  # attributes calibrate.py times it with, besides its group
    steps: str = "log2(k)"  # a key of STEPS: its latency terms

    def __repr__(self):
        split = f", pair={'/'.join(self.pair)}" if self.pair else ""
        return f"CollectiveKind({self.name!r}, wire={self.wire}, 16-bit={self.sixteen_bit}{split})"

    @property
    def exchange(self) -> bool:
        """Point-to-point rounds from the planner's exchange table, bound by their own binder (not
        ``collectives.bind``) and not calibrated; priced as rounds of ``rounds_of``."""
        return self.rounds_of is not None

    def wire_bytes(self, k: int, bytes_in: int, bytes_out: int, sent: float | None = None) -> float:
        """Bytes each rank sends for one of this collective over ``k`` ranks (``sent``: an exchange's)."""
        if self.wire == SENT:
            return float(sent or 0)
        if k <= 1:
            return 0.0
        return WIRE[self.wire](k, bytes_in, bytes_out)

    def messages(self, k: int) -> int:
        """Messages each rank sends one after another for one of this collective over ``k`` ranks."""
        return STEPS[self.steps](k) if k > 1 else 0

    def result_shape(self, shape, k: int, attrs: dict) -> tuple[int, ...] | None:
        """The local result shape for an operand of local ``shape`` over a group of ``k``; None: planned."""
        if self.result is None:
            return None
        out = list(shape)
        for attr, change in self.result:
            dim = attrs[attr] % len(out)
            out[dim] = out[dim] * k if change == "*k" else out[dim] // k
        return tuple(out)


def _split(name: str) -> tuple[str, str]:
    """The (start, done) op names of a kind's nonblocking split."""
    return f"{name}_start", f"{name}_done"


_REDUCE_OP = (("op", REDUCTIONS),)
_ALL = (
    CollectiveKind("all_reduce", "2(k-1)/k*S_in", FLOAT32, ("axes",), ("op",), _REDUCE_OP, _split("all_reduce"),
                   in_place=True, steps="2log2(k)"),
    CollectiveKind("all_gather", "(k-1)/k*S_out", BITS, ("axes", "dim"), pair=_split("all_gather"),
                   result=(("dim", "*k"),), calibration=(("dim", 0),)),
    CollectiveKind("reduce_scatter", "(k-1)/k*S_in", FLOAT32, ("axes", "dim"), ("op",), _REDUCE_OP,
                   _split("reduce_scatter"), result=(("dim", "/k"),), calibration=(("dim", 0),)),
    CollectiveKind("all_to_all", "(k-1)/k*S_in", BITS, ("axes", "split_dim", "concat_dim"), pair=_split("all_to_all"),
                   result=(("split_dim", "/k"), ("concat_dim", "*k")),
                   calibration=(("split_dim", 0), ("concat_dim", 0)), steps="k-1"),
    CollectiveKind("collective_permute", "S_in", BITS, ("pairs",), pair=_split("collective_permute"), group=WORLD,
                   steps="1"),
    # the resharding planner's block exchange: rounds of point-to-point pieces within the group of its ``axes``;
    # ``maps`` (and ``fill``): a window exchange (slice, pad, concatenate)
    CollectiveKind("all_to_allv", SENT, AS_IS, ("src_dims", "dst_dims", "partial_axes", "axes", "wire_bytes"),
                   ("maps", "fill"), result=None, rounds_of="collective_permute", steps="k-1"),
    # every rank of the group gets the x of its rank ``root``: a pipelined broadcast forwards S per rank
    CollectiveKind("broadcast", "S_in", BITS, ("axes",), ("root",), pair=_split("broadcast")),
)
KINDS = MappingProxyType({kind.name: kind for kind in _ALL})
BY_START = MappingProxyType({kind.pair[0]: kind for kind in _ALL if kind.pair})  # start op name -> its kind
BY_DONE = MappingProxyType({kind.pair[1]: kind for kind in _ALL if kind.pair})  # done op name -> its kind

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE, ALL_TO_ALLV, BROADCAST = _ALL

__all__ = ["CollectiveKind", "KINDS", "BY_START", "BY_DONE", "WIRE", "STEPS", "SENT", "AXES", "WORLD", "BITS", "FLOAT32",
           "AS_IS", "REDUCTIONS", "ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL", "COLLECTIVE_PERMUTE",
           "ALL_TO_ALLV", "BROADCAST"]
