"""Slicing-family op cases (static slices and indexing, pads, concatenate, stack, reverse, iota/arange,
dynamic_slice, dynamic_update_slice), in the format of op_cases.py (same ``Case``, ``resolve``,
``make_inputs``, ``partition_case``, ``tolerance``) so the MPI suite can run them per world size.

Each ``fn(m, *args)`` runs with ``m=spmd_runtime.numpy`` (traced) or ``m=numpy`` (the expectation).
XLA-only ops (lax_pad with interior padding, dynamic_slice, ...) go through ``_lax(m)``, which is
spmd_runtime.numpy itself when tracing and the independent NumPy versions in ``NUMPY_LAX`` otherwise.
Dynamic starts are 0-d int64 tensors (``_start``): constants, or computed from the data, including
out-of-range values that XLA clamps to [0, n - size]. Sizes: 24 splits evenly on every test mesh;
10, 7 and 5 do not.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from op_cases import Case


# ---------------------------------------------------------------- NumPy versions of the XLA ops
def _np_dynamic_slice(x, starts, sizes):
    starts = [min(max(int(s), 0), n - m) for s, n, m in zip(starts, x.shape, sizes)]
    return x[tuple(slice(s, s + m) for s, m in zip(starts, sizes))]


def _np_dynamic_update_slice(x, update, starts):
    starts = [min(max(int(s), 0), n - m) for s, n, m in zip(starts, x.shape, update.shape)]
    out = x.copy()
    out[tuple(slice(s, s + m) for s, m in zip(starts, update.shape))] = update
    return out


def _np_lax_pad(x, value, config):
    """Interior padding by index arithmetic, then low/high (negative ones crop)."""
    for d, (lo, hi, interior) in enumerate(config):
        n = x.shape[d]
        size = n + max(n - 1, 0) * interior
        grown = np.full(x.shape[:d] + (size,) + x.shape[d + 1:], value, x.dtype)
        grown[(slice(None),) * d + (slice(None, None, interior + 1),)] = x
        before = np.full(x.shape[:d] + (max(lo, 0),) + x.shape[d + 1:], value, x.dtype)
        after = np.full(x.shape[:d] + (max(hi, 0),) + x.shape[d + 1:], value, x.dtype)
        x = np.concatenate([before, grown, after], axis=d)
        x = x[(slice(None),) * d + (slice(max(-lo, 0), x.shape[d] - max(-hi, 0)),)]
    return x


def _np_broadcasted_iota(dtype, shape, dimension):
    index = np.arange(shape[dimension]).reshape([-1 if d == dimension else 1 for d in range(len(shape))])
    return np.broadcast_to(index, shape).astype(dtype)


def _np_slice_in_dim(x, start, limit, stride=1, axis=0):
    return x[(slice(None),) * axis + (slice(start, limit, stride),)]


NUMPY_LAX = SimpleNamespace(dynamic_slice=_np_dynamic_slice, dynamic_update_slice=_np_dynamic_update_slice,
                            lax_pad=_np_lax_pad, broadcasted_iota=_np_broadcasted_iota,
                            slice_in_dim=_np_slice_in_dim)


def _lax(m):
    return m if hasattr(m, "dynamic_slice") else NUMPY_LAX


def _start(m, value):
    """A 0-d int64 start: a traced constant (not folded into a static slice)."""
    return m.asarray(np.int64(value))


def _data_start(m, x, value):
    """A 0-d int64 start computed from the data (so it is only known at run time)."""
    return (m.sum(x * 0.0) + value).astype("int64")


# ---------------------------------------------------------------- cases
A_, B_, AB = ("A", None), (None, "A"), ("A", "B")
CASES = [
    # static slices and basic indexing
    Case("shift_difference", lambda m, x: x[1:] - x[:-1], ((24, 8),), ((A_,), (B_,), (AB,))),
    # the result feeds a value split on the sliced dim: slices stay split (shift / reduce-scatter plans)
    Case("shift_into_split", lambda m, x, y: x[1:] - y * x[:-1], ((24, 8), (23, 8)),
         ((A_, A_), ((("A", "B"), None), (("A", "B"), None)))),
    Case("uneven_shift_into_split", lambda m, x, y, z: x[1:] - y + x[:-1] @ z, ((10, 7), (9, 7), (7, 7)),
         ((A_, A_, None), ((("A", "B"), None), (("A", "B"), None), None))),
    Case("uneven_pad_into_split", lambda m, x, y: _lax(m).lax_pad(x, 9.0, [(1, 0, 0), (0, 0, 0)]) * y,
         ((10, 7), (11, 7)), ((A_, A_), ((("A", "B"), None), (("A", "B"), None)))),
    Case("dynamic_slice_into_split",
         lambda m, x, y: _lax(m).dynamic_slice(x, [_start(m, 10), _start(m, 0)], (12, 24)) + y,
         ((24, 24), (12, 24)), ((A_, A_), (AB, AB))),
    Case("strided_slice_into_split", lambda m, x, y: x[1::2] * y, ((24, 24), (12, 24)), ((A_, A_), (AB, AB))),
    Case("strided_slice", lambda m, x: x[2:21:3, ::2] * 2.0, ((24, 24),), ((A_,), (B_,), (AB,), (("B", "A"),))),
    Case("negative_steps", lambda m, x: x[::-1, 19:1:-3] + 1.0, ((24, 24),), ((A_,), (B_,), (AB,))),
    Case("int_none_ellipsis", lambda m, x: x[3, None, ..., 2:9] * 1.0 + x[-1, None, :, 10:17],
         ((24, 6, 24),), (((None, None, "A"),), (("A", None, "B"),))),
    Case("slice_in_dim", lambda m, x: _lax(m).slice_in_dim(x, 4, 22, 2, axis=1) + 0.5, ((24, 24),),
         ((B_,), (AB,))),
    Case("slice_then_matmul", lambda m, x, w: x[:, 3:19] @ w[8:24], ((24, 24), (24, 24)),
         ((B_, A_), (AB, ("B", None)))),
    # pads
    Case("numpy_pad", lambda m, x: m.pad(x, ((1, 2), (3, 0)), constant_values=1.5), ((24, 24),),
         ((A_,), (B_,), (AB,))),
    Case("pad_shift_same_size", lambda m, x: _lax(m).lax_pad(x, -2.0, [(1, -1, 0), (-2, 2, 0)]), ((24, 24),),
         ((A_,), (B_,), (AB,))),
    Case("pad_interior", lambda m, x: _lax(m).lax_pad(x, -1.0, [(1, 2, 1), (-1, 1, 2)]), ((24, 12),),
         ((A_,), (AB,))),
    # concatenate, stack, reverse
    Case("concatenate_axis0", lambda m, x, y: m.concatenate([x, y * 2.0], axis=0), ((24, 8), (24, 8)),
         ((A_, A_), (B_, B_), (AB, None))),
    Case("concatenate_axis1", lambda m, x, y: m.concatenate([x, y, x], axis=1) + 1.0, ((24, 8), (24, 6)),
         ((A_, A_), (B_, None))),
    Case("stack", lambda m, x, y: m.stack([x, y], axis=1) * 3.0, ((24, 24), (24, 24)),
         ((A_, A_), (B_, AB))),
    Case("flip", lambda m, x: m.flip(x, 0) - m.flip(x), ((24, 24),),
         ((A_,), (B_,), (AB,), (("B", "A"),), ((("A", "B"), None),))),
    Case("flip_int", lambda m, x: m.flip(x, 1) * 2 + x, ((24, 24),), ((B_,), (AB,)), dtype="int64"),
    # iota / arange
    Case("arange_float", lambda m, x: x + m.arange(0.5, 12.5, 0.5), ((24, 24),), ((B_,), (AB,))),
    Case("arange_int", lambda m, x: x * m.arange(24).reshape(24, 1) - m.arange(3, 75, 3),
         ((24, 24),), ((A_,), (AB,)), dtype="int64"),
    Case("broadcasted_iota", lambda m, x: x + _lax(m).broadcasted_iota("float64", (24, 24), 0) * 2.0,
         ((24, 24),), ((A_,), (AB,))),
    # dynamic slices and updates (clamped starts)
    Case("dynamic_slice_window", lambda m, x: _lax(m).dynamic_slice(x, [_start(m, 5), _start(m, 2)], (4, 20)),
         ((24, 24),), ((A_,), (B_,), (AB,))),
    Case("dynamic_slice_clamped",
         lambda m, x: _lax(m).dynamic_slice(x, [_start(m, 100), _start(m, -7)], (6, 24)) * 1.0,
         ((24, 24),), ((A_,), (AB,))),
    Case("dynamic_slice_data_start", lambda m, x: _lax(m).dynamic_slice(x, [_data_start(m, x, 9), 0], (16, 24)),
         ((24, 24),), ((A_,), (AB,))),
    Case("dynamic_slice_int", lambda m, x: _lax(m).dynamic_slice(x, [_start(m, 17), _start(m, 0)], (3, 24)),
         ((24, 24),), ((A_,),), dtype="int64"),
    Case("dynamic_update_slice", lambda m, x, u: _lax(m).dynamic_update_slice(x, u * 2.0, [_start(m, 7),
                                                                                        _start(m, 3)]),
         ((24, 24), (5, 24)), ((A_, None), (AB, None), (B_, A_))),
    Case("dynamic_update_slice_clamped",
         lambda m, x, u: _lax(m).dynamic_update_slice(x, u, [_start(m, 30), _start(m, -4)]),
         ((24, 24), (6, 6)), ((A_, None), (AB, AB))),
    # uneven sizes (10, 7, 5 over up to 8 shards)
    Case("uneven_shift", lambda m, x: x[1:] * 2.0 - x[:-1], ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("uneven_flip", lambda m, x: m.flip(x, (0, 1)) + x, ((10, 7),), ((A_,), (B_,), (AB,), ((("B", "A"), None),))),
    Case("uneven_negative_step", lambda m, x: x[8::-3, ::-1] * 1.0, ((10, 7),), ((A_,), (B_,))),
    Case("uneven_pad", lambda m, x: _lax(m).lax_pad(x, 0.25, [(2, -1, 0), (1, 1, 1)]), ((10, 7),),
         ((A_,), (B_,), (AB,))),
    Case("uneven_concatenate", lambda m, x, y: m.concatenate([x, y], axis=0) + 1.0, ((10, 7), (5, 7)),
         ((A_, A_), (B_, B_))),
    Case("uneven_arange", lambda m, x: x - m.arange(7.0) + m.arange(10).reshape(10, 1), ((10, 7),),
         ((A_,), (B_,), (AB,))),
    Case("uneven_dynamic_slice", lambda m, x: _lax(m).dynamic_slice(x, [_start(m, 6), _start(m, 1)], (3, 5)),
         ((10, 7),), ((A_,), (B_,), (AB,))),
    Case("uneven_dynamic_update_slice",
         lambda m, x, u: _lax(m).dynamic_update_slice(x, u, [_start(m, 8), _start(m, 4)]),
         ((10, 7), (3, 2)), ((A_, None), (B_, None), (AB, None))),
    Case("uneven_bool_slice", lambda m, x: m.flip(x > 0, 0)[2:9].astype("int64"), ((10, 7),), ((A_,), (AB,))),
]
