"""Array manipulation (NumPy / jax.numpy / Array API 2023.12 names and keywords), composed of existing ops.

No op of its own: splits are static slices, ``tile`` and a scalar ``repeat`` are a broadcast to a new dim
then a reshape, a per-element ``repeat`` is a ``take`` of static indices, the stacks are ``concatenate``
after ``atleast_*d``, ``diff`` subtracts shifted slices, ``unstack`` slices and squeezes. They partition
and differentiate as the ops they are made of. ``take_along_axis`` is the sorting family's op
(``ops/sorting.py``).
"""
from __future__ import annotations

import numpy as np

from ..trace import Tensor
from . import core
from .core import normalize_axis
from .gather import take
from .slicing import concatenate, slice_in_dim

__all__ = ["split", "array_split", "tile", "repeat", "hstack", "vstack", "dstack", "column_stack", "ravel",
           "atleast_1d", "atleast_2d", "atleast_3d", "diff", "permute_dims", "unstack", "broadcast_arrays",
           "broadcast_shapes"]


def _static_ints(v, what: str) -> list[int]:
    if isinstance(v, Tensor):
        raise ValueError(f"{what} must be static (Python ints; use static_argnums under jit); got a traced tensor")
    return [int(i) for i in np.asarray(v).reshape(-1)]


# ---------------------------------------------------------------- splits
def array_split(ary, indices_or_sections, axis=0) -> list[Tensor]:
    """NumPy array_split: ``n`` sections (the first ``size % n`` one longer) or the pieces between sorted
    indices (clipped to the dim, as NumPy)."""
    x = core.asarray(ary)
    axis = normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if isinstance(indices_or_sections, (int, np.integer)):
        sections = int(indices_or_sections)
        if sections <= 0:
            raise ValueError(f"array_split needs a number of sections >= 1; got {sections}")
        each, extra = divmod(n, sections)
        bounds = np.cumsum([0] + [each + 1] * extra + [each] * (sections - extra)).tolist()
    else:
        cuts = _static_ints(indices_or_sections, "split's indices")
        bounds = [0] + [min(max(c if c >= 0 else c + n, 0), n) for c in cuts] + [n]
    return [slice_in_dim(x, lo, max(lo, hi), axis=axis) for lo, hi in zip(bounds[:-1], bounds[1:])]


def split(ary, indices_or_sections, axis=0) -> list[Tensor]:
    """NumPy split: like ``array_split``, but ``n`` sections must divide the dim evenly."""
    x = core.asarray(ary)
    if isinstance(indices_or_sections, (int, np.integer)):
        n = x.shape[normalize_axis(axis, x.ndim)]
        if indices_or_sections <= 0 or n % int(indices_or_sections):
            raise ValueError(f"split into {indices_or_sections} equal sections needs a dim they divide (use "
                             f"array_split for unequal ones); got size {n} along axis {axis}")
    return array_split(x, indices_or_sections, axis)


def unstack(x, /, *, axis=0) -> tuple[Tensor, ...]:
    """Array API unstack: the slices along ``axis``, that dim removed."""
    x = core.asarray(x)
    axis = normalize_axis(axis, x.ndim)
    return tuple(core.squeeze(slice_in_dim(x, i, i + 1, axis=axis), axis) for i in range(x.shape[axis]))


# ---------------------------------------------------------------- repeats
def tile(A, reps) -> Tensor:
    """NumPy tile: ``A`` repeated ``reps[i]`` times along dim i (both padded with leading ones to one rank)."""
    x, reps = core.asarray(A), _static_ints(reps, "tile's reps")
    ndim = max(x.ndim, len(reps))
    x = core.reshape(x, (1,) * (ndim - x.ndim) + x.shape)
    reps = [1] * (ndim - len(reps)) + reps
    wide = tuple(s for r, n in zip(reps, x.shape) for s in (r, n))
    out = core.broadcast_in_dim(x, wide, tuple(range(1, 2 * ndim, 2)))
    return core.reshape(out, tuple(r * n for r, n in zip(reps, x.shape)))


def repeat(a, repeats, axis=None, *, total_repeat_length=None) -> Tensor:
    """NumPy repeat: each entry ``repeats`` times along ``axis`` (the flattened array when None); ``repeats``
    a static int (a broadcast and a reshape) or one static count per entry (a take of static indices)."""
    x = core.asarray(a)
    if axis is None:
        x, axis = core.reshape(x, -1), 0
    axis = normalize_axis(axis, x.ndim)
    counts = _static_ints(repeats, "repeat's repeats")
    if any(c < 0 for c in counts) or len(counts) not in (1, x.shape[axis]):
        raise ValueError(f"repeat needs non-negative counts, one or one per entry along axis {axis} "
                         f"({x.shape[axis]}); got {counts}")
    length = counts[0] * x.shape[axis] if len(counts) == 1 else sum(counts)
    if total_repeat_length is not None and total_repeat_length != length:
        raise ValueError(f"repeat's total_repeat_length must equal the repeated length; got {total_repeat_length}")
    if len(counts) == 1:
        r, n = counts[0], x.shape[axis]
        wide = x.shape[:axis + 1] + (r,) + x.shape[axis + 1:]
        out = core.broadcast_in_dim(x, wide, tuple(i for i in range(x.ndim + 1) if i != axis + 1))
        return core.reshape(out, x.shape[:axis] + (n * r,) + x.shape[axis + 1:])
    index = np.repeat(np.arange(x.shape[axis]), counts).astype(np.int64)
    return take(x, core.asarray(index), axis=axis)


