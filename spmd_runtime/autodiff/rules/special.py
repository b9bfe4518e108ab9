"""The VJP rules of the ``ops/special.py`` family, written with traced ops and registered in ``table.py``."""
from __future__ import annotations

import math

from ...ops.core import exp
from ...ops.special import CONJ, ERF, ERF_INV, ERFC, GELU_EXACT, IMAG, REAL, SQRT_HALF, TWO_OVER_SQRT_PI, conj, erfc
from .table import vjp


@vjp(ERF)
def _erf_vjp(node, g, ops, y):
    return [g * (TWO_OVER_SQRT_PI * exp(-(ops[0] * ops[0])))]


@vjp(ERFC)
def _erfc_vjp(node, g, ops, y):
    return [g * (-TWO_OVER_SQRT_PI * exp(-(ops[0] * ops[0])))]


@vjp(GELU_EXACT)
def _gelu_exact_vjp(node, g, ops, y):
    """d (x Phi(x)) = Phi(x) + x phi(x), from x alone: erfc is computed again here rather than kept from the
    forward pass (one (..., 4d) buffer per MLP less between the passes, for one more erfc per element)."""
    x = ops[0]
    return [g * (0.5 * erfc(x * -SQRT_HALF) + x * (0.5 * TWO_OVER_SQRT_PI * SQRT_HALF) * exp(-0.5 * (x * x)))]


@vjp(ERF_INV)
def _erf_inv_vjp(node, g, ops, y):
    """d erfinv(u)/du = sqrt(pi)/2 exp(erfinv(u)^2), from the result (as JAX)."""
    return [g * (0.5 * math.sqrt(math.pi) * exp(y * y))]


@vjp(REAL, CONJ)
def _real_conj_vjp(node, g, ops, y):
    """Real operands (the autodiff is real): real(x) = conj(x) = x, the cotangent passes (conjugated)."""
    return [conj(g)]


@vjp(IMAG)
def _imag_vjp(node, g, ops, y):
    return [None]  # of a real operand: zeros, a constant
