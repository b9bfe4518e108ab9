"""The propagation and partition rules of the ``ops/decompositions.py`` family (``matrix_function``: the linalg
decompositions), registered in ``table.py``.

A decomposition reads a whole matrix: each rank computes the matrices of its own batch block. So the rule keeps
the batch dims (all but an operand's last two) split as the result wants them and makes every matrix dim whole
(the planner's all-gather, or nothing when they are whole already); the result's own trailing dims (none for
``det``, one for eigenvalues, two for factors) are whole. A result wanted split there is sliced by the driver.
A batch dim that does not split evenly is made whole too: a short block's padding would be decomposed as data
(a zero matrix is singular: ``inv`` and ``cholesky`` would raise on it).
"""
from __future__ import annotations

from ...opdef import BROADCAST_LEVEL
from ...ops.decompositions import MATRIX_FUNCTION
from ...sharding import Sharding
from .table import partition, propagation


def batch_layout(dims, batch: int, trailing: int) -> Sharding:
    """The first ``batch`` dims of ``dims`` as they are, then ``trailing`` whole dims (no partial sums)."""
    return Sharding(tuple(dims[:batch]) + ((),) * trailing)


def _batch(node, g) -> int:
    """The number of batch dims: every operand shares them (the traced functions broadcast them)."""
    return len(g[node.inputs[0]].shape) - 2


@propagation(MATRIX_FUNCTION, level=BROADCAST_LEVEL)
def _matrix_function_propagation():
    def fwd(node, ins, g, mesh):
        batch = _batch(node, g)
        known = next((s for s in ins if s is not None), None)
        return None if known is None else batch_layout(known.dims, batch, len(node.shape) - batch)

    def bwd(node, out, ins, g, mesh):
        batch = _batch(node, g)
        return [batch_layout(out.dims, batch, len(g[i].shape) - batch) for i in node.inputs]
    return fwd, bwd


def _even(dims, shape, mesh) -> tuple:
    """``dims`` with every split that does not divide its dim evenly dropped."""
    return tuple(axes if not axes or n % mesh.axis_size(axes) == 0 else () for axes, n in zip(dims, shape))


@partition(MATRIX_FUNCTION)
def _matrix_function_partition(ctx, node):
    operands = [ctx.value(i) for i in node.inputs]
    batch = len(operands[0].shape) - 2
    wanted = _even(ctx.sharding(node.id).dims[:batch], node.shape[:batch], ctx.mesh)
    operands = [ctx.reshard(x, batch_layout(wanted, batch, len(x.shape) - batch)) for x in operands]
    return ctx.emit_like(node, MATRIX_FUNCTION, operands, node.attrs, batch_layout(wanted, batch,
                                                                                   len(node.shape) - batch))
