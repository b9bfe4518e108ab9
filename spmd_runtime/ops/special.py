"""Special functions: ``erf``, ``erfc``, ``erfinv`` as elementwise ops (``jax.scipy.special`` / ``jax.lax``
names: ``erf``, ``erfc``, ``erf_inv``), and the exact GELU built on erfc (``gelu_exact``, ``nn.gelu``'s
``approximate=False``: one op so that its backward recomputes erfc from x instead of keeping it).

NumPy has no error function and SciPy is not a dependency, so the NumPy kernels are vectorized rational
approximations, evaluated in float64 and rounded once to the operand's dtype:

- ``erf`` / ``erfc``: W. J. Cody, "Rational Chebyshev approximations for the error function", Math. Comp. 23
  (1969) 631-638 (the coefficients of netlib's specfun CALERF): ``erf`` by a rational function of x^2 for
  |x| <= 0.46875, ``erfc`` as exp(-x^2) times a rational function of |x| on (0.46875, 4] and of 1/x^2 above;
  erfc(x) = 2 - erfc(-x) for negative x. Measured on 1e6 points of [-6, 6] plus 1e6 of [-1, 1] against
  ``math.erf`` / ``math.erfc`` (``tests/unit/test_special.py::test_cody_error_against_math``): the float64 kernel
  is within 3.4e-16 absolute (6.7e-16 relative) of ``math.erf`` and 1.0e-15 relative of ``math.erfc``; in float32
  it equals ``math.erf`` rounded to float32 on every one of those points.
- ``erfinv``: M. Giles' single-precision polynomial ("Approximating the erfinv function", GPU Computing Gems,
  2011) as the first guess, then Newton steps on erf(x) = y (|y| <= 1/2, 2 steps) or on log erfc(x) =
  log(1 - |y|) (4 steps; 1 - |y| is exact in float64 there) for float64 operands, so the tails keep their relative accuracy:
  |erf(erfinv(y)) - y| <= 4.5e-16 for |y| <= 1/2 and erfc(erfinv(y)) within 1e-14 relative of 1 - |y| beyond
  (the rounding of x itself, times |d log erfc / dx| ~ 2x <= 12); erfinv(+-1) = +-inf, NaN outside [-1, 1].
  Float32 (and narrower) operands take one step of each: Giles' guess is within 1.3e-7 relative there, and
  the results equal the float64 path's rounded to float32 on 1.1e6 points (the test checks it).

On CuPy the kernels are ``cupyx.scipy.special``'s. Integer and bool operands are computed in float (as
``jax.scipy.special.erf``). The partition rules (elementwise) are in ``partition/rules/special.py``, the VJPs
(d erf = 2/sqrt(pi) exp(-x^2), d erfinv(y) = sqrt(pi)/2 exp(erfinv(y)^2)) in ``autodiff/rules/special.py``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor
from . import core

__all__ = ["erf", "erfc", "erfinv", "gelu_exact", "real", "imag", "conj", "conjugate"]

ERF = define("erf", fresh=True)
ERFC = define("erfc", fresh=True)
ERF_INV = define("erf_inv", fresh=True)
# The exact GELU x Phi(x) = 0.5 x erfc(-x / sqrt 2) as one op, so that its VJP reads only x (the pre-activation,
# kept for the backward either way): erfc is computed again there instead of its (..., 4d) result being kept
# across the forward/backward boundary (as a composite of erfc and products it would be).
GELU_EXACT = define("gelu_exact", fresh=True)
# The parts of complex numbers (the Array API's ``real`` / ``imag`` / ``conj``): pointwise too, so the same rules;
# ``real`` and ``imag`` of a complex dtype are of its component dtype, of a real one its own (imag: zeros).
REAL = define("real", fresh=True)
IMAG = define("imag", fresh=True)
CONJ = define("conj", fresh=True)
SPECIAL = (ERF, ERFC, ERF_INV, GELU_EXACT, REAL, IMAG, CONJ)


# ================================================================ traced API
def erf(x) -> Tensor:
    """The error function 2/sqrt(pi) * integral_0^x exp(-t^2) dt, elementwise."""
    return core._unary(ERF, core._float(core.asarray(x)))


def erfc(x) -> Tensor:
    """1 - erf(x), accurate where erf(x) is close to 1 (large x)."""
    return core._unary(ERFC, core._float(core.asarray(x)))


def erfinv(x) -> Tensor:
    """The inverse of erf on [-1, 1] (``jax.scipy.special.erfinv``, ``jax.lax.erf_inv``)."""
    return core._unary(ERF_INV, core._float(core.asarray(x)))


def gelu_exact(x) -> Tensor:
    """The exact GELU 0.5 x erfc(-x / sqrt 2) = x Phi(x) (PyTorch's ``nn.GELU()``), elementwise; its gradient
    Phi(x) + x phi(x) is computed from x alone (``autodiff/rules/special.py``)."""
    return core._unary(GELU_EXACT, core._float(core.asarray(x)))


def _component(dtype) -> np.dtype:
    return np.dtype(dtype).type(0).real.dtype


def real(x) -> Tensor:
    """The real part of each entry (complex64 -> float32; a real array is its own real part)."""
    x = core.asarray(x)
    return core._unary(REAL, x, _component(x.dtype))


def imag(x) -> Tensor:
    """The imaginary part of each entry (complex64 -> float32; zeros for a real array)."""
    x = core.asarray(x)
    return core._unary(IMAG, x, _component(x.dtype))


def conj(x) -> Tensor:
    """The complex conjugate of each entry (a real array is its own)."""
    return core._unary(CONJ, core.asarray(x))


conjugate = conj


# ================================================================ kernels
opdef.kernel(REAL)(lambda xp, x: xp.real(x).copy())
opdef.kernel(IMAG)(lambda xp, x: xp.imag(x).copy() if x.dtype.kind == "c" else xp.zeros_like(x))
opdef.kernel(CONJ)(lambda xp, x: xp.conj(x))

# Cody's coefficients (lowest degree last in each numerator / denominator below, as CALERF's loops use them)
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
      1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
      8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
      2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
      3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
      6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
_SQRT_PI_INV = 0.56418958354775628695  # 1 / sqrt(pi)
_SMALL, _MIDDLE, _BIG = 0.46875, 4.0, 26.543  # Cody's intervals; erfc(x) underflows float64 from _BIG
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)  # d erf / dx at 0 (also the VJPs')


def _erf_small(y):
    """erf(y) / y for |y| <= 0.46875 (a rational function of y^2)."""
    z = y * y
    num, den = _A[4] * z, z
    for a, b in zip(_A[:3], _B[:3]):
        num, den = (num + a) * z, (den + b) * z
    return (num + _A[3]) / (den + _B[3])


def _erfc_middle(y):
    """erfc(y) exp(y^2) for 0.46875 < y <= 4."""
    num, den = _C[8] * y, y
    for c, d in zip(_C[:7], _D[:7]):
        num, den = (num + c) * y, (den + d) * y
    return (num + _C[7]) / (den + _D[7])


def _erfc_far(y):
    """erfc(y) exp(y^2) for 4 < y < 26.543 (a rational function of 1/y^2)."""
    z = 1.0 / (y * y)
    num, den = _P[5] * z, z
    for p, q in zip(_P[:4], _Q[:4]):
        num, den = (num + p) * z, (den + q) * z
    return (_SQRT_PI_INV - z * (num + _P[4]) / (den + _Q[4])) / y


def _erfc_positive(xp, y):
    """erfc(y) for y > 0.46875: exp(-y^2) times Cody's rational function of the interval; exp(-y^2) as
    exp(-r^2) exp(-(y-r)(y+r)) with r = y rounded down to 1/16, so exp's large argument carries no rounding
    error. Each interval computes only its own entries (boolean masks: no per-element Python)."""
    y = xp.minimum(y, _BIG)  # erfc underflows float64 there (and inf - inf below would be NaN)
    out = xp.zeros_like(y)
    middle, far = y <= _MIDDLE, (y > _MIDDLE) & (y < _BIG)
    out[middle] = _erfc_middle(y[middle])
    out[far] = _erfc_far(y[far])
    r = xp.trunc(y * 16.0) / 16.0
    return out * (xp.exp(-r * r) * xp.exp(-(y - r) * (y + r)))


def _cody(xp, x, complement: bool):
    """erf(x) (``complement`` False) or erfc(x) in float64, vectorized over Cody's three intervals."""
    x = xp.asarray(x, dtype=np.float64)
    out = xp.empty_like(x)
    small = xp.abs(x) <= _SMALL
    inner = x[small] * _erf_small(x[small])
    out[small] = 1.0 - inner if complement else inner
    rest = ~small | xp.isnan(x)
    tail, negative = _erfc_positive(xp, xp.abs(x[rest])), x[rest] < 0
    if complement:
        out[rest] = xp.where(negative, 2.0 - tail, tail)
    else:
        out[rest] = xp.where(negative, tail - 1.0, 1.0 - tail)
    return out


def _erfinv_guess(xp, y):
    """Giles' single-precision erfinv of 0 <= y < 1 (relative error ~1e-7 while 1 - y > 1e-7), in float64."""
    w = -xp.log((1.0 - y) * (1.0 + y))
    near = w < 5.0
    a = xp.where(near, w, 5.0) - 2.5
    p = 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164,
              0.246640727, 1.50140941):
        p = c + p * a
    b = xp.sqrt(xp.where(near, 5.0, w)) - 3.0
    q = -0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047,
              1.00167406, 2.83297682):
        q = c + q * b
    return xp.where(near, p, q) * y


