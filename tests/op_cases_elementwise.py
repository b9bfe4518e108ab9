"""Op cases of the elementwise math of ``ops/core.py`` (trigonometric, hyperbolic, log/exp variants, rounding,
sign family, nan tests, clip, floor division and remainders, bitwise ops and shifts, fmax/fmin), in the format of
``op_cases.CASES``. Each case stacks a few ops of one group into one array, written once against ``m``: NumPy
itself is the expectation (``np.sin`` for ``snp.sin``); where NumPy has no such function (sigmoid, rsqrt) the
``_np_*`` helpers are written here from the definition.

Shapes: 24 (even on every mesh) and 10 / 7 (uneven: padding on the trailing shards). Integer cases draw
[-5, 5], so divisors of 0 (NumPy: 0 for an integer // or % by 0) and negative operands (floor toward -inf,
the divisor's sign) occur in every case; float32 cases check the kernels stay float32.
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

A_, B_, AB = ("A", None), (None, "A"), ("A", "B")
EVEN, UNEVEN = (24, 24), (10, 7)


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _sigmoid(m, x):
    return _np_sigmoid(x) if m is np else m.sigmoid(x)


def _rsqrt(m, x):
    return 1.0 / np.sqrt(x) if m is np else m.rsqrt(x)


def _floats(m, *xs):
    return m.stack([m.astype(x, "float64") for x in xs])


def unary_cases(name, fn, positive=False, dtype="float64"):
    return [Case(f"{name}_even", fn, (EVEN,), ((A_,), (AB,)), dtype, positive),
            Case(f"{name}_uneven", fn, (UNEVEN,), ((B_,), (AB,)), dtype, positive)]


def binary_cases(name, fn, dtype="float64", positive=False):
    return [Case(f"{name}_even", fn, (EVEN, EVEN), ((A_, A_), (A_, B_)), dtype, positive),
            Case(f"{name}_uneven", fn, (UNEVEN, UNEVEN), ((B_, B_), (AB, None)), dtype, positive)]


CASES = [
    *unary_cases("trig", lambda m, x: m.stack([m.sin(x), m.cos(x), m.tan(x), m.arcsin(m.tanh(x)),
                                               m.arccos(m.tanh(x)), m.arctan(x)])),
    *unary_cases("hyperbolic", lambda m, x: m.stack([m.sinh(x), m.cosh(x), m.arcsinh(x), m.arccosh(1.0 + x * x),
                                                     m.arctanh(m.tanh(x) * 0.9)])),
    *unary_cases("log_exp", lambda m, x: m.stack([m.log1p(x), m.expm1(x), m.log2(x), m.log10(x), m.exp2(x),
                                                  m.cbrt(x - 1.0), m.reciprocal(x), _rsqrt(m, x)]), positive=True),
    *unary_cases("rounding", lambda m, x: m.stack([m.floor(3.0 * x), m.ceil(3.0 * x), m.trunc(3.0 * x),
                                                   m.rint(3.0 * x), m.round(3.0 * x), m.round(x, 2),
                                                   m.round(30.0 * x, -1)])),
    *unary_cases("sign_nan", lambda m, x: _floats(m, m.sign(x), m.signbit(x), m.isnan(m.log(x)),
                                                  m.isfinite(m.log(x)), m.isinf(m.log(m.abs(m.floor(x)))),
                                                  m.nan_to_num(m.log(x)), m.nan_to_num(m.log(m.abs(m.floor(x)))),
                                                  m.deg2rad(x), m.rad2deg(x), _sigmoid(m, 5.0 * x),
                                                  m.clip(x, -0.5, 0.7), m.clip(x, None, 0.1), +x, abs(x))),
    *binary_cases("binary_math", lambda m, x, y: m.stack([m.arctan2(x, y), m.hypot(x, y), m.logaddexp(x, y),
                                                          m.copysign(x, y), m.heaviside(x, 0.5),
                                                          m.fmax(x, m.log(y)), m.fmin(m.log(x), y),
                                                          m.float_power(m.abs(x), y), m.clip(x, y, None)])),
    *binary_cases("float_divmod", lambda m, x, y: m.stack([x // y, x % y, m.floor_divide(x, y),
                                                           m.remainder(-x, y), m.fmod(x, y), m.mod(x, -y)])),
    *binary_cases("int_divmod", lambda m, x, y: m.stack([x // y, x % y, m.fmod(x, y), 7 // (y + 11), -7 % (y + 11),
                                                         m.floor_divide(x, 2), m.remainder(x, -3)]), dtype="int64"),
    *binary_cases("int32_bitwise", lambda m, x, y: m.stack([x & y, x | y, x ^ y, ~x, x << m.abs(y), x >> m.abs(y),
                                                            m.left_shift(x, 40), m.right_shift(x, 40),
                                                            m.bitwise_and(x, 6), 3 ^ x]), dtype="int32"),
    *binary_cases("bool_bitwise", lambda m, x, y: _floats(m, (x > 0) & (y > 0), (x > 0) | (y > 0),
                                                          (x > 0) ^ (y > 0), ~(x > 0), m.logical_xor(x, y),
                                                          m.invert(x < y)), dtype="int64"),
    *binary_cases("int_sign_clip", lambda m, x, y: m.stack([m.sign(x), abs(x), +x, m.clip(x, -2, 3),
                                                            m.fmax(x, y), m.fmin(x, y), m.floor(x), m.round(y)]),
                  dtype="int64"),
    *unary_cases("float32_math", lambda m, x: m.stack([m.sin(x), m.arctan(x), m.log1p(m.abs(x)), m.expm1(x),
                                                       m.floor(x * 3.0), _sigmoid(m, x), m.clip(x, -0.3, 0.3),
                                                       m.sign(x), x // 0.3, x % 0.3]), dtype="float32"),
]
