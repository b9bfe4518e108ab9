"""The planner's model of the buffers the executor holds while a program runs (``SPMDProgram.peak_bytes``).

A value is a buffer of its own, its dying operand's buffer written in place (``Instr.donate``), or a view of its
operand's buffer (``layouts.py``: what the kernels return as views). A buffer is live while any value that is it or
views it is, and freed when the last of them dies, as NumPy frees a base with its last view: a reshape of a
layer's slice takes no second buffer, and a transpose that outlives its operand keeps the operand's bytes.
The caller's inputs are held for the whole run unless donated (then the program frees them where they die).
"""
from __future__ import annotations

from .layouts import COPIED, c_strides, new_strides, view_of


class LiveBuffers:
    def __init__(self, program):
        shapes = [i.sharding.local_shape(i.shape, program.mesh) for i in program.inputs]
        sizes = dict(zip((i.slot for i in program.inputs), program.input_bytes()))
        donated = {program.inputs[k].slot for k in program.donated}
        self.held = sum(sizes.values())  # bytes live from the start: every input
        self.base = {s: s for s in sizes}  # live value -> the buffer (the slot that made it) it is or views
        self.strides = {i.slot: c_strides(s) for i, s in zip(program.inputs, shapes)}
        self.size = {s: n for s, n in sizes.items() if s in donated}  # live buffers the program frees: bytes
        self.users = {s: 1 for s in self.size}  # live values on each of those
        self.shapes = {ins.out: ins.shape for ins in program.instrs}
        self.shapes.update({i.slot: tuple(s) for i, s in zip(program.inputs, shapes)})

    def add(self, ins) -> int:
        """Take ``ins``'s result; the bytes of the buffer it needs beyond those live (0: in place, or a view)."""
        if ins.donate >= 0 and self.base.get(ins.args[ins.donate]) in self.size:
            return self._alias(ins, ins.args[ins.donate], self.strides[ins.args[ins.donate]])
        if ins.args:
            operand = ins.args[0]
            view = view_of(ins, self.shapes[operand], self.strides.get(operand))
            if view is not COPIED:
                return self._alias(ins, operand, view)
        self.base[ins.out], self.size[ins.out], self.users[ins.out] = ins.out, ins.nbytes, 1
        self.strides[ins.out] = new_strides(ins, [(self.shapes[a], self.strides.get(a)) for a in ins.args])
        return ins.nbytes

    def _alias(self, ins, operand: int, strides) -> int:
        buffer = self.base[ins.out] = self.base[operand]
        if buffer in self.users:
            self.users[buffer] += 1
        self.strides[ins.out] = strides
        return 0

    def free(self, slots) -> int:
        """Drop the values of ``slots``; the bytes of the buffers that no live value holds any more."""
        released = 0
        for s in slots:
            buffer = self.base.pop(s, None)
            self.strides.pop(s, None)
            if buffer in self.users:
                self.users[buffer] -= 1
                if not self.users[buffer]:
                    del self.users[buffer]
                    released += self.size.pop(buffer)
        return released

    def buffer_of(self, slot: int) -> int:
        return self.base[slot]