# ---------------------------------------------------------------- stacks
def atleast_1d(*arys):
    out = [core.reshape(x, (1,)) if x.ndim == 0 else x for x in map(core.asarray, arys)]
    return out[0] if len(out) == 1 else out


def atleast_2d(*arys):
    out = [core.reshape(x, (1,) * (2 - x.ndim) + x.shape) if x.ndim < 2 else x for x in map(core.asarray, arys)]
    return out[0] if len(out) == 1 else out


def atleast_3d(*arys):
    """As NumPy: a 1-d (n,) becomes (1, n, 1), a 2-d (m, n) becomes (m, n, 1)."""
    def lift(x):
        if x.ndim == 0:
            return core.reshape(x, (1, 1, 1))
        if x.ndim == 1:
            return core.reshape(x, (1,) + x.shape + (1,))
        return core.reshape(x, x.shape + (1,)) if x.ndim == 2 else x
    out = [lift(core.asarray(x)) for x in arys]
    return out[0] if len(out) == 1 else out


def _many(tup, lift):
    xs = [lift(core.asarray(x)) for x in tup]
    if not xs:
        raise ValueError("a stack needs at least one array; got none")
    return xs


def vstack(tup) -> Tensor:
    return concatenate(_many(tup, atleast_2d), axis=0)


def hstack(tup) -> Tensor:
    xs = _many(tup, atleast_1d)
    return concatenate(xs, axis=0 if xs[0].ndim == 1 else 1)


def dstack(tup) -> Tensor:
    return concatenate(_many(tup, atleast_3d), axis=2)


def column_stack(tup) -> Tensor:
    """1-d arrays become columns, 2-d ones join as they are."""
    return concatenate(_many(tup, lambda x: core.reshape(x, (-1, 1)) if x.ndim < 2 else x), axis=1)


def ravel(a, order="C") -> Tensor:
    if order not in ("C", "A", "K"):
        raise ValueError(f"ravel flattens in C order (a traced tensor has no memory layout); got order={order!r}")
    return core.reshape(a, -1)


def permute_dims(x, /, axes) -> Tensor:
    """Array API permute_dims: ``transpose`` with the permutation required."""
    return core.transpose(x, tuple(axes))


# ---------------------------------------------------------------- differences
def diff(a, n=1, axis=-1, prepend=None, append=None) -> Tensor:
    """NumPy diff: the ``n``-th forward difference along ``axis``, after joining ``prepend`` / ``append``
    (scalars broadcast to one slice); booleans differ by ``!=`` as NumPy."""
    x = core.asarray(a)
    if x.ndim == 0:
        raise ValueError(f"diff needs an array of rank >= 1; got shape {x.shape}")
    axis = normalize_axis(axis, x.ndim)
    if n < 0:
        raise ValueError(f"diff's order n must be >= 0; got {n}")
    pieces = [_edge(v, x, axis) for v in (prepend,) if v is not None] + [x] + \
             [_edge(v, x, axis) for v in (append,) if v is not None]
    x = concatenate(pieces, axis=axis) if len(pieces) > 1 else x
    for _ in range(int(n)):
        m = x.shape[axis]
        hi, lo = slice_in_dim(x, 1, m, axis=axis), slice_in_dim(x, 0, max(m - 1, 0), axis=axis)
        x = core.not_equal(hi, lo) if x.dtype == np.bool_ else core.subtract(hi, lo)
    return x


def _edge(v, x: Tensor, axis: int) -> Tensor:
    v = core.asarray(v)
    if v.ndim == 0:
        return core.broadcast_to(v, x.shape[:axis] + (1,) + x.shape[axis + 1:])
    return v


# ---------------------------------------------------------------- broadcasting
def broadcast_shapes(*shapes) -> tuple[int, ...]:
    return np.broadcast_shapes(*shapes)


def broadcast_arrays(*args) -> list[Tensor]:
    xs = [core.asarray(x) for x in args]
    shape = np.broadcast_shapes(*[x.shape for x in xs])
    return [core.broadcast_to(x, shape) for x in xs]