def _erfinv(xp, y):
    """erfinv(y) in float64: Giles' guess refined by Newton steps on erf(x) = |y| where |y| <= 1/2, elsewhere
    on log erfc(x) = log(1 - |y|) (1 - |y| is exact in float64 there, and the log makes the steps converge
    fast in the far tail, where Giles' guess is rough)."""
    central_steps, tail_steps = (2, 4) if y.dtype.itemsize >= 8 else (1, 1)  # float32: Giles' guess is float32-close
    y = xp.asarray(y, dtype=np.float64)
    a = xp.abs(y)
    central, tail = a <= 0.5, (a > 0.5) & (a < 1.0)
    out = xp.where(a == 1.0, np.inf, np.nan)
    target = a[central]
    x = _erfinv_guess(xp, target)
    for _ in range(central_steps):
        x = x - (_cody(xp, x, False) - target) / (TWO_OVER_SQRT_PI * xp.exp(-x * x))
    out[central] = x
    log_c = xp.log(1.0 - a[tail])
    x = _erfinv_guess(xp, a[tail])
    for _ in range(tail_steps):
        fc = _cody(xp, x, True)
        x = xp.clip(x + (xp.log(fc) - log_c) * fc / (TWO_OVER_SQRT_PI * xp.exp(-x * x)), _SMALL, _BIG)
    out[tail] = x
    return xp.where(y < 0, -out, out)


