"""Slices, pads and concatenations along split dims as block exchanges (all_to_allv with window maps): each
rank receives only the rows its block needs from the rank that holds them, never a gather of the operand
or a reduce-scatter of a zero-filled copy. Table: (op, shapes, mesh, shardings) -> exact collectives and
float64 wire bytes per rank, worked out by hand, plus numerics against the reference."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp

from simulated import assert_all_ranks, collectives

M3, M4, M5, M2x4 = (sr.Mesh((3,), ("x",)), sr.Mesh((4,), ("x",)), sr.Mesh((5,), ("x",)),
                    sr.Mesh((2, 4), ("x", "y")))
ROWS = ("x", None)

# (name, fn, shapes, mesh, in_specs, out_spec, expected [(kind, axes)], wire bytes)
TABLE = [
    # 8 rows into 2-row blocks: rank 1 sends row 4 (to 0) and row 7 (to 2), rank 2 rows 9, 10 (to 3)
    ("slice_rows_3_11", lambda a: a[3:11], [(16, 8)], M4, [ROWS], ROWS, [("all_to_allv", ("x",))], 2 * 64),
    # rows 1, 4, 7, 10, 13: ranks 1, 2, 3 each send one row
    ("strided_slice", lambda a: a[1:15:3], [(16, 8)], M4, [ROWS], ROWS, [("all_to_allv", ("x",))], 64),
    # rows 5, 6 both on rank 1; their 1-row targets are ranks 0 and 1: row 5 moves
    ("tiny_slice_inside_one_shard", lambda a: a[5:7], [(16, 8)], M4, [ROWS], ROWS, [("all_to_allv", ("x",))], 64),
    # uneven: rows 2-9 of 13 on 5 ranks (3-row blocks in, 2-row blocks out): rows 3 and 8 move, 4 wide
    ("uneven_slice_5_ranks", lambda a: a[2:9], [(13, 4)], M5, [ROWS], ROWS, [("all_to_allv", ("x",))], 32),
    # pad 1 low 2 high, 19 rows in 5-row blocks: rank 2 wants rows 9-13, holds 8-11: rows 12, 13 move
    ("pad_low_1_high_2", lambda a: snp.pad(a, ((1, 2), (0, 0)), constant_values=7.0), [(16, 8)], M4, [ROWS],
     ROWS, [("all_to_allv", ("x",))], 2 * 64),
    # 10 rows padded 2 low 3 high on 5 ranks (2-row blocks in, 3-row blocks out): rank 3 wants rows 7-9 and
    # holds 6-7: rows 8, 9 move (4 wide)
    ("uneven_pad_5_ranks", lambda a: snp.pad(a, ((2, 3), (0, 0))), [(10, 4)], M5, [ROWS], ROWS,
     [("all_to_allv", ("x",))], 2 * 32),
    # both dims on a 2-d mesh: rows stay home, cols 4-5 (y=1 to y=0) and 10-11 (y=2 to y=3) move, 6 rows each
    ("slice_2d_mesh", lambda a: a[2:14, 4:12], [(16, 16)], M2x4, [("x", "y")], ("x", "y"),
     [("all_to_allv", ("y",))], 6 * 2 * 8),
    # 6 + 3 rows on 3 ranks: out block 1 (rows 3-5) needs a's rows 4, 5 from rank 2 (2 rows x 4 wide);
    # out block 2 needs b's rows 0, 1 from ranks 0 and 1 (rank 2 receives 2 rows)
    ("concatenate_split_rows", lambda a, b: snp.concatenate([a, b], axis=0), [(6, 4), (3, 4)], M3, [ROWS, ROWS],
     ROWS, [("all_to_allv", ("x",)), ("all_to_allv", ("x",))], 2 * 32 + 2 * 32),
]


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_spec,expected,wire", TABLE, ids=[t[0] for t in TABLE])
def test_exchange_moves_only_rows_that_change_owner(name, fn, shapes, mesh, in_specs, out_spec, expected, wire):
    graph = sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in shapes])
    program = sr.partition(graph, mesh, in_specs=in_specs, out_specs=[out_spec])
    assert collectives(program) == expected, str(program)
    assert program.wire_bytes == wire, str(program)
    assert program.notes == []
    args = [np.random.default_rng(k).standard_normal(s) for k, s in enumerate(shapes)]
    assert_all_ranks(program, args, sr.evaluate(graph, *args))
