"""The windowed op family (conv, reduce_window, cumsum): kernels against explicit loops, halo plans
against a one-process emulation of every shard, the case table partitioned on many meshes in the
simulated world against the reference evaluator, and the exact collectives of the halo exchange."""
import itertools

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.opdef import OPS
from spmd_runtime.ops import windows
from spmd_runtime.ops.windows import out_size
from spmd_runtime.partition.rules.windows import halo_plan, shift_pairs
from spmd_runtime.cost import collective_kind

import simulated
from op_cases import make_inputs, partition_case, tolerance
from simulated import collectives, run_everywhere
from op_cases_windows import CASES, loop_conv, loop_cumsum, loop_reduce_window

MESHES = [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
    sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3), (2, 4), (4, 2), (1, 4), (4, 1))] + [
    sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]
MESH_4 = sr.Mesh((4,), ("x",))
MESH_2x4 = sr.Mesh((2, 4), ("data", "model"))


def assert_all_ranks(program, args, expected, tol=1e-10):
    simulated.assert_all_ranks(program, args, expected, tol)


# ---------------------------------------------------------------- kernels and API vs explicit loops
CONV_CONFIGS = [  # (lhs shape, rhs shape, kwargs)
    ((2, 3, 9), (4, 3, 3), dict(window_strides=1, padding="SAME")),
    ((2, 3, 9), (4, 3, 4), dict(window_strides=2, padding="SAME")),
    ((1, 2, 10), (3, 2, 3), dict(window_strides=3, padding=((2, -1),))),
    ((2, 4, 7, 6), (6, 2, 3, 2), dict(window_strides=(2, 1), padding=((1, 2), (0, 1)), feature_group_count=2)),
    ((1, 2, 5, 6), (3, 2, 2, 3), dict(padding="SAME", lhs_dilation=(2, 1), rhs_dilation=(1, 2))),
    ((2, 3, 4, 5, 3), (2, 3, 2, 3, 2), dict(window_strides=(1, 2, 1), padding=((1, 0), (1, 1), (0, 1)))),
    ((1, 4, 6, 5, 4), (8, 1, 3, 1, 2), dict(padding="SAME", rhs_dilation=(1, 1, 2), feature_group_count=4)),
    # stride 1, one group, no crop: wide rows apply (uneven padding, dilated taps, 1 and 3 spatial dims)
    ((2, 3, 6, 5), (4, 3, 3, 2), dict(padding=((1, 2), (0, 1)), rhs_dilation=(2, 1))),
    ((2, 2, 4, 3, 5), (3, 2, 2, 3, 2), dict(padding=((1, 0), (1, 1), (0, 2)))),
    ((3, 2, 7), (2, 2, 1), dict(padding="VALID")),
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CONV_CONFIGS, ids=lambda v: str(v))
def test_conv_matches_loops(lhs_shape, rhs_shape, kwargs):
    rng = np.random.default_rng(0)
    x, k = rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape)
    graph = sr.trace(lambda a, b: snp.conv(a, b, **kwargs), x, k)
    np.testing.assert_allclose(sr.evaluate(graph, x, k)[0], loop_conv(x, k, **kwargs), rtol=1e-12, atol=1e-12)


TRANSPOSED_CONFIGS = [  # lhs dilation, stride 1: the input gradients of strided convs (col2im applies)
    ((2, 3, 5, 4), (4, 3, 3, 3), dict(padding=((2, 2), (1, 2)), lhs_dilation=(2, 2))),
    ((1, 2, 6), (3, 2, 4), dict(padding=((-1, 3),), lhs_dilation=3, rhs_dilation=2)),
    ((2, 4, 3, 5), (6, 2, 2, 3), dict(padding=((1, 0), (0, -1)), lhs_dilation=(2, 3), feature_group_count=2)),
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CONV_CONFIGS + TRANSPOSED_CONFIGS, ids=lambda v: str(v))
def test_every_conv_method_matches_loops(lhs_shape, rhs_shape, kwargs):
    """The kernels the binder picks from (im2col over rows or per image, col2im for transposed convs, wide rows
    for stride-1 convs), each forced, against the loops: the choice is by speed only."""
    rng = np.random.default_rng(0)
    x, k = rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape)
    attrs = sr.trace(lambda a, b: snp.conv(a, b, **kwargs), x, k).nodes[-1].attrs
    want = loop_conv(x, k, **kwargs)
    methods = [windows.conv_rows, windows.conv_per_image]
    if all(s == 1 for s in attrs["strides"]) and any(d > 1 for d in attrs["lhs_dilation"]):
        methods.append(windows.conv_col2im)
    if windows.wide_rows_fit(x.shape, k.shape, attrs["strides"], attrs["padding"], attrs["lhs_dilation"]):
        methods.append(windows.conv_wide_rows)
    assert windows.conv_method(x.shape, k.shape, attrs["strides"], attrs["padding"], attrs["lhs_dilation"],
                               attrs["rhs_dilation"]) in methods
    for method in methods:
        np.testing.assert_allclose(method(np, x, k, **attrs), want, rtol=1e-12, atol=1e-12, err_msg=method.__name__)


