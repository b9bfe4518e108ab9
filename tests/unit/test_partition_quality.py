"""Issue 14's last gather fallbacks, closed as families: roll along a split dim, interior padding, halos wider
than a shard, reshapes across unaligned shard boundaries, the kernel-gradient convolution (both operands split
on a spatial dim) and dynamic_update_slice along a split dim. Table: (op, shapes, mesh, shardings) -> the exact
collectives and float64 wire bytes per rank, worked out by hand in the comments, no partitioner note, and
numerics against the reference evaluator on every simulated rank."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp

from simulated import assert_all_ranks, collectives

M = {n: sr.Mesh((n,), ("x",)) for n in (2, 3, 4, 5, 8)}
M2x4 = sr.Mesh((2, 4), ("x", "y"))
ROWS = ("x", None)
X = ("x",)
PERMUTE = ("collective_permute", X)
EXCHANGE = ("all_to_allv", X)

# (name, fn, shapes, mesh, in_specs, out_spec, expected [(kind, axes)], wire bytes)
ROLL = [
    # 4-row blocks, offset 15 = 3 blocks + 3 rows: the last row of block j-1, the rest of block j stays
    ("roll_1_of_16_on_4", lambda a: snp.roll(a, 1, 0), [(16, 8)], M[4], [ROWS], ROWS, [PERMUTE], 8 * 8),
    # offset 5 = 1 block + 1 row: 3 rows of block j+1 and 1 row of block j+2 (every row changes owner)
    ("roll_minus_5_of_16_on_4", lambda a: snp.roll(a, -5, 0), [(16, 8)], M[4], [ROWS], ROWS, [PERMUTE, PERMUTE],
     4 * 8 * 8),
    # 3-row blocks, offset 5 = 1 block + 2 rows: 1 row of block j+1, 2 of block j+2 = j (local)
    ("roll_1_of_6_on_2", lambda a: snp.roll(a, 1, 0), [(6, 4)], M[2], [ROWS], ROWS, [PERMUTE], 4 * 8),
    # 2-row blocks, offset 7 = 3 blocks + 1 row: 1 row each of blocks j+3 and j+4
    ("roll_3_of_10_on_5", lambda a: snp.roll(a, 3, 0), [(10, 4)], M[5], [ROWS], ROWS, [PERMUTE, PERMUTE], 2 * 4 * 8),
    # 5-row blocks, offset 38 = 7 blocks + 3 rows: 2 rows of block j-1, 3 of block j (local)
    ("roll_2_of_40_on_8", lambda a: snp.roll(a, 2, 0), [(40, 4)], M[8], [ROWS], ROWS, [PERMUTE], 2 * 4 * 8),
    # cols in 4-col blocks over y: 3 cols of block j-1 (4 rows of each)
    ("roll_cols_on_2x4", lambda a: snp.roll(a, 3, 1), [(8, 16)], M2x4, [("x", "y")], ("x", "y"),
     [("collective_permute", ("x", "y"))], 3 * 4 * 8),
    # uneven (4-row blocks of 10 on 3): one exchange whose window wraps around, result p reading x[(p + 6) % 10]:
    # rank 0 receives rows 6-9 (ranks 1, 2), rank 1 rows 0-3 (rank 0), rank 2 rows 4, 5 (rank 1): 4 rows at most
    ("roll_4_of_10_on_3_uneven", lambda a: snp.roll(a, 4, 0), [(10, 8)], M[3], [ROWS], ROWS, [EXCHANGE], 4 * 8 * 8),
    # 13 rows in 4-blocks, p reads x[(p + 8) % 13]: ranks 0, 1 and 2 each send 4 rows
    ("roll_5_of_13_on_4_uneven", lambda a: snp.roll(a, 5, 0), [(13, 4)], M[4], [ROWS], ROWS, [EXCHANGE], 4 * 4 * 8),
]

INTERIOR_PAD = [
    # 34 rows in 9-row blocks: operand row q lands on 1 + 2q; block 1 (rows 9-17) takes q = 4..8, q = 8 from rank 2
    ("interior_1_on_4", lambda a: snp.lax_pad(a, 0.0, [(1, 2, 1), (0, 0, 0)]), [(16, 8)], M[4], [ROWS], ROWS,
     [EXCHANGE], 8 * 8),
    # 28 rows in 10-row blocks, q -> 3q: block 2 (rows 20-27) takes q = 7, 8, 9, q = 7 from rank 1
    ("interior_2_uneven_on_3", lambda a: snp.lax_pad(a, 0.0, [(0, 0, 2), (0, 0, 0)]), [(10, 4)], M[3], [ROWS], ROWS,
     [EXCHANGE], 4 * 8),
    # 22 rows in 5-row blocks, q -> 2 + 2q: q = 6 moves to rank 2 and q = 8 to rank 3, one row each
    ("interior_1_on_5", lambda a: snp.lax_pad(a, -1.5, [(2, 1, 1), (0, 0, 0)]), [(10, 4)], M[5], [ROWS], ROWS,
     [EXCHANGE], 4 * 8),
    # 14 rows in 7-row blocks, q -> 3 + 2q: block 1 (rows 7-13) takes q = 2..5, q = 2 from rank 0
    ("interior_1_on_2", lambda a: snp.lax_pad(a, 0.0, [(3, 0, 1), (0, 0, 0)]), [(6, 4)], M[2], [ROWS], ROWS,
     [EXCHANGE], 4 * 8),
    # 34 rows in 5-row blocks, q -> 3 + 2q: rank 5 takes q = 12, 13 from rank 6, rank 6 q = 14, 15 from rank 7
    ("interior_1_on_8", lambda a: snp.lax_pad(a, 0.0, [(3, 0, 1), (0, 0, 0)]), [(16, 4)], M[8], [ROWS], ROWS,
     [EXCHANGE], 2 * 4 * 8),
    # cols over y: 18 cols in 5-col blocks, q -> 3 + 2q: y=1 takes col q = 1 from y=0 (2 local rows)
    ("interior_cols_on_2x4", lambda a: snp.lax_pad(a, 0.0, [(0, 0, 0), (3, 0, 1)]), [(4, 8)], M2x4, [("x", "y")],
     ("x", "y"), [("all_to_allv", ("y",))], 2 * 8),
]

CONV = lambda pad, dil=1: lambda a, k: snp.conv(a, k, padding=pad, rhs_dilation=dil)  # noqa: E731
SPATIAL = (None, None, "x")
WIDE_HALO = [
    # SAME pads 3 and 3 with 2-row blocks: 2 rows of block i-1 and 1 of i-2, mirrored on the right (4 hops)
    ("maxpool_7_of_16_on_8", lambda a: snp.reduce_window(a, "max", (7, 1), (1, 1), "SAME"), [(16, 4)], M[8], [ROWS],
     ROWS, [PERMUTE] * 4, 6 * 4 * 8),
    ("maxpool_7_of_6_on_3", lambda a: snp.reduce_window(a, "max", (7, 1), (1, 1), "SAME"), [(6, 4)], M[3], [ROWS],
     ROWS, [PERMUTE] * 4, 6 * 4 * 8),
    # asymmetric: output block i reads rows [2i - 4, 2i + 2): a left halo of 4 (2 hops), none on the right
    ("sumpool_low_4_on_5", lambda a: snp.reduce_window(a, "sum", (5, 1), (1, 1), ((4, 0), (0, 0))), [(10, 4)], M[5],
     [ROWS], ROWS, [PERMUTE] * 2, 4 * 4 * 8),
    # stride 2, 5 outputs in 2-row blocks: block i reads rows [4i, 4i + 10): a right halo of 6 on 4-row blocks
    # (4 rows of block i+1, 2 of block i+2), none on the left
    ("sumpool_8_stride_2_on_4", lambda a: snp.reduce_window(a, "sum", (8, 1), (2, 1)), [(16, 4)], M[4], [ROWS],
     ROWS, [PERMUTE] * 2, 6 * 4 * 8),
    # conv kernel 7 SAME on 2-wide blocks: halos of 3 both sides, rows of N * C = 6 elements
    ("conv_7_same_on_5", CONV("SAME"), [(2, 3, 10), (4, 3, 7)], M[5], [SPATIAL, None], SPATIAL, [PERMUTE] * 4,
     6 * 6 * 8),
    # uneven: 9 wide in 3-wide blocks, kernel 9 SAME: halos of 4 (2 hops each side)
    ("conv_9_same_uneven_on_4", CONV("SAME"), [(2, 3, 9), (4, 3, 9)], M[4], [SPATIAL, None], SPATIAL, [PERMUTE] * 4,
     8 * 6 * 8),
    # rhs dilation 3: a kernel of 3 spans 7, SAME: halos of 3 on 2-wide blocks
    ("conv_dilated_on_4", CONV("SAME", 3), [(2, 3, 8), (4, 3, 3)], M[4], [SPATIAL, None], SPATIAL, [PERMUTE] * 4,
     6 * 6 * 8),
    # lhs dilation 2 (the input gradient of a stride-2 conv): 19 dilated positions padded 2 + 2, 21 outputs in
    # 5-blocks; block i reads dilated [5i - 2, 5i + 5), elements ceil((5i - 2) / 2) to (5i + 4) // 2 (the
    # phase alternates): a left halo of 1 and a right one of 2, each shard cutting its window dilated
    ("conv_lhs_dilated_on_5", lambda a, k: snp.conv(a, k, 1, ((2, 2),), lhs_dilation=2), [(2, 3, 10), (4, 3, 3)],
     M[5], [SPATIAL, None], SPATIAL, [PERMUTE] * 2, 3 * 6 * 8),
    # 2-d mesh, cols over y in 2-col blocks, window 7: 3 cols each side of 2 local rows
    ("maxpool_cols_on_2x4", lambda a: snp.reduce_window(a, "max", (1, 7), (1, 1), "SAME"), [(4, 8)], M2x4,
     [("x", "y")], ("x", "y"), [("collective_permute", ("x", "y"))] * 4, 6 * 2 * 8),
]

KGRAD = lambda pad: lambda x, g: snp.conv(x, g, padding=pad)  # noqa: E731  (input and cotangent, features as batch)
ALL_REDUCE = ("all_reduce", X)
OUT = 2 * 4 * 3 * 8  # the (2, 4, 3) float64 result: 192 B
KERNEL_GRAD = [
    # taps and positions in 4-blocks, 3 outputs: shard i reads positions [4i, 4i + 6): 2 rows from block i+1
    # (rows of N * C = 6), then the partial result is all-reduced: 2 * 3/4 * 192 B
    ("kernel_grad_valid_on_4", KGRAD("VALID"), [(2, 3, 16), (4, 3, 14)], M[4], [SPATIAL, SPATIAL], None,
     [PERMUTE, ALL_REDUCE], 2 * 6 * 8 + 2 * OUT * 3 // 4),
    # padding 1: shard i reads positions [4i - 1, 4i + 5): one row from each neighbour
    ("kernel_grad_padded_on_4", KGRAD(((1, 1),)), [(2, 3, 16), (4, 3, 16)], M[4], [SPATIAL, SPATIAL], None,
     [PERMUTE, PERMUTE, ALL_REDUCE], 2 * 6 * 8 + 2 * OUT * 3 // 4),
    # the result wanted split on output features: a reduce-scatter instead (3/4 * 192 B)
    ("kernel_grad_reduce_scatter_on_4", KGRAD(((1, 1),)), [(2, 3, 16), (4, 3, 16)], M[4], [SPATIAL, SPATIAL],
     (None, "x", None), [PERMUTE, PERMUTE, ("reduce_scatter", X)], 2 * 6 * 8 + OUT * 3 // 4),
    # uneven: 9 positions and taps in 3-blocks (shard 3 holds padding only: masked taps add nothing)
    ("kernel_grad_uneven_on_4", KGRAD(((1, 1),)), [(2, 3, 9), (4, 3, 9)], M[4], [SPATIAL, SPATIAL], None,
     [PERMUTE, PERMUTE, ALL_REDUCE], 2 * 6 * 8 + 2 * OUT * 3 // 4),
    # 3 taps on 3 devices: propagation keeps the spatial split on the result, so a reduce-scatter (2/3 * 192 B)
    ("kernel_grad_on_3", KGRAD(((1, 1),)), [(2, 3, 12), (4, 3, 12)], M[3], [SPATIAL, SPATIAL], None,
     [PERMUTE, PERMUTE, ("reduce_scatter", X)], 2 * 6 * 8 + OUT * 2 // 3),
    ("kernel_grad_on_5", KGRAD(((1, 1),)), [(2, 3, 10), (4, 3, 10)], M[5], [SPATIAL, SPATIAL], None,
     [PERMUTE, PERMUTE, ALL_REDUCE], 2 * 6 * 8 + 2 * OUT * 4 / 5),
    ("kernel_grad_on_8", KGRAD(((1, 1),)), [(2, 3, 32), (4, 3, 32)], M[8], [SPATIAL, SPATIAL], None,
     [PERMUTE, PERMUTE, ALL_REDUCE], 2 * 6 * 8 + 2 * OUT * 7 // 8),
    # 2-d mesh, positions and taps over y (x free): as on 4 devices, the all-reduce over y
    ("kernel_grad_on_2x4", KGRAD(((1, 1),)), [(2, 3, 16), (4, 3, 16)], M2x4, [(None, None, "y")] * 2, None,
     [("collective_permute", ("x", "y"))] * 2 + [("all_reduce", ("y",))], 2 * 6 * 8 + 2 * OUT * 3 // 4),
    # 2 blocks of 4, one output: every tap meets only its own block's positions, no halo
    ("kernel_grad_valid_on_2", KGRAD("VALID"), [(2, 3, 8), (4, 3, 8)], M[2], [SPATIAL, SPATIAL], None,
     [ALL_REDUCE], 2 * (2 * 4 * 8) // 2),
]

RESHAPE = [
    # rows of 4 in 2-row blocks = flat blocks of 8 against flat blocks of 6: rank 3 takes flat 18-23 from rank 2
    ("merge_6x4_on_4", lambda a: a.reshape(24), [(6, 4)], M[4], [ROWS], ("x",), [EXCHANGE], 6 * 8),
    # the inverse: rank 2's rows 4-5 are flat 16-23, 18-23 of them from rank 3
    ("split_24_on_4", lambda a: a.reshape(6, 4), [(24,)], M[4], [("x",)], ROWS, [EXCHANGE], 6 * 8),
    # flat blocks of 12 against 10: rank 2 takes flat 20-23 from rank 1
    ("merge_10x3_uneven_on_3", lambda a: a.reshape(30), [(10, 3)], M[3], [ROWS], ("x",), [EXCHANGE], 4 * 8),
    ("split_30_uneven_on_3", lambda a: a.reshape(10, 3), [(30,)], M[3], [("x",)], ROWS, [EXCHANGE], 4 * 8),
    # flat blocks of 8 against 6 on rank 1: flat 6, 7 from rank 0
    ("merge_3x4_on_2", lambda a: a.reshape(12), [(3, 4)], M[2], [ROWS], ("x",), [EXCHANGE], 2 * 8),
    # flat blocks of 10 against 7: rank 2 sends flat 21-27 to rank 3 and 28-29 to rank 4 (9 entries)
    ("merge_7x5_on_5", lambda a: a.reshape(35), [(7, 5)], M[5], [ROWS], ("x",), [EXCHANGE], 9 * 8),
    # flat blocks of 4 against 3: ranks 4 and 5 each send 4 entries
    ("merge_12x2_on_8", lambda a: a.reshape(24), [(12, 2)], M[8], [ROWS], ("x",), [EXCHANGE], 4 * 8),
    # 2-d mesh: the batch over x stays, the merged dim over y moves as on 4 devices (one batch row)
    ("merge_on_2x4", lambda a: a.reshape(2, 24), [(2, 6, 4)], M2x4, [("x", "y", None)], ("x", "y"),
     [("all_to_allv", ("y",))], 6 * 8),
]

DUS = lambda *starts: lambda a, u: snp.dynamic_update_slice(a, u, starts)  # noqa: E731
DYNAMIC_UPDATE = [
    # update rows 0-3 (one per rank) land on rows 6-9: rank 0's row goes to rank 1, rank 3's to rank 2
    ("dus_static_on_4", DUS(6, 0), [(16, 8), (4, 8)], M[4], [ROWS, ROWS], ROWS, [EXCHANGE], 8 * 8),
    # uneven: update rows in 2-blocks onto x rows 3-7 in 4-blocks: rank 1 takes update rows 1 (rank 0) and 4 (rank 2)
    ("dus_uneven_on_3", DUS(3, 0), [(10, 4), (5, 4)], M[3], [ROWS, ROWS], ROWS, [EXCHANGE], 2 * 4 * 8),
    # onto rows 7-9: rank 4 takes update rows 1 and 2 from ranks 1 and 2
    ("dus_on_5", DUS(7, 0), [(10, 4), (3, 4)], M[5], [ROWS, ROWS], ROWS, [EXCHANGE], 2 * 4 * 8),
    # start 14 clamps to 12: rows 12-15 all on rank 3, three of them from ranks 0-2
    ("dus_clamped_on_4", DUS(14, 0), [(16, 8), (4, 8)], M[4], [ROWS, ROWS], ROWS, [EXCHANGE], 3 * 8 * 8),
    # update row j (rank j) onto row 3 + j (rank (3 + j) // 2): rank 4 takes rows 5 and 6
    ("dus_on_8", DUS(3, 0), [(16, 4), (8, 4)], M[8], [ROWS, ROWS], ROWS, [EXCHANGE], 2 * 4 * 8),
    # cols 0-5 (2-blocks over y) onto cols 5-10 (4-blocks): y=1 takes 2 cols from y=0, 2 rows each
    ("dus_on_2x4", DUS(2, 5), [(8, 16), (4, 6)], M2x4, [("x", "y"), ("x", "y")], ("x", "y"),
     [("all_to_allv", ("y",))], 2 * 2 * 8),
    # rows 1, 2 both on rank 0: update row 1 comes from rank 1
    ("dus_on_2", DUS(1, 0), [(6, 4), (2, 4)], M[2], [ROWS, ROWS], ROWS, [EXCHANGE], 4 * 8),
    # a replicated update: every rank writes its own rows, nothing moves
    ("dus_replicated_update", DUS(6, 0), [(16, 8), (4, 8)], M[4], [ROWS, None], ROWS, [], 0),
]


def check(fn, shapes, mesh, in_specs, out_spec, expected, wire, tol=0.0):
    graph = sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in shapes])
    program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=[out_spec])
    assert collectives(program) == expected, str(program)
    assert program.wire_bytes == pytest.approx(wire, rel=1e-12), str(program)
    assert program.notes == [], str(program)
    args = [np.random.default_rng(k).standard_normal(s) for k, s in enumerate(shapes)]
    assert_all_ranks(program, args, sr.evaluate(graph, *args), tol)


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", ROLL, ids=[t[0] for t in ROLL])
def test_roll_moves_boundary_rows(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire)


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", INTERIOR_PAD,
                         ids=[t[0] for t in INTERIOR_PAD])
def test_interior_pad_moves_rows_that_change_owner(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire)


def test_roll_matches_numpy():
    x = np.arange(24.0).reshape(6, 4)
    for shift, axis in ((1, 0), (-2, 1), (7, None), (0, 0)):
        graph = sr.trace(lambda a: snp.roll(a, shift, axis), sr.TensorSpec(x.shape, "float64"))
        np.testing.assert_array_equal(sr.evaluate(graph, x)[0], np.roll(x, shift, axis))


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", WIDE_HALO,
                         ids=[t[0] for t in WIDE_HALO])
def test_wide_halo_by_multi_hop_permutes(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    # an lhs-dilated conv runs as col2im on the whole input (the reference) but as im2col on each shard's window,
    # cut already dilated: the same products, added in another order
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire, tol=1e-12 if "lhs_dilated" in name else 0.0)


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", KERNEL_GRAD,
                         ids=[t[0] for t in KERNEL_GRAD])
def test_kernel_gradient_conv_reduces_partial_output(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire, tol=1e-12)  # partial sums add in another order


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", RESHAPE, ids=[t[0] for t in RESHAPE])
def test_unaligned_reshape_exchanges_rows_that_cross(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire)


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", DYNAMIC_UPDATE,
                         ids=[t[0] for t in DYNAMIC_UPDATE])
def test_dynamic_update_slice_moves_update_rows_to_owners(name, fn, shapes, mesh, in_specs, out_spec, expected,
                                                          wire):
    check(fn, shapes, mesh, in_specs, out_spec, expected, wire)
