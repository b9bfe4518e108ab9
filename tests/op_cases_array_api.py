"""Op cases of the Array API names added for the conformance suite (issue 28): the ``unique_*`` family
(ops/sorting.py, with a static size), ``real`` / ``imag`` / ``conj`` (ops/special.py) and ``all`` / ``any`` over
empty dims (ops/reductions.py), in the format of ``op_cases.CASES``.

Each case is written once against ``m``: with ``m=numpy`` it is NumPy's own function (the independent
expectation). The unique inputs have exactly 5 distinct values (a random permutation's positions mod 5, so
equal values sit in every shard) so the traced side can give the static ``size=5``; NaNs are each distinct (the
Array API's rule). Results are combined into one float64 array so the comparison is exact.
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

A_, B_, AB, BA = ("A", None), (None, "A"), ("A", "B"), ("B", "A")


def _five(m, x):
    """x's entries replaced by 5 distinct values in a random arrangement (the positions of a sort, mod 5)."""
    ranks = m.argsort(m.argsort(m.reshape(x, -1)))
    return m.reshape(ranks % 5, x.shape).astype("float64") * 1.5 - 2.0


def _sized(m, fn, x):
    return getattr(np, fn)(x) if m is np else getattr(m, fn)(x, size=5)


def _joined(m, *parts):
    return m.concatenate([m.reshape(p, -1).astype("float64") for p in parts])


CASES = [
    Case("unique_all", lambda m, x: _joined(m, *_sized(m, "unique_all", _five(m, x))), ((10, 7),),
         ((A_,), (AB,), (B_,))),
    Case("unique_values_counts_inverse", lambda m, x: _joined(m, _sized(m, "unique_values", _five(m, x)),
         *_sized(m, "unique_counts", _five(m, x)), *_sized(m, "unique_inverse", _five(m, x.T))), ((24, 5),),
         ((A_,), (BA,))),
    Case("real_imag_conj_of_reals", lambda m, x: m.real(x) + 2.0 * m.imag(x) - m.conj(x) * 3.0, ((10, 7),),
         ((A_,), (AB,))),
    Case("all_any_of_nothing", lambda m, x: m.all(x[:0] > 0, axis=0).astype("float64")
         + m.any(x[:, :0] > 0, axis=1, keepdims=True).astype("float64").sum() + m.all(x[:0]).astype("float64")
         + m.all(x > -9, axis=1)[:7].astype("float64"), ((10, 7),), ((A_,), (AB,))),
]