@pytest.mark.parametrize("lhs, rhs, strides, padding, lhs_dilation, want", [
    ((32, 16, 16, 16), (16, 16, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), "conv_wide_rows"),  # a ResNet 3x3
    ((32, 16, 16, 16), (32, 16, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), "conv_per_image"),  # strided
    ((32, 16, 16, 16), (16, 8, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), "conv_per_image"),  # two groups
    ((32, 16, 16, 16), (16, 16, 3, 3), (1, 1), ((-1, 1), (1, 1)), (1, 1), "conv_per_image"),  # a crop
    ((32, 64, 4, 4), (64, 64, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), "conv_rows"),  # 16 positions
    ((32, 16, 8, 8), (16, 16, 3, 3), (1, 1), ((1, 2), (1, 2)), (2, 2), "conv_col2im"),  # transposed
])
def test_conv_method_by_shape(lhs, rhs, strides, padding, lhs_dilation, want):
    assert windows.conv_method(lhs, rhs, strides, padding, lhs_dilation, (1, 1)).__name__ == want


def test_wide_rows_keep_float32():
    rng = np.random.default_rng(0)
    x, k = rng.standard_normal((2, 3, 6, 6)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    got = windows.conv_wide_rows(np, x, k, (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), 1)
    assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == (2, 4, 6, 6)
    want = loop_conv(x.astype(np.float64), k.astype(np.float64), padding="SAME")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["max", "min", "sum", "avg"])
def test_reduce_window_matches_loops_with_identity_padding(kind):
    x = -np.random.default_rng(1).uniform(1, 2, (2, 7, 6))  # all negative: zero padding would win a max
    args = ((1, 3, 2), (1, 2, 2), ((0, 0), (1, 2), (1, 0)))
    graph = sr.trace(lambda a: snp.reduce_window(a, kind, *args), x)
    got = sr.evaluate(graph, x)[0]
    np.testing.assert_allclose(got, loop_reduce_window(x, kind, *args), rtol=1e-12)
    if kind == "max":
        assert (got < 0).all()


def test_avg_counts_padding_and_int_avg_is_float():
    x = np.arange(1, 5, dtype=np.int64).reshape(1, 4)
    graph = sr.trace(lambda a: snp.reduce_window(a, "avg", (1, 2), (1, 2), ((0, 0), (1, 1))), x)
    got = sr.evaluate(graph, x)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [[0.5, 2.5, 2.0]])  # (0 + 1) / 2, (2 + 3) / 2, (4 + 0) / 2


@pytest.mark.parametrize("dtype,axis", [("float32", 0), ("int32", 1), ("bool", None), ("float64", -1)])
def test_cumsum_dtypes_match_numpy(dtype, axis):
    x = (np.random.default_rng(2).standard_normal((4, 5)) * 3).astype(dtype)
    got = sr.evaluate(sr.trace(lambda a: snp.cumsum(a, axis), x), x)[0]
    want = np.cumsum(x, axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, loop_cumsum(x, axis), rtol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_loops(case):
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    got, want = sr.evaluate(graph, *args)[0], case.fn(np, *args)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=tolerance(case.dtype), atol=tolerance(case.dtype))


