"""Issue 14's families, partitioned: collectives, float64 wire bytes per rank and notes per case.

    python scripts/partition_quality.py          # one line per case; run on two commits to compare

Families: roll/shift along a split dim, halos wider than a shard, reshapes across unaligned shard boundaries,
the kernel-gradient convolution (both operands split spatially), interior pad and dynamic_update_slice on a
split dim. Numerics are the tests' business (tests/unit/test_partition_quality.py); this prints the plans.
"""
from __future__ import annotations

import warnings

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp

M = {n: sr.Mesh((n,), ("x",)) for n in (2, 3, 4, 5, 8)}
M2x4 = sr.Mesh((2, 4), ("x", "y"))


def roll(s, axis=0):
    return lambda a: snp.roll(a, s, axis=axis)


def kernel_grad(padding):
    """The kernel-gradient conv of a (N=3, C=2, W) input and (N, O=4, W') cotangent: features as batch."""
    return lambda x, g: snp.conv(x, g, padding=padding)


CASES = [
    # family, name, fn, shapes, mesh, in_specs, out_spec
    ("roll", "roll +1, 16 rows, 4 dev", roll(1), [(16, 8)], M[4], [("x", None)], ("x", None)),
    ("roll", "roll -5, 16 rows, 4 dev", roll(-5), [(16, 8)], M[4], [("x", None)], ("x", None)),
    ("roll", "roll +4, 10 rows, 3 dev", roll(4), [(10, 8)], M[3], [("x", None)], ("x", None)),
    ("roll", "roll +3 cols, 2x4", roll(3, 1), [(8, 16)], M2x4, [("x", "y")], ("x", "y")),
    ("halo", "max pool w7, 16 rows, 8 dev", lambda a: snp.reduce_window(a, "max", (7, 1), (1, 1), "SAME"),
     [(16, 4)], M[8], [("x", None)], ("x", None)),
    ("halo", "sum pool w5 pad(4,0), 10 rows, 5 dev",
     lambda a: snp.reduce_window(a, "sum", (5, 1), (1, 1), ((4, 0), (0, 0))), [(10, 4)], M[5], [("x", None)],
     ("x", None)),
    ("halo", "conv k7 SAME, W=10, 5 dev", lambda a, k: snp.conv(a, k, padding="SAME"), [(2, 3, 10), (4, 3, 7)],
     M[5], [(None, None, "x"), None], (None, None, "x")),
    ("halo", "conv lhs dilation 2, W=10, 5 dev", lambda a, k: snp.conv(a, k, 1, ((2, 2),), lhs_dilation=2),
     [(2, 3, 10), (4, 3, 3)], M[5], [(None, None, "x"), None], (None, None, "x")),
    ("reshape", "merge (6,4)->(24,), 4 dev", lambda a: a.reshape(24), [(6, 4)], M[4], [("x", None)], ("x",)),
    ("reshape", "split (24,)->(6,4), 4 dev", lambda a: a.reshape(6, 4), [(24,)], M[4], [("x",)], ("x", None)),
    ("reshape", "merge (10,3)->(30,), 3 dev", lambda a: a.reshape(30), [(10, 3)], M[3], [("x", None)], ("x",)),
    ("conv", "kernel grad VALID W=16, 4 dev", kernel_grad("VALID"), [(2, 3, 16), (4, 3, 14)], M[4],
     [(None, None, "x"), (None, None, "x")], None),
    ("conv", "kernel grad SAME-padded W=16, 4 dev", kernel_grad(((1, 1),)), [(2, 3, 16), (4, 3, 16)], M[4],
     [(None, None, "x"), (None, None, "x")], None),
    ("conv", "kernel grad W=10, 5 dev", kernel_grad(((1, 1),)), [(2, 3, 10), (4, 3, 10)], M[5],
     [(None, None, "x"), (None, None, "x")], None),
    ("pad", "interior 1, (1,2), 16 rows, 4 dev", lambda a: snp.lax_pad(a, 0.0, [(1, 2, 1), (0, 0, 0)]), [(16, 8)],
     M[4], [("x", None)], ("x", None)),
    ("pad", "interior 2, 10 rows, 3 dev", lambda a: snp.lax_pad(a, 0.0, [(0, 0, 2), (0, 0, 0)]), [(10, 4)], M[3],
     [("x", None)], ("x", None)),
    ("dus", "update 4 rows at 6, 16 rows, 4 dev", lambda a, u: snp.dynamic_update_slice(a, u, (6, 0)),
     [(16, 8), (4, 8)], M[4], [("x", None), ("x", None)], ("x", None)),
]


def main():
    warnings.simplefilter("ignore")
    print(f"{'family':8} {'case':40} {'wire B':>8}  notes  collectives")
    for family, name, fn, shapes, mesh, in_specs, out_spec in CASES:
        graph = sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in shapes])
        program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=[out_spec])
        kinds = ", ".join(f"{c['kind']}{list(c['axes'])}" for c in program.comm_summary())
        print(f"{family:8} {name:40} {program.wire_bytes:8.0f}  {len(program.notes):5}  {kinds}")


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
