"""Every op of spmd_runtime, one record each (``spmd_runtime/opdef.py``), grouped in families.

A family module defines, for its ops, in ONE file: the records (``opdef.define``), the traced
NumPy-style functions that emit them (their shape/dtype rule), the local kernels, the propagation
rules, the partition rules and the VJPs. ``docs/ADDING_AN_OP.md`` walks through adding one.

Families, lowest first (each may use the ones above it): ``core`` (leaves, elementwise, broadcast,
reshape, transpose, reductions), ``einsum``, ``slicing``, ``gather``, ``windows``, ``indexing``,
``top_k``, ``sorting``, ``special`` (erf, erfc, erf_inv, gelu_exact), ``random`` (Threefry random bits), ``control`` (scan, while, cond), ``manual`` (shard_map and its collectives), and ``spmd`` (collectives and layout ops, emitted only by the partitioner). Importing this
package defines every op and binds the ``Tensor`` operators to the functions here.
"""
import sys

from ..trace import Tensor
from . import core, decompositions, einsum, fft, gather, indexing, random, slicing, sorting, special, spmd, top_k, windows  # noqa: F401  (each defines its records)
from . import linalg, manipulation, reductions  # noqa: F401,E402  (compositions of the families above: no records)
from . import control  # noqa: F401,E402  (scan / while / cond: ops with a body; last, it uses the others)
from . import manual  # noqa: F401,E402  (shard_map regions and their explicit collectives: they use control)


def _bind_tensor_operators():
    """NumPy's operators and methods on traced tensors, as the functions of the families. ``&``, ``|``, ``^``,
    ``~`` are bitwise (logical on bools), as NumPy's; ``//`` and ``%`` are NumPy's floor division and remainder."""
    binary = {"__add__": core.add, "__sub__": core.subtract, "__mul__": core.multiply, "__truediv__": core.divide,
              "__floordiv__": core.floor_divide, "__mod__": core.remainder, "__divmod__": core.divmod,
              "__pow__": core.power, "__matmul__": einsum.matmul, "__and__": core.bitwise_and,
              "__or__": core.bitwise_or, "__xor__": core.bitwise_xor, "__lshift__": core.left_shift,
              "__rshift__": core.right_shift}
    comparisons = {"__eq__": core.equal, "__ne__": core.not_equal, "__lt__": core.less, "__le__": core.less_equal,
                   "__gt__": core.greater, "__ge__": core.greater_equal}
    for name, fn in {**binary, **comparisons}.items():
        setattr(Tensor, name, fn)
    for name, fn in binary.items():  # reflected: 2 - x, 7 // x, 1 << x, ...
        setattr(Tensor, "__r" + name[2:], lambda self, other, fn=fn: fn(other, self))
    Tensor.__neg__ = core.negative
    Tensor.__pos__ = core.positive
    Tensor.__abs__ = core.absolute
    Tensor.__invert__ = core.invert
    Tensor.__hash__ = object.__hash__
    Tensor.__getitem__ = gather.getitem
    Tensor.at = property(gather.IndexUpdateHelper)
    Tensor.T = property(lambda self: core.transpose(self))
    Tensor.mT = property(lambda self: core.swapaxes(self, -1, -2))  # the Array API's matrix transpose
    for name, fn in {"reshape": core.reshape, "transpose": core.transpose, "sum": core.sum, "max": core.max,
                     "min": core.min, "mean": core.mean, "var": core.var, "astype": core.astype,
                     "swapaxes": core.swapaxes, "squeeze": core.squeeze}.items():
        setattr(Tensor, name, fn)
    for fn in (core.clip, core.round, indexing.argmax, indexing.argmin, windows.cumsum):  # methods named as snp's
        setattr(Tensor, fn.__name__, fn)
    Tensor.flatten = Tensor.ravel = lambda self: core.reshape(self, -1)
    for name in SNP_METHODS:
        setattr(Tensor, name, _snp_method(name))


# Methods of ops another family may define: each calls ``snp.<name>`` when called, or says it is missing.
SNP_METHODS = ("prod", "any", "all", "std", "cumprod")


def _snp_method(name: str):
    def method(self, *args, **kwargs):
        snp = sys.modules["spmd_runtime.numpy"]  # loaded by the package; importing it here would be a cycle
        if not hasattr(snp, name):
            raise AttributeError(f"Tensor.{name} calls snp.{name}, which this spmd_runtime does not define; got a "
                                 f"call on {self!r}")
        return getattr(snp, name)(self, *args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


def _bind_numpy_methods():
    """The array methods of the non-elementwise coverage (jax.Array's: ``x.sort()`` returns a sorted copy)."""
    methods = {"prod": reductions.prod, "any": reductions.any, "all": reductions.all, "std": reductions.std,
               "cumsum": windows.cumsum, "cumprod": reductions.cumprod, "ravel": manipulation.ravel,
               "flatten": manipulation.ravel, "repeat": manipulation.repeat, "sort": sorting.sort,
               "argsort": sorting.argsort, "diagonal": linalg.diagonal, "trace": linalg.trace,
               "nonzero": sorting.nonzero}
    for name, fn in methods.items():
        setattr(Tensor, name, fn)


_bind_tensor_operators()
_bind_numpy_methods()