@pytest.mark.parametrize("fn,match", [
    (lambda x, k: snp.conv(x[0], k[0]), "rank >= 3"),
    (lambda x, k: snp.conv(x, k, feature_group_count=2), "feature_group_count"),
    (lambda x, k: snp.conv(x, k, padding="FULL"), "'SAME', 'VALID'"),
    (lambda x, k: snp.conv(x, k, padding=((1, 1), (1, 1))), "one \\(low, high\\) pair per dim \\(1\\)"),
    (lambda x, k: snp.conv(x, k, window_strides=0), "window_strides takes a positive int"),
    (lambda x, k: snp.conv(x, k, padding=((-5, 0),)), "fit the padded input"),
    (lambda x, k: snp.reduce_window(x, "mean", (1, 1, 2)), "kind must be one of"),
    (lambda x, k: snp.reduce_window(x, "max", (2, 2)), "one window size per dim"),
    (lambda x, k: snp.cumsum(x, axis=3), "cumsum axis must be in"),
])
def test_api_errors_state_the_rule(fn, match):
    with pytest.raises(ValueError, match=match):
        sr.trace(fn, sr.TensorSpec((2, 3, 6), "float64"), sr.TensorSpec((4, 3, 3), "float64"))


# ---------------------------------------------------------------- halo plans, every shard emulated
def _emulate_shards(x, k, plan, kernel, local_pad, fill):
    """Each shard's local op from its (NaN-padded) block and the edges of the shards before and after it (more
    than one hop away when a halo is wider than a block; zeros past the ends), as the program runs it."""
    c, n = plan.block, len(x)
    blocks = np.concatenate([x, np.full(k * c - n, np.nan)]).reshape(k, c)
    ends = np.concatenate([np.zeros(plan.left), blocks.ravel(), np.zeros(plan.right)])  # global g at g + left
    outs = []
    for i in range(k):
        halos = []
        if plan.left:
            halos.append(ends[i * c:i * c + plan.left])
        if plan.right:
            halos.append(ends[(i + 1) * c + plan.left:(i + 1) * c + plan.left + plan.right])
        window = OPS["halo_window"].kernel(np, blocks[i], *halos, np.asarray(i), dim=0, left=plan.left,
                                        right=plan.right, block=c, size=n, start=plan.start, step=plan.step,
                                        length=plan.length, fill=fill, dilation=plan.dilation)
        outs.append(kernel(window, local_pad))
        assert len(outs[-1]) == plan.out_block
    return np.concatenate(outs)


def _conv_1d(w, stride, ld, rd):
    def run(x, pad):
        return OPS["conv"].kernel(np, x[None, None], w[None, None], strides=(stride,), padding=(pad,),
                               lhs_dilation=(ld,), rhs_dilation=(rd,), groups=1)[0, 0]
    return run


def _max_1d(window, stride):
    return lambda x, pad: OPS["reduce_window"].kernel(np, x, kind="max", window=(window,), strides=(stride,),
                                                   padding=(pad,))


HALO_GRID = [p for p in itertools.product(range(1, 14), (2, 3, 4, 6, 8), (1, 2, 3, 5), (1, 2, 3), (-1, 0, 1, 2),
                                          (0, 1, 3), (1, 2, 3), (1, 2))
             if out_size(p[0], p[2], p[3], (p[4], p[5]), p[6], p[7]) >= 1]


@pytest.mark.parametrize("chunk", range(8))
def test_halo_plan_reproduces_every_output_block(chunk):
    """Random (n, k, window, stride, padding, dilations): the shards' outputs, concatenated, are the
    global op's (conv, and max windows where padding must be -inf); refusals only for halos wider than the
    other shards (an lhs dilation whose phase differs per shard cuts the window from the dilated input)."""
    rng = np.random.default_rng(chunk)
    picks = rng.choice(len(HALO_GRID), 400, replace=False)
    planned = 0
    for n, k, window, stride, lo, hi, ld, rd in (HALO_GRID[i] for i in picks):
        plan = halo_plan(n, k, window, stride, (lo, hi), ld, rd)
        if isinstance(plan, str):
            assert "wider than the other" in plan, plan
            continue
        planned += 1
        x, w = rng.standard_normal(n), rng.standard_normal(window)
        m = out_size(n, window, stride, (lo, hi), ld, rd)
        conv = _conv_1d(w, stride, ld, rd)
        local = _conv_1d(w, stride, 1, rd) if plan.dilation > 1 else conv  # the window comes dilated
        np.testing.assert_allclose(_emulate_shards(x, k, plan, local, plan.pad, 0.0)[:m], conv(x, (lo, hi)),
                                   rtol=1e-12, atol=1e-12, err_msg=str((n, k, window, stride, lo, hi, ld, rd, plan)))
        if ld == rd == 1:
            pool = _max_1d(window, stride)
            got = _emulate_shards(-1 - x ** 2, k, plan, pool, plan.pad, -np.inf)[:m]
            np.testing.assert_array_equal(got, pool(-1 - x ** 2, (lo, hi)))
    assert planned > 150  # about half the grid (tiny shards make many halos too wide)


