"""Op cases of the special family (ops/special.py: erf, erfc, erfinv, gelu_exact), in the format of ``op_cases.CASES``:
elementwise under several shardings, even (24) and uneven (10, 7) sizes. The NumPy expectation is
``math.erf`` / ``math.erfc`` entry by entry (the exact GELU as 0.5 x math.erfc(-x / sqrt 2)), and for erfinv a bisection on ``math.erf`` (independent of the
kernels' rational approximations)."""
from __future__ import annotations

import math

import numpy as np

import spmd_runtime.nn as snn
from op_cases import Case

np_erf, np_erfc = np.vectorize(math.erf), np.vectorize(math.erfc)


def _bisect_erfinv(y: float) -> float:
    lo, hi = -6.0, 6.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return 0.5 * (lo + hi)


np_erfinv = np.vectorize(_bisect_erfinv)


def _in_dtype(fn):
    return lambda v: fn(v).astype(v.dtype)


def _erf_mix(m, x):
    erf, erfc = (_in_dtype(np_erf), _in_dtype(np_erfc)) if m is np else (m.erf, m.erfc)
    return erf(x * 2.0) + erfc(x) * 3.0


def _gelu_exact(m, x):
    if m is np:
        return (0.5 * x * np_erfc(x * -math.sqrt(0.5))).astype(x.dtype)
    return snn.gelu(x, approximate=False)


def _erfinv(m, x):
    y = m.tanh(x) * 0.999  # in (-1, 1)
    return (np_erfinv if m is np else m.erfinv)(y)


A_, B_, AB = ("A", None), (None, "A"), ("A", "B")
CASES = [
    Case("erf_erfc", _erf_mix, ((24, 24),), ((A_,), (B_,), (AB,))),
    Case("erf_erfc_uneven", _erf_mix, ((10, 7),), ((A_,), (AB,))),
    Case("erf_erfc_f32", _erf_mix, ((24, 6),), ((A_,),), dtype="float32"),
    Case("gelu_exact", _gelu_exact, ((24, 24),), ((A_,), (AB,))),
    Case("gelu_exact_uneven_f32", _gelu_exact, ((10, 7),), ((AB,),), dtype="float32"),
    Case("erfinv", _erfinv, ((24, 8),), ((A_,), (("B", "A"),))),
]
