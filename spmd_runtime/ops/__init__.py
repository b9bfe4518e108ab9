"""Every op of spmd_runtime, one record each (``spmd_runtime/opdef.py``), grouped in families.

A family module defines, for its ops, in ONE file: the records (``opdef.define``), the traced
NumPy-style functions that emit them (their shape/dtype rule), the local kernels, the propagation
rules, the partition rules and the VJPs. ``docs/ADDING_AN_OP.md`` walks through adding one.

Families, lowest first (each may use the ones above it): ``core`` (leaves, elementwise, broadcast,
reshape, transpose, reductions), ``einsum``, ``slicing``, ``gather``, ``windows``, ``indexing``,
``top_k``, ``control`` (scan, while, cond), ``manual`` (shard_map and its collectives), and ``spmd`` (collectives and layout ops, emitted only by the partitioner). Importing this
package defines every op and binds the ``Tensor`` operators to the functions here.
"""
from ..trace import Tensor
from . import core, einsum, gather, indexing, slicing, spmd, top_k, windows  # noqa: F401  (each defines its records)
from . import control  # noqa: F401,E402  (scan / while / cond: ops with a body; last, it uses the others)
from . import manual  # noqa: F401,E402  (shard_map regions and their explicit collectives: they use control)


def _bind_tensor_operators():
    """NumPy's operators and methods on traced tensors, as the functions of the families."""
    binary = {"__add__": core.add, "__sub__": core.subtract, "__mul__": core.multiply, "__truediv__": core.divide,
              "__pow__": core.power, "__matmul__": einsum.matmul, "__eq__": core.equal, "__ne__": core.not_equal,
              "__lt__": core.less, "__le__": core.less_equal, "__gt__": core.greater, "__ge__": core.greater_equal,
              "__and__": core.logical_and, "__or__": core.logical_or}
    for name, fn in binary.items():
        setattr(Tensor, name, fn)
    for name, fn in {"__radd__": core.add, "__rsub__": core.subtract, "__rmul__": core.multiply,
                     "__rtruediv__": core.divide, "__rpow__": core.power, "__rmatmul__": einsum.matmul}.items():
        setattr(Tensor, name, lambda self, other, fn=fn: fn(other, self))
    Tensor.__neg__ = core.negative
    Tensor.__invert__ = core.logical_not
    Tensor.__hash__ = object.__hash__
    Tensor.__getitem__ = gather.getitem
    Tensor.at = property(gather.IndexUpdateHelper)
    Tensor.T = property(lambda self: core.transpose(self))
    for name, fn in {"reshape": core.reshape, "transpose": core.transpose, "sum": core.sum, "max": core.max,
                     "min": core.min, "mean": core.mean, "var": core.var, "astype": core.astype,
                     "swapaxes": core.swapaxes, "squeeze": core.squeeze}.items():
        setattr(Tensor, name, fn)


_bind_tensor_operators()