def test_halo_plan_same_conv_and_aligned_stride():
    same = halo_plan(16, 4, 3, 1, (1, 1))
    assert (same.left, same.right, same.start, same.step, same.length, same.pad) == (1, 1, 0, 0, 6, (0, 0))
    strided = halo_plan(16, 4, 3, 2, (1, 1))  # output blocks of 2 line up with input blocks of 4
    assert (strided.left, strided.right, strided.step, strided.out_block) == (1, 0, 0, 2)
    shrinking = halo_plan(10, 4, 5)  # VALID: 6 outputs in blocks of 2 over input blocks of 3
    assert (shrinking.left, shrinking.right, shrinking.start, shrinking.step) == (2, 3, 2, -1)
    # VALID, 9 outputs in blocks of 2 over input blocks of 2: outputs 2i, 2i + 1 read inputs 2i .. 2i + 5, a
    # right halo of 4 from the next two shards
    wide = halo_plan(13, 8, 5)
    assert (wide.left, wide.right, wide.block, wide.length) == (0, 4, 2, 6)
    assert halo_plan(4, 4, 9, 1, (4, 4)) == "the halo (4 left, 4 right) is wider than the other 3 shards (1 each)"


def test_shift_pairs_follow_the_mesh_and_its_device_order():
    mesh = sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))
    assert shift_pairs(mesh, ("y",), 1) == ((1, 0), (2, 1), (3, 2), (5, 4), (6, 5), (7, 6))
    assert shift_pairs(mesh, ("x", "y"), -1) == tuple((r, r + 1) for r in range(7))  # position p is rank 7 - p


# ---------------------------------------------------------------- the case table on every mesh
PARAMS = [pytest.param(c, s, m, id=f"{c.name}-spec{i}-{m}") for c in CASES for i, s in enumerate(c.specs)
          for m in MESHES]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
@pytest.mark.parametrize("case,specs,mesh", PARAMS)
def test_partitioned_matches_reference(case, specs, mesh):
    graph, program, args, expected = partition_case(case, specs, mesh)
    assert_all_ranks(program, args, expected, tolerance(case.dtype) or 0.0)


# ---------------------------------------------------------------- exact collectives
def _program(fn, shapes, mesh, in_specs, out_specs=None, dtype="float64"):
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(s).astype(dtype) for s in shapes]
    graph = sr.trace(fn, *args)
    return graph, sr.partition(graph, mesh, in_specs=in_specs, out_specs=out_specs), args


def same_conv(x, k):
    return snp.conv(x, k, (1, 1), "SAME")


TABLE = [  # (name, fn, shapes, mesh, in_specs, out_specs, expected [(kind, axes)])
    ("batch_split_is_local", same_conv, [(8, 3, 6, 6), (4, 3, 3, 3)], MESH_4, [("x", None, None, None), None],
     None, []),
    ("out_features_split_is_local", same_conv, [(2, 3, 6, 6), (8, 3, 3, 3)], MESH_4, [None, ("x", None, None, None)],
     [(None, "x", None, None)], []),
    ("in_features_split_is_partial", lambda x, k: snp.conv(x, k, 1, "VALID"), [(4, 64, 8), (4, 64, 3)], MESH_4,
     [(None, "x", None), (None, "x", None)], [("x", None, None)], [("reduce_scatter", ("x",))]),
    ("in_features_split_all_reduce", lambda x, k: snp.conv(x, k, 1, "VALID"), [(4, 64, 8), (4, 64, 3)], MESH_4,
     [(None, "x", None), (None, "x", None)], [None], [("all_reduce", ("x",))]),
    ("feature_groups_split_is_local", lambda x, k: snp.conv(x, k, 1, "SAME", feature_group_count=4),
     [(2, 8, 10), (8, 2, 3)], MESH_4, [(None, "x", None), None], None, []),
    ("stride2_aligned_left_halo_only", lambda x, k: snp.conv(x, k, 2, ((1, 1), (1, 1))),
     [(2, 3, 16, 8), (4, 3, 3, 3)], MESH_4, [(None, None, "x", None), None], None,
     [("collective_permute", ("x",))]),
    ("spatial_2d_split", same_conv, [(2, 3, 8, 8), (4, 3, 3, 3)], MESH_2x4,
     [(None, None, "data", "model"), None], None, [("collective_permute", ("data", "model"))] * 4),
    ("maxpool_halo", lambda x: snp.reduce_window(x, "max", (1, 1, 3, 3), (1, 1, 1, 1), "SAME"),
     [(2, 3, 8, 8)], MESH_4, [(None, None, "x", None)], None, [("collective_permute", ("x",))] * 2),
    ("avgpool_blocks_are_local", lambda x: snp.reduce_window(x, "avg", (1, 1, 2, 2), (1, 1, 2, 2), "VALID"),
     [(2, 3, 8, 8)], MESH_4, [(None, None, "x", None)], None, []),
    ("cumsum_split_axis", lambda x: snp.cumsum(x, axis=0), [(10, 6)], MESH_2x4, [(("data", "model"), None)], None,
     [("all_gather", ("data", "model"))]),
    ("cumsum_other_axis_is_local", lambda x: snp.cumsum(x, axis=1), [(10, 6)], MESH_2x4, [("model", None)], None,
     []),
    ("size_one_axis_splits_nothing", lambda x, k: snp.cumsum(same_conv(x, k), axis=2), [(2, 3, 8, 8), (4, 3, 3, 3)],
     sr.Mesh((1, 4), ("x", "y")), [(None, None, "x", None), None], None, []),
]


