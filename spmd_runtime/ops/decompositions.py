"""Matrix decompositions and the functions built on them (the Array API's ``linalg`` extension 2023.12:
``cholesky``, ``det``, ``eigh``, ``eigvalsh``, ``inv``, ``pinv``, ``qr``, ``slogdet``, ``solve``, ``svd``,
``svdvals``): ONE record, ``matrix_function``, whose ``fn`` attribute names the array module's routine
(``xp.linalg.<fn>``, NumPy's or CuPy's) and ``output`` which of its results the node is (a graph node has one
result: ``eigh`` emits two nodes, the eigenvalues and the eigenvectors).

Every routine maps each matrix of a stack (the last two dims) on its own: the partition rule
(``partition/rules/decompositions.py``) keeps the batch dims split as they are and makes the matrix dims whole
on every rank (no decomposition is split inside a matrix here); the VJPs (``autodiff/rules/decompositions.py``)
cover ``inv``, ``det``, ``slogdet`` and ``solve``, the others refuse differentiation by name.
Results of several arrays are the Array API's named tuples (``EighResult``, ``QRResult``, ``SlogdetResult``,
``SVDResult``).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

__all__ = ["cholesky", "det", "eigh", "eigvalsh", "inv", "pinv", "qr", "slogdet", "solve", "svd", "svdvals",
           "EighResult", "QRResult", "SlogdetResult", "SVDResult"]

MATRIX_FUNCTION = define("matrix_function")

EighResult = namedtuple("EighResult", ["eigenvalues", "eigenvectors"])
QRResult = namedtuple("QRResult", ["Q", "R"])
SlogdetResult = namedtuple("SlogdetResult", "sign logabsdet")  # one string: "sign" alone names an op
SVDResult = namedtuple("SVDResult", ["U", "S", "Vh"])
QR_MODES = ("reduced", "complete")


# ================================================================ traced API
def _matrices(x, what: str, square: bool = True) -> Tensor:
    """``x`` as a floating (or complex) stack of matrices; refuses fewer than 2 dims or non-square ones."""
    x = core._float(core.asarray(x))
    if x.ndim < 2 or (square and x.shape[-1] != x.shape[-2]):
        kind = "square matrices" if square else "matrices"
        raise ValueError(f"linalg.{what} takes a stack of {kind} (its last two dims); got shape {x.shape}")
    return x


def _emit(fn: str, operands, shape, dtype, output: int = 0, **attrs) -> Tensor:
    return emit(MATRIX_FUNCTION, list(operands), {"fn": fn, "part": output, **attrs}, tuple(shape), np.dtype(dtype))


def _real(dtype) -> np.dtype:
    """The real dtype of a complex one's parts (a real dtype is its own)."""
    return np.dtype(dtype).type(0).real.dtype


def cholesky(x, /, *, upper=False) -> Tensor:
    """The Cholesky factor of each Hermitian positive-definite matrix: L (L @ L^H = x), or U = L^H when ``upper``."""
    x = _matrices(x, "cholesky")
    return _emit("cholesky", [x], x.shape, x.dtype, upper=bool(upper))


def det(x, /) -> Tensor:
    x = _matrices(x, "det")
    return _emit("det", [x], x.shape[:-2], x.dtype)


def slogdet(x, /) -> SlogdetResult:
    """(sign, log |det|) of each matrix: the determinant without overflow (sign 0 and -inf for a singular one)."""
    x = _matrices(x, "slogdet")
    return SlogdetResult(_emit("slogdet", [x], x.shape[:-2], x.dtype, 0),
                         _emit("slogdet", [x], x.shape[:-2], _real(x.dtype), 1))


def inv(x, /) -> Tensor:
    x = _matrices(x, "inv")
    return _emit("inv", [x], x.shape, x.dtype)


def eigh(x, /) -> EighResult:
    """Eigenvalues (ascending, real) and eigenvectors (columns) of each Hermitian matrix (its lower triangle read)."""
    x = _matrices(x, "eigh")
    return EighResult(_emit("eigh", [x], x.shape[:-1], _real(x.dtype), 0), _emit("eigh", [x], x.shape, x.dtype, 1))


def eigvalsh(x, /) -> Tensor:
    x = _matrices(x, "eigvalsh")
    return _emit("eigvalsh", [x], x.shape[:-1], _real(x.dtype))


def qr(x, /, *, mode="reduced") -> QRResult:
    """Q (orthonormal columns) and R (upper triangular) of each matrix, ``mode`` 'reduced' (K = min(M, N)
    columns of Q) or 'complete' (Q square)."""
    if mode not in QR_MODES:
        raise ValueError(f"linalg.qr's mode must be one of {QR_MODES}; got mode={mode!r}")
    x = _matrices(x, "qr", square=False)
    *batch, m, n = x.shape
    k = min(m, n) if mode == "reduced" else m
    return QRResult(_emit("qr", [x], (*batch, m, k), x.dtype, 0, mode=mode),
                    _emit("qr", [x], (*batch, k, n), x.dtype, 1, mode=mode))


