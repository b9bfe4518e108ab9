"""Eager DArrays: operators, methods and ``snp`` functions on DArrays outside ``jit`` (JAX's eager mode,
DTensor's op dispatch).

``x + y``, ``x.sum(axis=0)``, ``snp.exp(x)`` or ``snp.concatenate([x, y])`` with DArray operands run as
ONE partitioned program per (function, static arguments, shapes, dtypes, shardings, mesh): the first call
traces and partitions it, later ones reuse it. Each call is a ``jit`` call, so it makes the same agreement
as ``jit`` (every rank compiled the same program from the same signature; NumPy operands, which every
rank must hold whole, agree by digest). The result is a DArray laid out as propagation chose (elementwise
results keep their operands' layout; a sum over a split dim may be a partial sum, which ``gather()``
completes).

What is dynamic: DArray and array leaves of the arguments (pytrees: lists, tuples, dicts). Everything else
(Python numbers, axes, shapes, slices, dtypes) is static: part of the cache key, passed to the function as
it is, so a Python scalar keeps JAX's weak type (``x * 2.0`` stays float32).
"""
from __future__ import annotations

import operator
from collections import OrderedDict

import numpy as np

from . import pytree
from .darray import DArray, device_put
from .jit import jit
from .mesh import get_mesh
from . import dispatch, numpy as snp
from .trace import Tensor

CACHE_SIZE = 512  # compiled eager functions kept (least recently used dropped): bounded memory
_compiled: OrderedDict = OrderedDict()

# Dunders of Python's operator protocol (``operator.__add__`` ...; reflected ``__radd__`` ...): a DArray has
# those the traced Tensor has, each run eagerly; a Tensor's public methods and properties likewise.
OPERATOR_DUNDERS = frozenset(n for n in dir(operator) if n.startswith("__") and n.endswith("__") and
                             callable(getattr(operator, n))) | {"__divmod__", "__invert__"}
# Tensor attributes that are not array operations: a DArray has its own (or none).
NOT_MIRRORED = frozenset({"node", "shape", "dtype", "ndim", "size"})


def _is_array(x) -> bool:
    return isinstance(x, (DArray, np.ndarray, np.generic)) or hasattr(x, "__array_namespace__")


def _static_key(x):
    """A hashable stand-in for a static leaf: its type and repr (slices and lists are unhashable in 3.11;
    ``1`` and ``1.0`` and ``True`` must not share a program: their weak types differ)."""
    return type(x).__qualname__, repr(x)