@pytest.mark.parametrize("name,fn,shapes,mesh,in_specs,out_specs,expected", TABLE, ids=[t[0] for t in TABLE])
def test_collectives_and_numerics(name, fn, shapes, mesh, in_specs, out_specs, expected):
    graph, program, args = _program(fn, shapes, mesh, in_specs, out_specs)
    assert collectives(program) == expected, str(program)
    assert not program.notes
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


@pytest.mark.parametrize("mesh,spec", [(MESH_4, ("x",)), (sr.Mesh((3,), ("x",)), ("x",)),
                                       (MESH_2x4, ("model",)), (MESH_2x4, ("data", "model"))])
def test_same_conv_on_split_spatial_dim_costs_two_collective_permutes(mesh, spec):
    """The paper's spatial partitioning: a stride-1 'SAME' conv with H split exchanges one row with each
    neighbour (left halo forward, right halo backward) and gathers nothing, even and uneven."""
    for h in (12, 10):
        graph, program, args = _program(same_conv, [(2, 3, h, 5), (4, 3, 3, 3)], mesh,
                                        [(None, None, spec, None), None])
        summary = program.comm_summary()
        assert [c["kind"] for c in summary] == ["collective_permute"] * 2, str(program)
        permutes = [i.attrs["pairs"] for i in program.instrs if collective_kind(i.op) == "collective_permute"]
        assert permutes == [shift_pairs(mesh, spec, 1), shift_pairs(mesh, spec, -1)]
        assert [c["bytes_in"] for c in summary] == [2 * 3 * 1 * 5 * 8] * 2  # one row of the local block each
        assert program.outputs[0].sharding == sr.Sharding(((), (), spec, ()))
        assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_max_pool_edges_are_minus_infinity_not_the_permute_zeros():
    x = -np.random.default_rng(4).uniform(1, 2, (1, 1, 10, 4))
    graph = sr.trace(lambda a: snp.reduce_window(a, "max", (1, 1, 3, 1), (1, 1, 1, 1), "SAME"), x)
    program = sr.partition(graph, MESH_4, in_specs=[(None, None, "x", None)])
    assert collectives(program) == [("collective_permute", ("x",))] * 2
    expected = sr.evaluate(graph, x)
    assert (expected[0] < 0).all()
    assert_all_ranks(program, [x], expected)


