"""Op cases of the gather/scatter (take, scatter_add) and index-reduction (argmax, argmin, logsumexp,
softmax) families, in the format of ``op_cases.CASES`` (same ``Case``, ``resolve``, ``make_inputs``).

Every argument is drawn as floats, so integer indices are made INSIDE each case from a float argument
(``(u * 20).astype(int64)``: truncation, identical in NumPy and in the traced kernels). They land well
outside [0, n), so clamping is exercised on every case. NumPy has no scatter_add, logsumexp or softmax:
the ``_np_*`` helpers are independent NumPy expectations, picked when ``m`` is numpy.
Sizes: 24 (even on every mesh), 10 / 7 / 5 (uneven: padding on the trailing shards).
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

A_, B_ = ("A", None), (None, "A")


def _indices(m, u, scale=20.0):
    return (u * scale).astype("int64")


def _take(m, table, u, axis=0):
    return m.take(table, _indices(m, u), axis=axis, mode="clip")


def _np_scatter_add(operand, indices, updates, axis):
    out = np.moveaxis(operand.copy(), axis, 0)
    moved = np.moveaxis(updates, tuple(range(axis, axis + indices.ndim)), tuple(range(indices.ndim)))
    np.add.at(out, np.clip(indices, 0, operand.shape[axis] - 1), moved)
    return np.moveaxis(out, 0, axis)


def _scatter_add(m, operand, u, updates, axis=0):
    if m is np:
        return _np_scatter_add(operand, _indices(m, u), updates, axis)
    return m.scatter_add(operand, _indices(m, u), updates, axis)


def _np_logsumexp(x, axis):
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    return np.squeeze(np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak, axis=axis)


def _logsumexp(m, x, axis):
    return _np_logsumexp(x, axis) if m is np else m.logsumexp(x, axis=axis)


def _softmax(m, x, axis):
    if m is np:
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)
    return m.softmax(x, axis=axis)


def _ties(m, x):
    """Few distinct values: equal maxima in several shards, so first-occurrence must win across them."""
    return (x * 2.0).astype("int64")


def _getitem(m, x, u):
    """x[i, :, [0, 2]] with traced (or, on NumPy, computed) indices: negatives wrapped once, then clamped."""
    i = _indices(m, u, 6.0)
    if m is np:
        n = x.shape[0]
        i = np.clip(np.where(i < 0, i + n, i), 0, n - 1)
    return x[i, :, [0, 2]] + x[:, [-1, 1]].sum()


_UFUNC = {"set": None, "add": np.add, "min": np.minimum, "max": np.maximum}


def _at(m, x, u, v, kind):
    """x.at[i].<kind>(v): on NumPy, indices out of range dropped (JAX), negatives wrapped, repeats as ufunc.at
    (set: the last wins)."""
    i = _indices(m, u, 6.0)
    if m is not np:
        return getattr(x.at[i], kind)(v)
    n, out = x.shape[0], x.copy()
    keep = (i >= -n) & (i < n)
    if kind == "set":
        out[i[keep]] = v[keep]
    else:
        _UFUNC[kind].at(out, i[keep], v[keep])
    return out


_DEAD_ROW = np.zeros((24, 1))
_DEAD_ROW[5] = -np.inf  # a row of -inf only: logsumexp -inf, no NaN

GATHER_CASES = [
    Case("take_vocab_split", _take, ((24, 8), (4, 6)),
         ((A_, None), ((("A", "B"), None), None), (A_, ("B", None)), (B_, ("A", None)), (None, ("A", "B")))),
    Case("take_uneven", _take, ((10, 7), (5,)),
         ((A_, None), ((("A", "B"), None), None), (B_, ("A",)), (None, ("A",)), (("B", "A"), None))),
    Case("take_axis1", lambda m, t, u: _take(m, t, u, axis=1) * 2.0, ((6, 24, 4), (3, 5)),
         (((None, "A", "B"), None), (("B", "A", None), ("A", None)), ((None, None, "A"), (None, "B")))),
    Case("take_then_reduce",
         lambda m, t, u: m.sum(_take(m, t, u), axis=-1) + m.max(_take(m, t, u), axis=(0, 2)),
         ((24, 10), (7, 5)), ((A_, None), (B_, ("A", None)), (A_, (None, "B")))),
    Case("scatter_add_rows", _scatter_add, ((24, 4), (16,), (16, 4)),
         ((A_, None, None), (None, ("A",), A_), (None, None, B_), (A_, ("B",), ("B", None)),
          ((("A", "B"), None), None, None))),
    Case("scatter_add_uneven", _scatter_add, ((10, 3), (7,), (7, 3)),
         ((A_, None, None), (None, ("A",), A_), (B_, ("A",), None), ((("A", "B"), None), None, ("B", None)))),
    # many updates into a small operand: partial sums over the updates' axes beat gathering the updates
    Case("scatter_add_partial", _scatter_add, ((5, 3), (24,), (24, 3)),
         ((None, ("A",), A_), (None, (("A", "B"),), ((("A", "B"), None))), (B_, ("A",), A_), (A_, ("B",), None))),
    # computed updates: their padding is 1, not 0, unless masked before the scatter
    Case("scatter_add_partial_uneven", lambda m, o, u, d: _scatter_add(m, o, u, d * 0.5 + 1.0),
         ((3, 2), (10,), (10, 2)),
         ((None, ("A",), A_), (None, (("A", "B"),), None), (("B", None), ("A",), None))),
    Case("scatter_add_axis1", lambda m, o, u, d: _scatter_add(m, o, u, d, axis=1), ((4, 24), (3, 2), (4, 3, 2)),
         ((B_, None, None), (A_, ("B", None), None), (None, ("A", None), (None, "A", None)))),
]

INDEX_UPDATE_CASES = [
    Case("getitem_arrays", _getitem, ((24, 5, 3), (2,)),
         ((("A", None, None), None), ((None, "B", None), ("A",)), ((("A", "B"), None, None), None))),
    Case("getitem_arrays_uneven", _getitem, ((10, 7, 3), (2,)),
         ((("A", None, None), None), ((None, None, "A"), ("B",)))),
] + [Case(f"at_{kind}{'_uneven' if n == 10 else ''}", lambda m, x, u, v, kind=kind: _at(m, x, u, v, kind),
          ((n, 4), (6,), (6, 4)), ((A_, None, None), (B_, ("A",), A_), ((("A", "B"), None), None, None)))
     for kind in ("set", "add", "min", "max") for n in (24, 10)]

INDEXING_CASES = [
    Case("argmax_argmin", lambda m, x: m.argmax(x, axis=0) + m.argmin(x, axis=1), ((24, 24),),
         ((A_,), (B_,), (("A", "B"),), (("B", "A"),))),
    Case("argmax_ties", lambda m, x: m.argmax(_ties(m, x), axis=0) * 100 + m.argmin(_ties(m, x), axis=1),
         ((24, 24),), ((A_,), (B_,), (("A", "B"),))),
    Case("argmax_uneven_ties", lambda m, x: m.argmax(_ties(m, x), axis=0) * 100 + m.argmax(x, axis=0)
         + m.argmin(_ties(m, x), axis=0), ((10, 7),), ((A_,), (B_,), (("A", "B"),), (("B", "A"),))),
    Case("argmax_int", lambda m, x: m.argmax(x, axis=1) + m.argmin(x, axis=0).sum(), ((7, 10),),
         ((B_,), (A_,), (("A", "B"),)), dtype="int64"),
    Case("argmax_flat_keepdims", lambda m, x: m.argmax(x) + m.argmin(x, axis=1, keepdims=True), ((6, 8),),
         ((A_,), (B_,))),
    Case("logsumexp", lambda m, x: _logsumexp(m, x * 300.0 + m.asarray(_DEAD_ROW), 1) + _logsumexp(m, x, 0),
         ((24, 24),), ((A_,), (B_,), (("A", "B"),))),
    Case("logsumexp_uneven", lambda m, x: _logsumexp(m, x, (0, 1)) + _logsumexp(m, x * 700.0, 0).sum(),
         ((10, 7),), ((A_,), (B_,), (("A", "B"),))),
    Case("softmax_split", lambda m, x: _softmax(m, x, -1) + _softmax(m, x, 0), ((10, 24),),
         ((A_,), (B_,), (("A", "B"),))),
]

CASES = GATHER_CASES + INDEX_UPDATE_CASES + INDEXING_CASES


# the simulated meshes of the unit suites: every size of the brief, 1-d and 2-d, plus reordered devices
def simulated_meshes():
    import spmd_runtime as sr
    return [sr.Mesh((n,), ("x",)) for n in (1, 2, 3, 4, 6, 8)] + [
        sr.Mesh(s, ("x", "y")) for s in ((2, 2), (2, 3), (2, 4), (4, 2))] + [
        sr.Mesh((2, 4), ("x", "y"), devices=(7, 6, 5, 4, 3, 2, 1, 0))]


def check_partitioned(case: Case, specs, mesh) -> None:
    """Partition ``case`` with ``specs`` on ``mesh``, run it in the simulated world, compare every rank's
    outputs with the reference evaluator (shape, dtype and values)."""
    from op_cases import partition_case, tolerance
    import spmd_runtime as sr
    from spmd_runtime.comm import run_simulated
    graph, program, args, expected = partition_case(case, specs, mesh)
    tol = tolerance(case.dtype)
    for rank, got in enumerate(run_simulated(mesh.size, lambda comm: sr.run(program, *args, comm=comm))):
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, f"rank {rank}: {g.dtype}{g.shape} != {e.dtype}{e.shape}"
            np.testing.assert_allclose(g, e, rtol=tol, atol=tol, err_msg=f"rank {rank}\n{program}")


def check_reference(case: Case) -> None:
    """The reference evaluator of the traced case against the case run on NumPy itself."""
    from op_cases import make_inputs, tolerance
    import spmd_runtime as sr
    import spmd_runtime.numpy as snp
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    got, want = sr.evaluate(graph, *args)[0], case.fn(np, *args)
    tol = tolerance(case.dtype)
    assert got.shape == np.shape(want) and got.dtype == np.asarray(want).dtype, (got.dtype, got.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