def apply(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the ranks' blocks, as one cached partitioned program; DArray results."""
    leaves, tree = pytree.flatten((args, kwargs))
    dynamic = [k for k, x in enumerate(leaves) if _is_array(x)]
    darrays = [leaves[k] for k in dynamic if isinstance(leaves[k], DArray)]
    static = tuple((k, _static_key(x)) for k, x in enumerate(leaves) if k not in set(dynamic))
    mesh = darrays[0].mesh if darrays else get_mesh(required_by=f"{_name(fn)} outside sr.jit, with no DArray "
                                                    f"operand (it makes a replicated DArray on the context mesh)")
    comm = darrays[0].comm if darrays else None
    key = (fn, tree, static, tuple(dynamic), mesh, id(comm))
    jitted = _compiled.get(key)
    if jitted is None:
        jitted = _compiled[key] = jit(_traced(fn, leaves, tree, dynamic), mesh=mesh, comm=comm)
        jitted.__name__ = _name(fn)
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    else:
        _compiled.move_to_end(key)
    return jitted(*(leaves[k] for k in dynamic))


def _traced(fn, leaves, tree, dynamic):
    """The function of the dynamic leaves alone: static leaves are put back where they were."""
    static = {k: x for k, x in enumerate(leaves) if k not in set(dynamic)}

    def traced(*arrays):
        full = dict(static)
        full.update(zip(dynamic, arrays))
        args, kwargs = tree.unflatten(full[k] for k in range(len(leaves)))
        return fn(*args, **kwargs)
    return traced


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def spmd_function(fn, args, kwargs):
    """The ``__spmd_function__`` protocol: ``spmd_runtime.numpy`` hands here a call with a DArray operand, or
    any call made outside a trace (``snp.zeros(3)`` or ``snp.exp(np_array)``: a replicated DArray on the
    context mesh, as ``jnp`` outside ``jax.jit`` gives a ``jax.Array``). A function of data-dependent length
    (``nonzero``, ``unique_values`` ...: ``ops.sorting.data_dependent``) called without ``size=`` gets it from a
    first program that counts (JAX's eager ``jnp.nonzero``; under ``jit`` the size stays required)."""
    count = getattr(fn, "eager_size", None)
    if count is not None and kwargs.get("size") is None:
        kwargs = dict(kwargs, size=int(apply(count, *args, **kwargs)))
    return apply(fn, *args, **kwargs)


# One function object per Tensor method, so that its programs share a cache entry across calls.
def _method(name: str):
    def call(x, *args, **kwargs):
        return getattr(x, name)(*args, **kwargs)
    call.__qualname__ = f"DArray.{name}"
    return call


_GETITEM = _method("__getitem__")


def _property(name: str):
    def get(x):
        return getattr(x, name)
    get.__qualname__ = f"DArray.{name}"
    return property(lambda self: apply(get, self))


def _dunder(name: str):
    method = _method(name)
    return lambda self, *args, **kwargs: apply(method, self, *args, **kwargs)


def _element(x, starts):
    """``x[i, j, ...]`` with the indices traced: one program for every index of a shape and layout."""
    n = starts.shape[0]
    window = snp.dynamic_slice(x, [starts[k] for k in range(n)] + [0] * (x.ndim - n), [1] * n + list(x.shape[n:]))
    return window.reshape(x.shape[n:])


def _element_starts(x, key):
    """The starts of ``x[key]`` as data when ``key`` is integers only (one per leading dim, in bounds), else None."""
    ints = key if isinstance(key, tuple) else (key,)
    if not (ints and len(ints) <= x.ndim and all(isinstance(k, (int, np.integer)) and not isinstance(k, bool)
                                                 for k in ints)):
        return None
    for dim, (k, n) in enumerate(zip(ints, x.shape)):
        if not -n <= k < n:
            raise IndexError(f"index {k} is out of bounds for axis {dim} with size {n}")
    return np.array([k % n for k, n in zip(ints, x.shape)], np.int32)


def _masks_as_indices(key):
    """``key`` with each boolean DArray mask (of rank >= 1) replaced by the integer index arrays of its true
    entries (``snp.nonzero``, its length counted by a first program): ``x[mask]`` has a data-dependent shape,
    which an eager call can know (JAX's eager boolean indexing) and a traced one cannot."""
    parts = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, DArray) and k.dtype == np.bool_ and k.ndim for k in parts):
        return key
    out = []
    for k in parts:
        out.extend(snp.nonzero(k) if isinstance(k, DArray) and k.dtype == np.bool_ and k.ndim else (k,))
    return tuple(out)


def _getitem(self, key):
    """Integer indices (element access, the most repeated eager call) go in as data, so reading every element
    of an array compiles one program; any other key is static (one program per key), DArrays in it data."""
    starts = _element_starts(self, key)
    if starts is not None:
        return apply(_element, self, starts)
    return apply(_GETITEM, self, _masks_as_indices(key))


def _set(x, key, value):
    return x.at[key].set(value)


def _set_element(x, starts, value):
    """``x[i, j, ...] = value`` with the indices and the value traced: one program for every index and value."""
    n = starts.shape[0]
    window = snp.broadcast_to(value, x.shape[n:]).reshape([1] * n + list(x.shape[n:]))
    return snp.dynamic_update_slice(x, window, [starts[k] for k in range(n)] + [0] * (x.ndim - n))


