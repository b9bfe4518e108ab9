"""Op cases of top_k (ops/top_k.py), in the format of ``op_cases.CASES``: the last axis split over one
axis, both axes, or with a split batch dim; sizes even (24 on every mesh) and uneven (10, 7: padding
on the trailing shards); ties (few distinct values) whose order must follow the global index.

Each case returns values and indices joined into one array. ``np_top_k`` is the independent NumPy
expectation (a stable sort of -x: descending, equal values by position), picked when ``m`` is numpy.
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

LAST, BOTH, BATCH_AND_LAST = (None, "A"), (None, ("A", "B")), ("B", "A")


def np_top_k(x, k):
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, order, axis=-1), order.astype(np.int32)


def _top_k(m, x, k):
    values, indices = np_top_k(x, k) if m is np else m.top_k(x, k)
    return m.concatenate([values, m.astype(indices, values.dtype)], axis=-1)


def _ties(m, x):
    """Few distinct values: equal ones in several shards."""
    return (x * 2.0).astype("int64").astype(x.dtype)


CASES = [
    Case("top_k_even", lambda m, x: _top_k(m, x, 3), ((4, 24),), ((LAST,), (BOTH,), (BATCH_AND_LAST,))),
    Case("top_k_uneven", lambda m, x: _top_k(m, x, 4), ((3, 10),), ((LAST,), (BOTH,), ((None, ("B", "A")),))),
    Case("top_k_all", lambda m, x: _top_k(m, x * 3.0, 7), ((2, 7),), ((LAST,), (BOTH,))),
    Case("top_k_ties", lambda m, x: _top_k(m, _ties(m, x), 5), ((3, 2, 10),), (((None, "B", "A"),), ((None, None, ("A", "B")),))),
    Case("top_k_int", lambda m, x: _top_k(m, x, 2), ((5, 24),), ((LAST,), (BATCH_AND_LAST,)), dtype="int64"),
]