def test_halo_wider_than_the_other_shards_falls_back_to_replicated_with_a_note():
    with pytest.warns(UserWarning, match="resharded to replicated"):
        graph, program, args = _program(lambda x, k: snp.conv(x, k, 1, ((4, 4),)), [(2, 3, 4), (4, 3, 9)],
                                        sr.Mesh((4,), ("x",)), [(None, None, "x"), None])
    assert collectives(program) == [("all_gather", ("x",))]
    assert len(program.notes) == 1 and "spatial dim 2 split over ('x',)" in program.notes[0]
    assert "wider than the other 3 shards" in program.notes[0] and "resharded to replicated" in program.notes[0]
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_lhs_dilation_phase_mismatch_cuts_the_dilated_window():
    """lhs dilation 2 (a transposed conv): 15 dilated positions padded 2 + 2, window 3: 17 outputs in blocks of
    5 on 4 shards; block i reads dilated positions [5i - 2, 5i + 5), elements ceil((5i - 2) / 2) to
    (5i + 4) // 2: the phase alternates. Each shard cuts its 7 dilated positions: a left halo of 1 (shard 0's
    element -1 is padding) and a right one of 2 (shard 2 reads elements 4-7), rows of N * C = 2."""
    graph, program, args = _program(lambda x, k: snp.conv(x, k, 1, ((2, 2),), lhs_dilation=2),
                                    [(1, 2, 8), (2, 2, 3)], MESH_4, [(None, None, "x"), None])
    assert collectives(program) == [("collective_permute", ("x",))] * 2 and program.notes == []
    assert program.wire_bytes == 3 * 2 * 8
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_feature_groups_that_do_not_divide_fall_back_with_a_note():
    with pytest.warns(UserWarning, match="feature groups do not divide"):
        graph, program, args = _program(lambda x, k: snp.conv(x, k, 1, "SAME", feature_group_count=3),
                                        [(2, 6, 8), (6, 2, 3)], MESH_4, [(None, "x", None), None])
    assert collectives(program) == [("all_gather", ("x",))]
    assert any("3 feature groups do not divide into 4 shards" in n for n in program.notes)
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_cumsum_gathers_one_total_per_shard():
    graph, program, args = _program(lambda x: snp.cumsum(x, axis=0), [(10, 6)], MESH_4, [("x", None)])
    (gather,) = program.comm_summary()
    assert (gather["kind"], gather["group_size"], gather["bytes_in"], gather["bytes_out"]) == (
        "all_gather", 4, 6 * 8, 4 * 6 * 8)
    assert "mask_padding" in [i.op for i in program.instrs]  # 10 rows over 4: the last block's tail
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


# ---------------------------------------------------------------- propagation and persistence
def test_propagation_spatial_like_elementwise_features_by_role():
    def net(x, k1, k2):
        x = sr.mesh_split(x, MESH_2x4, ("data", None, "model", None))
        h = snp.maximum(snp.conv(x, k1, 1, "SAME"), 0.0)
        p = snp.reduce_window(h, "max", (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        return snp.cumsum(snp.conv(p, k2, 1, "SAME"), axis=2)
    graph = sr.trace(net, sr.TensorSpec((4, 3, 16, 8), "float64"), sr.TensorSpec((6, 3, 3, 3), "float64"), sr.TensorSpec((5, 6, 3, 3), "float64"))
    program = sr.partition(graph, MESH_2x4)
    split = sr.Sharding((("data",), (), ("model",), ()))
    assert program.outputs[0].sharding == split
    assert all(program.report[n.id][0] == split for n in graph.nodes if n.op in ("conv", "reduce_window", "cumsum"))
    assert program.report[graph.params[1]][0].is_replicated  # weights stay whole
    assert sorted(set(program.collectives())) == ["all_gather", "collective_permute"]  # halos + cumsum totals
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s.shape) for s in graph.input_specs]
    assert_all_ranks(program, args, sr.evaluate(graph, *args))


def test_depthwise_feature_split_propagates_to_the_output_features():
    graph = sr.trace(lambda x, k: snp.conv(x, k, 1, "SAME", feature_group_count=8), sr.TensorSpec((2, 8, 10), "float64"),
                     sr.TensorSpec((16, 1, 3), "float64"))
    program = sr.partition(graph, MESH_4, in_specs=[(None, "x", None), None])
    assert program.outputs[0].sharding == sr.Sharding(((), ("x",), ()))
    assert program.inputs[1].sharding == sr.Sharding((("x",), (), ()))
    assert program.collectives() == []


def test_saved_program_with_halos_and_infinite_fill_runs_after_loading(tmp_path):
    graph, program, args = _program(lambda x: snp.reduce_window(x, "max", (3, 1), (1, 1), "SAME"), [(10, 3)],
                                    MESH_4, [("x", None)])
    program.save(tmp_path / "pool.json")
    loaded = sr.load_program(tmp_path / "pool.json")
    assert loaded.hash == program.hash
    assert_all_ranks(loaded, args, sr.evaluate(graph, *args))