def _on_cupy(xp) -> bool:
    return xp.__name__ == "cupy"


CHUNK = 1 << 14  # entries per NumPy pass: the float64 temporaries stay in cache and come from the heap, not mmap


def _special_kernel(numpy_fn, cupy_fn):
    """The kernel of ``numpy_fn(xp, float64 entries)`` on NumPy (in chunks), of ``cupy_fn(cupyx.scipy.special,
    x)`` on CuPy (a name: that function of cupyx.scipy.special)."""
    if isinstance(cupy_fn, str):
        cupy_fn = lambda special, x, name=cupy_fn: getattr(special, name)(x)

    def kernel(xp, x):
        if _on_cupy(xp):
            try:
                import cupyx.scipy.special  # function-local: cupy is optional (only the CuPy backend has it)
            except ImportError:  # a CuPy without cupyx (a test double): the array-module code below runs on it
                pass
            else:
                return cupy_fn(cupyx.scipy.special, x).astype(x.dtype, copy=False)
        flat, out = x.reshape(-1), xp.empty(x.size, x.dtype)
        for start in range(0, flat.size, CHUNK):  # whole-array passes per chunk (~2x faster than one pass)
            out[start:start + CHUNK] = numpy_fn(xp, flat[start:start + CHUNK])
        return out.reshape(x.shape)
    return kernel


opdef.kernel(ERF)(_special_kernel(lambda xp, x: _cody(xp, x, False), "erf"))
opdef.kernel(ERFC)(_special_kernel(lambda xp, x: _cody(xp, x, True), "erfc"))
opdef.kernel(ERF_INV)(_special_kernel(_erfinv, "erfinv"))
SQRT_HALF = 1.0 / math.sqrt(2.0)  # as the composite GELU multiplied by it (math.sqrt(0.5) is 1 ulp above)


def _gelu_exact(xp, x):
    """0.5 x erfc(-x / sqrt 2) in float64 (rounded once to the operand's dtype by the kernel)."""
    x = xp.asarray(x, dtype=np.float64)
    return 0.5 * x * _cody(xp, x * -SQRT_HALF, True)


opdef.kernel(GELU_EXACT)(_special_kernel(_gelu_exact, lambda special, x: 0.5 * x * special.erfc(x * -SQRT_HALF)))