def _as_data(value, dtype):
    """A Python number as a 0-d array of ``dtype`` (what ``x.at[...].set`` casts it to), so that it is data, not
    part of the program's key; None when it is no Python number or does not fit the dtype."""
    if type(value) not in (bool, int, float, complex):
        return None
    try:
        return np.asarray(value, dtype)
    except (OverflowError, TypeError, ValueError):
        return None


def _setitem(self, key, value):
    """``x[key] = value`` (the Array API's arrays are mutable; JAX's are not: there it is ``x.at[key].set``): this
    DArray's block becomes that of ``x.at[key].set(value)``, resharded to this DArray's layout if it moved. Integer
    indices with a Python number (how arrays are filled element by element) go in as data: one program."""
    starts, data = _element_starts(self, key), _as_data(value, self.dtype)
    if starts is not None and data is not None:
        updated = apply(_set_element, self, starts, data)
    else:
        updated = apply(_set, self, _masks_as_indices(key), value)
    if updated.sharding != self.sharding:
        updated = device_put(updated, self.spec, self.mesh)
    self.local = updated.local


def _scalar(convert):
    def to_scalar(self):
        if self.ndim != 0:
            raise TypeError(f"only a 0-d DArray converts to a Python {convert.__name__}; got shape "
                            f"{list(self.shape)} (index it, or reduce it, first)")
        return convert(np.asarray(self)[()])
    return to_scalar


def _mirrored(name: str) -> bool:
    """Whether DArray runs Tensor's ``name`` eagerly: an operator (or its reflected form) or a public method or
    property that DArray does not define itself."""
    if name.startswith("__"):
        return name in OPERATOR_DUNDERS or "__" + name[3:] in OPERATOR_DUNDERS  # "__radd__" -> "__add__"
    return not name.startswith("_") and name not in NOT_MIRRORED and name not in vars(DArray)


def bind_darray_operators():
    """DArray's operators, methods and properties: those of the traced Tensor, each run eagerly (``apply``)."""
    for name, value in list(vars(Tensor).items()):
        if not _mirrored(name) or name in ("__call__", "__contains__", "__delitem__", "__setitem__", "__not__"):
            continue
        setattr(DArray, name, _property(name) if isinstance(value, property) else _dunder(name))
    DArray.__getitem__ = _getitem
    DArray.__setitem__ = _setitem
    DArray.__hash__ = object.__hash__  # __eq__ is elementwise now; identity hashing, as numpy arrays refuse it
    DArray.__spmd_function__ = staticmethod(spmd_function)
    for convert in (float, int, bool, complex):
        setattr(DArray, f"__{convert.__name__}__", _scalar(convert))
    DArray.__index__ = _scalar(operator.index)  # a 0-d integer DArray as a Python int (x[i] with i a DArray, range(n))
    DArray.__array_namespace__ = lambda self, api_version=None: snp  # the Array API's way to find functions
    DArray.device = property(lambda self: self.mesh)  # a DArray lives on its whole mesh
    DArray.to_device = _to_device
    DArray.__len__ = lambda self: self.shape[0] if self.shape else _unsized(self)
    DArray.__iter__ = lambda self: (self[i] for i in range(len(self)))


def _to_device(x, device, /, *, stream=None):
    """The Array API's ``to_device``: a DArray stays on its own mesh (``sr.device_put`` lays it out anew)."""
    if device != x.mesh:
        raise ValueError(f"a DArray lives on its mesh {x.mesh}; got device {device!r} (move it with "
                         f"sr.device_put(x, spec, mesh), or save and load it onto another mesh)")
    return x


def _unsized(x):
    raise TypeError(f"len() of a 0-d DArray; got shape {list(x.shape)}")


bind_darray_operators()
dispatch.outside_trace = spmd_function  # snp calls outside a trace run eagerly on the context mesh
