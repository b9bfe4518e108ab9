"""Op cases of the linalg decompositions (issue 28: ops/decompositions.py, ``matrix_function``; and the linalg
functions composed of them in ops/linalg.py), in the format of ``op_cases.CASES``.

Each case is written once against ``m``: with ``m=numpy`` it is NumPy's ``np.linalg`` (the independent
expectation). Inputs are made well-conditioned inside the case (a @ a^T + 8 I: symmetric positive definite) so
every routine is defined; results whose sign or order a routine may choose (eigenvectors, Q, U, Vh) are compared
through products that do not depend on it. Stacks of 3 or 5 matrices (uneven over most meshes: the rule makes
an uneven batch dim whole), the batch dim or the matrix dims split over "A", "B" or both.
"""
from __future__ import annotations

from op_cases import Case

B3, R3, AB3 = ("A", None, None), (None, "A", None), ("A", "B", None)
MAT_SPECS = ((B3,), (R3,), (AB3,), ((None, "A", "B"),))


def _spd(m, x):
    """x @ x^T + 8 I: symmetric positive definite, well-conditioned."""
    return m.matmul(x, m.swapaxes(x, -1, -2)) + 8.0 * m.eye(x.shape[-1])


def _t(m, x):
    return m.swapaxes(x, -1, -2)


CASES = [
    Case("inv_det_slogdet", lambda m, x: m.linalg.inv(_spd(m, x)) + m.linalg.det(_spd(m, x) * 0.2)[:, None, None]
         + m.linalg.slogdet(_spd(m, x)).logabsdet[:, None, None] * m.linalg.slogdet(-_spd(m, x)).sign[:, None, None],
         ((5, 4, 4),), MAT_SPECS),
    Case("cholesky", lambda m, x: m.linalg.cholesky(_spd(m, x)) + 2.0 * _t(m, m.linalg.cholesky(_spd(m, x))),
         ((3, 6, 6),), MAT_SPECS),
    Case("eigh", lambda m, x: (lambda w, v: m.matmul(v * w[:, None, :], _t(m, v)) + m.linalg.eigvalsh(_spd(m, x))
                               [:, :, None])(*m.linalg.eigh(_spd(m, x))), ((5, 4, 4),), MAT_SPECS),
    Case("qr", lambda m, x: m.matmul(*m.linalg.qr(x)) + m.abs(m.linalg.qr(x, mode="complete")[1][:, :4, :]).sum(1)
         [:, None, :], ((3, 7, 4),), MAT_SPECS),
    Case("svd_svdvals", lambda m, x: (lambda u, s, vh: m.matmul(u * s[:, None, :], vh))(*m.linalg.svd(x, full_matrices=False))
         + m.linalg.svdvals(x)[:, None, :] + m.abs(m.linalg.svd(x)[0][:, :, :4]), ((5, 7, 4),), MAT_SPECS),
    Case("pinv", lambda m, x: m.linalg.pinv(x) + m.linalg.pinv(x, rtol=0.5), ((3, 7, 4),), MAT_SPECS),
    Case("solve", lambda m, x, b: m.linalg.solve(_spd(m, x), b) + m.linalg.solve(_spd(m, x), b[0, :, 0])[:, :, None],
         ((5, 4, 4), (5, 4, 3)), ((B3, B3), (R3, None), (AB3, (None, "A", "B")))),
    Case("matrix_power_rank", lambda m, x: m.linalg.matrix_power(_spd(m, x) * 0.1, 3)
         + m.linalg.matrix_power(_spd(m, x), -2) + m.linalg.matrix_power(x, 0)
         + m.linalg.matrix_rank(x * m.asarray([1.0, 1.0, 0.0, 1.0])).astype("float64")[:, None, None],
         ((5, 4, 4),), MAT_SPECS),
    Case("matrix_norms_by_svd", lambda m, x: m.linalg.matrix_norm(x, ord=2) + m.linalg.matrix_norm(x, ord=-2)
         + m.linalg.matrix_norm(x, ord="nuc"), ((5, 7, 4),), MAT_SPECS),
    Case("cross", lambda m, x, y: m.linalg.cross(x, y) + m.linalg.cross(x[:, :, None], y[:, :, None], axis=1)[:, :, 0],
         ((10, 3), (10, 3)), ((("A", None), ("A", None)), ((None, "A"), None))),
]
