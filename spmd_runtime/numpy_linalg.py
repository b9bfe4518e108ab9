"""``spmd_runtime.numpy.linalg`` (``snp.linalg``): the linear algebra of NumPy's ``linalg`` / the Array API's
``linalg`` extension that spmd_runtime computes (``ops/linalg.py``; no decompositions: no SVD, inverse,
solve or determinant). The Array API forms work on the last two dims (``trace``, ``diagonal``)."""
from . import dispatch
from .ops.einsum import matmul
from .ops.linalg import matrix_norm, matrix_transpose, norm, outer, tensordot, vecdot, vector_norm
from .ops import linalg as _linalg


def diagonal(x, /, *, offset=0):
    """Array API linalg.diagonal: the ``offset`` diagonal of the last two dims."""
    return _linalg.diagonal(x, offset, -2, -1)


def trace(x, /, *, offset=0, dtype=None):
    """Array API linalg.trace: the sum of the ``offset`` diagonal of the last two dims."""
    return _linalg.trace(x, offset, -2, -1, dtype)


__all__ = ["matmul", "matrix_norm", "matrix_transpose", "norm", "outer", "tensordot", "vecdot", "vector_norm",
           "diagonal", "trace"]

dispatch.wrap_functions(globals(), __all__)  # eager on DArrays, as spmd_runtime.numpy's
