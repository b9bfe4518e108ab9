"""The VJP rules of the ``ops/decompositions.py`` family (``matrix_function``), registered in ``table.py``, written
with traced ops that partition (real dtypes): ``inv`` (-Y^T G Y^T), ``det`` (g det A^-T), ``slogdet``'s log |det|
(g A^-T; its sign is piecewise constant), ``solve`` (G_B = solve(A^T, G), G_A = -G_B X^T). The factorisations
(``cholesky``, ``eigh``, ``qr``, ``svd``, ``pinv``) have no VJP here: differentiating through one raises, naming it.
"""
from __future__ import annotations

from ...ops import core
from ...ops.decompositions import MATRIX_FUNCTION, inv, solve
from ...ops.einsum import matmul
from .table import vjp


def _t(x):
    return core.swapaxes(x, -1, -2)


def _scaled(g, m):
    """``g`` (one value per matrix) times each matrix of the stack ``m``."""
    return core.multiply(core.expand_dims(core.expand_dims(g, -1), -1), m)


def _inv_vjp(node, g, ops, y):
    return [lambda: -matmul(matmul(_t(y), g), _t(y))]


def _det_vjp(node, g, ops, y):
    return [lambda: _scaled(core.multiply(g, y), _t(inv(ops[0])))]


def _slogdet_vjp(node, g, ops, y):
    return [None] if node.attrs["part"] == 0 else [lambda: _scaled(g, _t(inv(ops[0])))]


def _solve_vjp(node, g, ops, y):
    a = ops[0]
    vector = node.attrs["vector"]

    def grad_b():  # the node's b is the vector broadcast over the batch: solved as one-column matrices
        return core.squeeze(solve(_t(a), core.expand_dims(g, -1)), -1) if vector else solve(_t(a), g)

    def grad_a():
        gb = grad_b()
        if vector:
            return -core.multiply(core.expand_dims(gb, -1), core.expand_dims(y, -2))
        return -matmul(gb, _t(y))
    return [grad_a, grad_b]


_VJPS = {"inv": _inv_vjp, "det": _det_vjp, "slogdet": _slogdet_vjp, "solve": _solve_vjp}


@vjp(MATRIX_FUNCTION)
def _matrix_function_vjp(node, g, ops, y):
    rule = _VJPS.get(node.attrs["fn"])
    if rule is not None:
        return rule(node, g, ops, y)

    def refuse():
        raise NotImplementedError(f"linalg.{node.attrs['fn']} has no VJP in spmd_runtime (differentiable here: "
                                  f"{', '.join(_VJPS)}); got a gradient through it at {node.where or 'its node'}")
    return [refuse] * len(ops)
