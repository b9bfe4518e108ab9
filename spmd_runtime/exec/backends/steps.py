"""A fusion instruction decoded for the backends that generate its kernel (``exec/backends/``): its steps,
typed literals, operand views and result, the position of each ref among the run-time values, and the scratch
buffers a chain's intermediates live in."""
from __future__ import annotations

import numpy as np

from ...partition.fusion import parse_code


class Scratch:
    """Buffers for a fusion's intermediate steps, by (shape, dtype, index): fusions run one at a time."""

    def __init__(self, xp):
        self.xp, self._held = xp, {}

    def get(self, shape, dtype, index: int):
        key = (shape, dtype, index)
        if key not in self._held:
            self._held[key] = self.xp.empty(shape, dtype)
        return self._held[key]


class Fusion:
    """A decoded fusion: steps, typed literals, operand views, result shape/dtype, in-place operand."""

    def __init__(self, ins):
        self.steps = parse_code(ins.attrs["code"])
        self.consts = [np.dtype(d).type(v) for v, d in ins.attrs["consts"]]
        self.const_dtypes = [str(np.dtype(d)) for _, d in ins.attrs["consts"]]
        self.dtypes = [str(np.dtype(d)) for d in ins.attrs["dtypes"]]
        self.shapes = [tuple(s) for s in ins.attrs["shapes"]]
        self.shape, self.dtype, self.donate = tuple(ins.shape), np.dtype(ins.dtype), ins.donate

    def views(self, args):
        """The operands reshaped for broadcasting (a view; only where the shapes differ)."""
        return [a if a.shape == s else a.reshape(s) for a, s in zip(args, self.shapes)]

    def param_dtypes(self, operand_dtypes):
        return [str(np.dtype(d)) for d in operand_dtypes]


class RefIndex(dict):
    """Position of each ref in the run-time value list [params..., consts..., temps...]."""

    def __init__(self, n_params, n_consts):
        super().__init__()
        self.n_params, self.n_consts = n_params, n_consts

    def __missing__(self, ref):
        base = {"p": 0, "c": self.n_params, "t": self.n_params + self.n_consts}[ref[0]]
        return base + int(ref[1:])


def result_of(interp, slot: int) -> tuple:
    """(shape, dtype) of the instruction at ``slot`` of the interpreter's program."""
    ins = interp.program.instrs[slot]
    return tuple(ins.shape), np.dtype(ins.dtype)
