"""``spmd_runtime.numpy.linalg`` (``snp.linalg``): the linear algebra of NumPy's ``linalg`` / the Array API's
``linalg`` extension (``ops/linalg.py``; the decompositions are ``ops/decompositions.py``'s: each matrix of a
stack whole on one rank). The Array API forms work on the last two dims (``trace``, ``diagonal``)."""
from . import dispatch
from .ops.einsum import matmul
from .ops.decompositions import (EighResult, QRResult, SlogdetResult, SVDResult, cholesky, det, eigh, eigvalsh, inv,
    pinv, qr, slogdet, solve, svd, svdvals)
from .ops.linalg import (cross, matrix_norm, matrix_power, matrix_rank, matrix_transpose, norm, outer, tensordot,
    vecdot, vector_norm)
from .ops import linalg as _linalg


def diagonal(x, /, *, offset=0):
    """Array API linalg.diagonal: the ``offset`` diagonal of the last two dims."""
    return _linalg.diagonal(x, offset, -2, -1)


def trace(x, /, *, offset=0, dtype=None):
    """Array API linalg.trace: the sum of the ``offset`` diagonal of the last two dims."""
    return _linalg.trace(x, offset, -2, -1, dtype)


__all__ = ["matmul", "matrix_norm", "matrix_transpose", "norm", "outer", "tensordot", "vecdot", "vector_norm",
           "diagonal", "trace", "cholesky", "cross", "det", "eigh", "eigvalsh", "inv", "matrix_power", "matrix_rank",
           "pinv", "qr", "slogdet", "solve", "svd", "svdvals", "EighResult", "QRResult", "SlogdetResult", "SVDResult"]

dispatch.wrap_functions(globals(), __all__)  # eager on DArrays, as spmd_runtime.numpy's
