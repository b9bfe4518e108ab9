"""Op cases of the non-elementwise NumPy coverage (issue 28: ops/creation.py, manipulation.py, sorting.py,
reductions.py, linalg.py, the prod reduction kind), in the format of ``op_cases.CASES``.

Each case is written once against ``m``: with ``m=numpy`` it is NumPy's own function (the independent
expectation; only a descending sort, which NumPy lacks, is written as a stable sort of ``-x``). Sizes even
(24 on every mesh) and uneven (10, 7, 5: padding on the trailing shards), the interesting dims split over
"A", "B" or both; results that are bools or ints are cast to float64 at the end so the comparison is exact.
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

A_, B_, AB, BA = ("A", None), (None, "A"), ("A", "B"), ("B", "A")
A3, B3, C3 = ("A", None, None), (None, "A", None), (None, "B", "A")


def _f(x):
    return x.astype("float64")


def _desc_sort(m, x, axis):
    return -np.sort(-x, axis=axis, kind="stable") if m is np else m.sort(x, axis=axis, descending=True)


def _desc_argsort(m, x, axis):
    return np.argsort(-x, axis=axis, kind="stable") if m is np else m.argsort(x, axis=axis, descending=True)


def _ties(x):
    return (x * 2.0).astype("int64").astype(x.dtype)  # few distinct values: equal ones in several shards


def _restack(m, pieces, axis):
    return m.concatenate(list(pieces)[::-1], axis=axis)


CREATION = [
    Case("like_fns", lambda m, x: x * 0.5 + m.full_like(x, 2.5) + m.ones_like(x) - m.zeros_like(x, dtype="float64")
         + m.full_like(x, 3, shape=(7,)), ((10, 7),), ((A_,), (BA,))),
    Case("eye_offsets", lambda m, x: x + m.eye(10, 7, k=1, dtype="float64") - m.eye(10, M=7, k=-3, dtype="float64")
         + m.identity(7, dtype="float64")[:1], ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("eye_matmul", lambda m, x: x @ m.eye(24, dtype="float64") + m.eye(24, k=2, dtype="int32"), ((24, 24),),
         ((A_,), (AB,))),
    Case("tri", lambda m, x: x * m.tri(10, 7, k=-1, dtype="float64") + m.tri(10, 7, dtype="float64"), ((10, 7),),
         ((A_,), (AB,))),
    Case("tril_triu", lambda m, x: m.tril(x) + 2.0 * m.triu(x, -1) - m.tril(x, 2) * m.triu(x, 3), ((3, 10, 7),),
         ((C3,), (B3,), ((None, "A", "B"),))),
    Case("tril_int", lambda m, x: m.tril(x, -2) - m.triu(x, 1), ((24, 24),), ((AB,), (B_,)), dtype="int64"),
    Case("linspace", lambda m, x: x + m.linspace(0.0, 1.0, 7, dtype="float64") * m.linspace(2, 3, 7, endpoint=False,
         dtype="float64") + m.logspace(0.0, 1.0, 7, dtype="float64"), ((10, 7),), ((B_,), (BA,))),
    Case("linspace_array_bounds", lambda m, x: m.linspace(x[:, 0], x[:, 1], 5, axis=1), ((10, 7),), ((A_,), (AB,))),
    Case("meshgrid", lambda m, x, y: sum(a * (i + 1.0) for i, a in enumerate(m.meshgrid(x, y)))
         + m.meshgrid(x, y, indexing="ij")[1].T, ((10,), (7,)), ((("A",), ("A",)), (None, ("B",)))),
    Case("meshgrid_sparse", lambda m, x, y, z: sum(m.meshgrid(x, y, z, sparse=True, indexing="ij"))
         - sum(m.meshgrid(x, y, z))[0, 0, 0], ((5,), (7,), (3,)), ((("A",), None, None), (("B",), ("A",), None))),
]

MANIPULATION = [
    Case("split_sections", lambda m, x: _restack(m, m.split(x, 4, axis=1), 1), ((10, 24),), ((B_,), (BA,))),
    Case("split_indices", lambda m, x: _restack(m, m.split(x, [2, 5, -1], axis=1), 1), ((10, 7),),
         ((B_,), (AB,))),
    Case("array_split", lambda m, x: _restack(m, m.array_split(x, 3, axis=0), 0) + m.array_split(x, 4)[3].sum(),
         ((10, 7),), ((A_,), (AB,))),
    Case("unstack", lambda m, x: m.stack(m.unstack(x, axis=1)[::-1], axis=0), ((10, 7),), ((B_,), (AB,))),
    Case("tile", lambda m, x: m.tile(x, (2, 1, 3)), ((10, 7),), ((A_,), (AB,))),
    Case("tile_short_reps", lambda m, x: m.tile(x, 2), ((3, 10),), ((B_,), (BA,))),
    Case("repeat_scalar", lambda m, x: m.repeat(x, 3, axis=1) + m.repeat(x, 3, axis=1), ((10, 7),), ((B_,), (AB,))),
    Case("repeat_per_entry", lambda m, x: m.repeat(x, [1, 0, 2, 3, 1, 1, 2], axis=1), ((10, 7),), ((B_,), (AB,))),
    Case("repeat_flat", lambda m, x: m.repeat(x, 2), ((10, 7),), ((A_,), (AB,))),
    Case("stacks", lambda m, x, y: m.hstack([x, y]).sum() + m.vstack([x, y])[:10] + m.dstack([x, y])[..., 1]
         + m.column_stack([x[:, 0], y])[:, :7], ((10, 7), (10, 7)), ((A_, A_), (AB, B_))),
    Case("stacks_1d", lambda m, x, y: m.hstack([x, y]) + m.vstack([x, y]).sum(0).sum()
         + m.column_stack([x, y]).sum(1).sum(), ((10,), (10,)), ((("A",), ("A",)), (None, ("B",)))),
    Case("ravel_atleast", lambda m, x: m.ravel(x) + m.atleast_3d(x).sum() + m.atleast_2d(x[0, 0]).sum()
         + m.atleast_1d(x).sum(), ((10, 7),), ((A_,), (BA,))),
    Case("diff", lambda m, x: m.diff(x, n=2, axis=0, prepend=1.5, append=x[:2]) + m.diff(x, axis=-1).sum(),
         ((10, 7),), ((A_,), (AB,))),
    Case("diff_orders", lambda m, x: m.diff(x, 3) + m.diff(x, 0)[:, :4], ((5, 7),), ((B_,), (BA,))),
    Case("permute_dims", lambda m, x: m.permute_dims(x, (2, 0, 1)) * 2.0, ((3, 10, 7),), ((C3,), (B3,))),
    Case("broadcast_arrays", lambda m, x, y: sum(m.broadcast_arrays(x, y, 2.0)), ((10, 1), (7,)),
         ((("A", None), ("A",)), (None, ("B",)))),
    Case("tuple_axes", lambda m, x: m.squeeze(m.expand_dims(x, (0, 3)), (0, 3)) + m.flip(x, (0, 1)), ((10, 7),),
         ((A_,), (AB,))),
]

SORTING = [
    Case("sort_axes", lambda m, x: m.sort(x, axis=0) + m.sort(x, axis=1) * 2.0, ((10, 7),),
         ((A_,), (B_,), (AB,), (BA,))),
    Case("sort_flat", lambda m, x: m.sort(x, axis=None), ((10, 7),), ((A_,), (AB,))),
    Case("sort_descending", lambda m, x: _desc_sort(m, x, 1) - _desc_sort(m, x, 0), ((24, 24),), ((A_,), (AB,))),
    Case("argsort_ties", lambda m, x: _f(m.argsort(_ties(x), axis=1, stable=True))
         + _f(_desc_argsort(m, _ties(x), 0)) * 100.0,
         ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("argsort_3d", lambda m, x: _f(m.argsort(x, axis=1, stable=True)), ((3, 10, 7),), ((B3,), (C3,))),
    Case("sort_int", lambda m, x: m.sort(x, axis=1) - _desc_sort(m, x, 0), ((10, 7),), ((A_,), (AB,)),
         dtype="int64"),
    Case("take_along_axis", lambda m, x, y: m.take_along_axis(x, m.argsort(y, axis=1, stable=True)[:, :4] - 7, axis=1)
         + m.take_along_axis(x, m.argsort(y, axis=0, stable=True), axis=0)[:, :4], ((10, 7), (10, 7)),
         ((A_, None), (AB, BA), (B_, A_))),
    Case("take_along_axis_broadcast",
         lambda m, x, y: m.take_along_axis(x, m.argsort(y, axis=1, stable=True)[:1], axis=1),
         ((10, 7), (10, 7)), ((A_, B_), (AB, None))),
    Case("searchsorted", lambda m, x: _f(m.searchsorted(np.linspace(-1.5, 1.5, 9), x))
         + _f(m.searchsorted(np.array([-1.0, 0.0, 0.0, 1.0]), m.round(x) if m is np else _round(m, x), side="right")),
         ((10, 7),), ((A_,), (AB,))),
]


def _round(m, x):
    """x rounded to the nearest integer (an exact tie test for searchsorted's sides) without ``round``."""
    return (x + 100.5).astype("int64").astype(x.dtype) - 100.0


def _padded(values, size, fill):
    """NumPy's data-dependent result cut or padded to a static ``size`` (jax.numpy's size=)."""
    values = np.asarray(values)[:size]
    return np.concatenate([values, np.full(size - values.shape[0], fill, values.dtype)])


def _nonzero(m, x, size):
    if m is np:
        return [_padded(c, size, -1) for c in np.nonzero(x)]
    return m.nonzero(x, size=size, fill_value=-1)


def _unique(m, x, size):
    if m is np:
        values, counts = np.unique(x, return_counts=True)
        return _padded(values, size, values[0]), _padded(counts, size, 0)
    return m.unique(x, return_counts=True, size=size)


SELECTIONS = [
    Case("nonzero_size", lambda m, x: sum(_f(c) * (i + 1.0) for i, c in enumerate(_nonzero(m, m.maximum(x, 0), 40)))
         + _f(_nonzero(m, m.maximum(x, 0), 12)[1])[0], ((10, 7),), ((A_,), (AB,)), dtype="int64"),
    Case("unique_size", lambda m, x: m.concatenate([_f(v) for v in _unique(m, x, 14)])
         + m.concatenate([_f(v) for v in _unique(m, x, 5)]).sum(), ((10, 7),), ((A_,), (BA,)), dtype="int64"),
]

REDUCTIONS = [
    Case("prod_axes", lambda m, x: m.prod(x, axis=0) + m.prod(x, axis=1).sum() + m.prod(x[:3]), ((10, 7),),
         ((A_,), (B_,), (AB,), (BA,)), positive=True),
    Case("prod_even", lambda m, x: m.prod(x, axis=1, keepdims=True) * x, ((24, 24),), ((B_,), (AB,)), positive=True),
    Case("prod_int", lambda m, x: m.prod(x, axis=0) + m.prod(x[:, :3]), ((10, 7),), ((A_,), (AB,)), dtype="int64"),
    Case("any_all", lambda m, x: _f(m.any(x > 1.5, axis=0)) + _f(m.all(x > -1.5, axis=1)).sum()
         + _f(m.all(x > -3.0)) + _f(m.any(x > 10.0, axis=(0, 1))), ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("std_var", lambda m, x: m.std(x, axis=0) + m.var(x, axis=0, ddof=1) + m.std(x, axis=1, correction=1).sum()
         + m.var(x, correction=2), ((10, 7),), ((A_,), (AB,))),
    Case("count_nonzero", lambda m, x: _f(m.count_nonzero(x, axis=0)) + _f(m.count_nonzero(x, axis=(0, 1))), ((10, 7),),
         ((A_,), (AB,)), dtype="int64"),
    Case("cumulative", lambda m, x: m.cumulative_sum(x, axis=1, include_initial=True)
         + m.cumulative_prod(x, axis=1, include_initial=True), ((10, 7),), ((B_,), (AB,)), positive=True),
    Case("cumprod", lambda m, x: m.cumprod(x, axis=0) + m.cumprod(x)[:7], ((10, 7),), ((A_,), (BA,)), positive=True),
    Case("cumprod_int", lambda m, x: m.cumprod(x, axis=1), ((5, 24),), ((B_,), (AB,)), dtype="int64"),
    Case("nan_reductions", lambda m, x: m.nansum(m.where(x > 1.2, m.nan, x), axis=0)
         + m.nanmean(m.where(x < -1.2, m.nan, x), axis=0) + m.nanmax(m.where(x > 0.9, m.nan, x), axis=0)
         + m.nanmin(m.where(x < -0.9, m.nan, x), axis=0) + m.nanprod(m.where(x > 1.0, m.nan, x * 0.5)),
         ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("average_ptp", lambda m, x, w: m.average(x, axis=0, weights=w) + m.average(x, axis=0) + m.ptp(x, axis=0)
         + m.average(x, weights=x * x + 1.0), ((10, 7), (10,)), ((A_, ("A",)), (AB, None)), positive=True),
]

LINALG = [
    Case("outer_inner", lambda m, x, y: m.outer(x[0], y[0]) + m.inner(x.T, y.T), ((10, 7), (10, 7)),
         ((A_, A_), (B_, AB))),
    Case("tensordot", lambda m, x, y: m.tensordot(x, y, ([1, 2], [1, 0])) + m.tensordot(x, y, 1)[:, 0, 0, :],
         ((3, 10, 7), (7, 10, 3)), ((C3, None), (B3, ("A", "B", None)))),
    Case("vdot_vecdot", lambda m, x, y: m.vdot(x, y) + m.vecdot(x, y, axis=0) + m.vecdot(x, y[0]).sum(),
         ((10, 7), (10, 7)), ((A_, A_), (AB, BA))),
    Case("diagonal", lambda m, x: m.diagonal(x, 1, 1, 2) + m.diagonal(x, -4, 2, 1)[:, :3].sum()
         + m.trace(x, 2, 1, 2)[:, None], ((3, 10, 7),), ((C3,), (B3,), ((None, "A", "B"),))),
    Case("trace_square", lambda m, x: m.trace(x) + m.trace(x, -5) + m.diagonal(x).sum(), ((24, 24),),
         ((A_,), (AB,), (BA,))),
    Case("norms", lambda m, x: m.linalg.norm(x) + m.linalg.norm(x, axis=1) + m.linalg.norm(x, 1, axis=1)
         + m.linalg.norm(x, np.inf, axis=1) + m.linalg.norm(x, -np.inf, axis=1) + m.linalg.norm(x, 3, axis=1)
         + m.linalg.norm(x, 0, axis=1), ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("matrix_norms", lambda m, x: m.linalg.norm(x, "fro") + m.linalg.norm(x, 1) + m.linalg.norm(x, -1)
         + m.linalg.norm(x, np.inf) + m.linalg.norm(x, -np.inf), ((10, 7),), ((A_,), (AB,), (BA,))),
    Case("array_api_linalg", lambda m, x: m.linalg.vector_norm(x, axis=(1, 2), ord=1) + m.linalg.matrix_norm(x)
         + m.linalg.trace(x, offset=1) + m.linalg.diagonal(x)[:, :2].sum(1) + m.linalg.matrix_transpose(x)[:, 0, 0]
         + m.linalg.vecdot(x, x, axis=1)[:, 0] + m.linalg.matrix_norm(x, ord=np.inf, keepdims=True)[:, 0, 0],
         ((3, 10, 7),), ((C3,), (B3,))),
    Case("global_norm_clip", lambda m, x, y: x / m.maximum(m.sqrt(m.linalg.norm(x) ** 2 + m.linalg.norm(y) ** 2), 1.0),
         ((24, 24), (24,)), ((AB, ("A",)), (BA, None))),
]

CASES = CREATION + MANIPULATION + SORTING + SELECTIONS + REDUCTIONS + LINALG
