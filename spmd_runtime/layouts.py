"""Which results the executor's kernels return as views of their operand, and the strides of those views: the
alias rules of the planner's memory model (``live_buffers.py``).

A view takes no memory of its own; it keeps its operand's buffer alive. The kernels (``ops/core.py``,
``ops/slicing.py``) decide: ``transpose``, ``broadcast_in_dim`` (``broadcast_to``), ``reverse`` (``flip``) and the
identities (``stop_gradient``, ``mesh_split``) always return views; ``reshape`` returns one exactly when NumPy can
reshape without a copy (``can_view``, from the operand's strides); ``slice`` and ``dynamic_slice`` copy (a view
would keep the whole unsliced buffer alive). Strides are counted in elements; None where the layout is not known
(an einsum's result may be a transposed view of its own buffer, a ufunc's follows its operands' order): a
reshape of such a value is counted as a copy, so the model may over-count there. One assumption can under-count:
a program's inputs are taken as C-ordered, a loop body's too (its slice of a stacked xs, its carries), since a
body's peak is counted on its own; a loop over a non-C-ordered stack whose body merges dims by a reshape copies
where the model counts a view.
"""
from __future__ import annotations

from .graph import MESH_SPLIT, PARAMETER
from .opdef import lookup
from .ops.core import BROADCAST_IN_DIM, CONVERT, RESHAPE, STOP_GRADIENT, TRANSPOSE
from .ops.slicing import CONCATENATE, DYNAMIC_SLICE, REVERSE, SLICE

COPIED = "copied"  # a view rule's answer when the kernel copies after all


def c_strides(shape) -> tuple:
    """The element strides of a C-ordered array of ``shape``."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def is_c_ordered(shape, strides) -> bool:
    """Whether ``strides`` lay ``shape`` out C-ordered (strides of dims of size 1 do not matter, as in NumPy)."""
    return strides is not None and all(s == c for n, s, c in zip(shape, strides, c_strides(shape)) if n != 1)


def can_view(shape, strides, new_shape):
    """The strides of ``x.reshape(new_shape)`` when NumPy returns a view of ``x`` (``shape``, ``strides``),
    else None. NumPy's ``_attempt_nocopy_reshape`` (numpy/core/src/multiarray/shape.c), C order: runs of old
    dims whose product matches a run of new dims must be contiguous among themselves."""
    if 0 in tuple(shape):
        return c_strides(new_shape)
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]  # size-1 dims carry no layout
    new, out = list(new_shape), [0] * len(new_shape)
    oi = ni = 0
    while ni < len(new) and oi < len(old):
        oj, nj, op, np_ = oi + 1, ni + 1, old[oi][0], new[ni]
        while np_ != op:
            if np_ < op:
                np_, nj = np_ * new[nj], nj + 1
            else:
                op, oj = op * old[oj][0], oj + 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None  # these old dims are not contiguous enough to merge
        out[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            out[k - 1] = out[k] * new[k]
        ni, oi = nj, oj
    last = out[ni - 1] if ni >= 1 else 1
    for k in range(ni, len(new)):  # trailing 1s of the new shape
        out[k] = last
    return tuple(out)


def _reshaped(ins, shape, strides):
    view = None if strides is None else can_view(shape, strides, ins.shape)
    return COPIED if view is None else view


def _transposed(ins, shape, strides):
    return None if strides is None else tuple(strides[p] for p in ins.attrs["perm"])


def _broadcast(ins, shape, strides):
    """``broadcast_to(x.reshape(expanded))``: the operand's strides on its dims, 0 on the new ones (and on a
    size-1 dim stretched)."""
    if strides is None and ins.attrs["dims"]:
        return None
    out = [0] * len(ins.shape)
    for i, d in enumerate(ins.attrs["dims"]):
        out[d] = strides[i] if shape[i] == ins.shape[d] else 0
    return tuple(out)


def _flipped(ins, shape, strides):
    return None if strides is None else tuple(-s if d in ins.attrs["axes"] else s for d, s in enumerate(strides))


def _same(ins, shape, strides):
    return strides


# op -> fn(instr, operand local shape, operand strides or None) -> the result's strides (None: not known) when
# the kernel returns a view of operand 0, COPIED when it copies
VIEWS = {RESHAPE.name: _reshaped, TRANSPOSE.name: _transposed, BROADCAST_IN_DIM.name: _broadcast,
         REVERSE.name: _flipped, STOP_GRADIENT.name: _same, MESH_SPLIT.name: _same}
C_ORDERED = frozenset(op.name for op in (PARAMETER, SLICE, DYNAMIC_SLICE, CONCATENATE))  # made by a .copy() or
# np.concatenate (inputs: the caller's shards and a loop's slices of them, assumed C-ordered)


def view_of(ins, shape, strides):
    """The strides of ``ins``'s result when its kernel returns a view of its operand 0 (None: not known), or
    COPIED: a buffer of its own."""
    rule = VIEWS.get(ins.op)
    return COPIED if rule is None else rule(ins, shape, strides)


def new_strides(ins, operands) -> tuple | None:
    """The strides of a result in a buffer of its own (None: not known): C-ordered for the copying ops; an
    elementwise op's or a convert's (a ufunc and ``astype`` write in their operands' order) where every operand
    is C-ordered or a scalar.
    ``operands``: (local shape, strides) of each operand."""
    if ins.op in C_ORDERED:
        return c_strides(ins.shape)
    follows_operands = lookup(ins.op).ufunc or ins.op == CONVERT.name
    c_ordered = lambda shape, strides: not shape or (tuple(shape) == tuple(ins.shape) and is_c_ordered(shape, strides))
    if follows_operands and all(c_ordered(shape, strides) for shape, strides in operands):
        return c_strides(ins.shape)
    return None