def svd(x, /, *, full_matrices=True) -> SVDResult:
    """U, the singular values S (descending) and Vh of each matrix: x = U @ diag(S) @ Vh."""
    x = _matrices(x, "svd", square=False)
    *batch, m, n = x.shape
    k = min(m, n)
    rows, cols = (m, n) if full_matrices else (k, k)
    full = bool(full_matrices)
    return SVDResult(_emit("svd", [x], (*batch, m, rows), x.dtype, 0, full_matrices=full),
                     _emit("svd", [x], (*batch, k), _real(x.dtype), 1, full_matrices=full),
                     _emit("svd", [x], (*batch, cols, n), x.dtype, 2, full_matrices=full))


def svdvals(x, /) -> Tensor:
    x = _matrices(x, "svdvals", square=False)
    return _emit("svdvals", [x], x.shape[:-2] + (min(x.shape[-2:]),), _real(x.dtype))


def pinv(x, /, *, rtol=None) -> Tensor:
    """The Moore-Penrose pseudo-inverse of each matrix; singular values below ``rtol`` times the largest count as
    zero (default: max(M, N) * eps of the dtype, the Array API's)."""
    x = _matrices(x, "pinv", square=False)
    if rtol is not None and (isinstance(rtol, Tensor) or not isinstance(rtol, (int, float, np.number))):
        raise ValueError(f"linalg.pinv takes a static float rtol (or None) here; got rtol={rtol!r}")
    rtol = float(max(x.shape[-2:]) * np.finfo(x.dtype).eps if rtol is None else rtol)
    return _emit("pinv", [x], x.shape[:-2] + (x.shape[-1], x.shape[-2]), x.dtype, rtol=rtol)


def solve(x1, x2, /) -> Tensor:
    """The solution X of x1 @ X = x2 for each square x1: x2 is one vector when 1-d (the Array API's rule), else a
    stack of matrices; the stacks broadcast."""
    a, b = core.asarray(x1), core.asarray(x2)
    dtype = core.result_type(core._float(a), b)
    a, b = _matrices(core.astype(a, dtype), "solve"), core.astype(b, dtype)
    n = a.shape[-1]
    vector = b.ndim == 1
    if (b.shape[0] if vector else (b.shape[-2] if b.ndim >= 2 else -1)) != n:
        raise ValueError(f"linalg.solve needs x2 of shape ({n},) or (..., {n}, K) for x1 of shape {a.shape}; got "
                         f"x2 of shape {b.shape}")
    rows = b.shape[-1:] if vector else b.shape[-2:]
    batch = np.broadcast_shapes(a.shape[:-2], () if vector else b.shape[:-2])
    a, b = core.broadcast_to(a, batch + a.shape[-2:]), core.broadcast_to(b, batch + rows)
    return _emit("solve", [a, b], b.shape, dtype, vector=vector)


# ================================================================ kernels
def _swap(xp, x):
    return xp.conj(xp.swapaxes(x, -1, -2))


def _pinv(xp, x, rtol):
    """Through the SVD, so that ``rtol`` means the same for NumPy and CuPy (their keywords differ)."""
    u, s, vh = xp.linalg.svd(x, full_matrices=False)
    keep = s > rtol * xp.max(s, axis=-1, keepdims=True, initial=0)
    inverse = xp.where(keep, 1 / xp.where(keep, s, 1), 0)
    return xp.matmul(_swap(xp, vh) * inverse[..., None, :], _swap(xp, u))


_ROUTINES = {
    "cholesky": lambda xp, x, upper: _swap(xp, xp.linalg.cholesky(x)) if upper else xp.linalg.cholesky(x),
    "det": lambda xp, x: xp.linalg.det(x),
    "slogdet": lambda xp, x: tuple(xp.linalg.slogdet(x)),
    "inv": lambda xp, x: xp.linalg.inv(x),
    "eigh": lambda xp, x: tuple(xp.linalg.eigh(x)),
    "eigvalsh": lambda xp, x: xp.linalg.eigvalsh(x),
    "qr": lambda xp, x, mode: tuple(xp.linalg.qr(x, mode=mode)),
    "svd": lambda xp, x, full_matrices: tuple(xp.linalg.svd(x, full_matrices=full_matrices)),
    "svdvals": lambda xp, x: xp.linalg.svd(x, compute_uv=False),
    "pinv": _pinv,
    "solve": lambda xp, a, b, vector: xp.linalg.solve(a, b[..., None])[..., 0] if vector else xp.linalg.solve(a, b),
}
ROUTINES = tuple(_ROUTINES)


@opdef.kernel(MATRIX_FUNCTION)
def _matrix_function_kernel(xp, *operands, fn, part, upper=None, mode=None, full_matrices=None, rtol=None,
                            vector=None):
    """The routines' keywords named one by one (a program file's attributes are checked against them)."""
    given = {"upper": upper, "mode": mode, "full_matrices": full_matrices, "rtol": rtol, "vector": vector}
    out = _ROUTINES[fn](xp, *operands, **{k: v for k, v in given.items() if v is not None})
    return out[part] if isinstance(out, tuple) else out
