"""The planner's memory model counts a view once (``live_buffers.py``, ``layouts.py``): a result the executor
returns as a view of its operand (transpose, broadcast, flip, a reshape NumPy does without a copy) takes no
bytes of its own and keeps its operand's buffer alive; a reshape that must copy, and a slice (the kernels copy),
count as new. Each case is checked three ways: the model's bytes, the executor's bytes (tracemalloc), and
NumPy's own answer for the layout rule."""
import tracemalloc

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.buffers import PLAN_ENV
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.layouts import c_strides, can_view

N = 256
X = N * N * 8  # bytes of the float64 [N, N] input
SPEC = sr.TensorSpec((N, N), "float64")
SLACK = 80 * 2 ** 10  # NumPy's ufunc buffer for a strided operand (8192 elements) and a few Python objects

# (name, op on the input, the bytes it takes beyond the input and the 8-byte sum)
CASES = [
    ("reshape of a C-ordered input", lambda x: snp.reshape(x, (N // 2, 2 * N)), 0),
    ("transpose", lambda x: snp.transpose(x), 0),
    ("flip", lambda x: snp.flip(x, axis=0), 0),
    # the copied row, and the product (not fused with a broadcast operand): no [4, N, N] broadcast buffer
    ("broadcast of a row", lambda x: snp.broadcast_to(x[0], (4, N, N)), N * 8 + 4 * X),
    ("reshape splitting a transposed dim", lambda x: snp.reshape(snp.transpose(x), (N, 2, N // 2)), 0),
    ("reshape merging transposed dims", lambda x: snp.reshape(snp.transpose(x), (N * N,)), X),  # copies
    ("slice", lambda x: x[: N // 2], X // 2),  # the kernel copies
]


def consumed(op):
    """``op``'s result doubled and summed (one fused reduction where it can): the program's peak is the input,
    ``op``'s buffers and the 8-byte sum."""
    return lambda x: snp.sum(op(x) * 2.0)


def program_of(op):
    return sr.partition(sr.trace(consumed(op), SPEC), sr.Mesh((1,), ("x",)))


def executor_bytes(program, x, warm=True):
    """Bytes the interpreter allocates in a second run (``warm``; else its first), with no planned buffers
    (every result a new array)."""
    def body(mc):
        with pytest.MonkeyPatch.context() as env:
            env.setenv(PLAN_ENV, "0")
            interp = Interpreter(program, mc, np)
        if warm:
            interp.run([x])
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        interp.run([x])
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        return peak
    return run_simulated(1, body)[0]


@pytest.mark.parametrize("name,op,want", CASES, ids=[c[0] for c in CASES])
def test_a_view_is_counted_once_and_a_copy_as_new(name, op, want):
    assert program_of(op).peak_bytes() - X - 8 == want  # the old model counted each view as X bytes more


@pytest.mark.parametrize("name,op,want", CASES, ids=[c[0] for c in CASES])
def test_the_executor_allocates_what_the_model_counts(name, op, want):
    program = program_of(op)
    x = np.random.default_rng(0).standard_normal((N, N))
    planned = program.peak_bytes() - X  # beyond the caller's input
    held = executor_bytes(program, x)
    assert abs(held - planned) <= SLACK, (held, planned)
    np.testing.assert_allclose(sr.run(program, x)[0], sr.evaluate(sr.trace(consumed(op), SPEC), x)[0])


def test_a_view_that_outlives_its_operand_keeps_its_buffer():
    """``tanh(x).T[::-1]``: tanh's value dies at the transpose, the flipped transpose holds its buffer to the
    sum (the old model: the input and three [N, N] results at the flip)."""
    program = program_of(lambda x: snp.tanh(x).T[::-1])
    assert program.peak_bytes() == X + X + 8  # the input, tanh's buffer once, the sum
    found = program.peak_breakdown()
    assert sum(b.nbytes for b in found) == program.peak_bytes()
    assert [b.what for b in found if b.nbytes == X and not b.what.startswith("input")] == ["%1 tanh"]
    x = np.random.default_rng(0).standard_normal((N, N))
    assert abs(executor_bytes(program, x) - X - 8) <= SLACK


@pytest.mark.parametrize("shape,perm,new", [((4, 6), (1, 0), (24,)), ((4, 6), (1, 0), (2, 3, 4)),
                                            ((2, 3, 4), (0, 2, 1), (8, 3)), ((2, 3, 4), (0, 2, 1), (2, 12)),
                                            ((2, 1, 4), (2, 1, 0), (4, 2)), ((3, 4), (0, 1), (2, 1, 6)),
                                            ((5, 1, 3), (1, 0, 2), (15,))])
def test_can_view_is_numpys_rule(shape, perm, new):
    a = np.empty(shape).transpose(perm)
    strides = can_view(a.shape, tuple(s // 8 for s in a.strides), new)
    try:
        b = a.reshape(new, copy=False)
    except ValueError:
        assert strides is None
    else:
        assert strides == tuple(s // 8 for s in b.strides) or b.size <= 1
    assert can_view(shape, c_strides(shape), new) is not None  # C-ordered: always a view


def zero_ring_then_filled(xs):
    """A scan writing each step's row into a carried ring that starts as zeros (a broadcast of a scalar: a
    view, no buffer): the loop fills a copy of its own (exec/loops.py), which the model counts instead."""
    def body(ring, x_i):
        row, i = x_i
        return snp.dynamic_update_slice(ring, snp.expand_dims(snp.tanh(row), 0), [i, 0]), snp.sum(row)
    return snp.sum(sr.scan(body, snp.zeros((N, N), "float64"), (xs, snp.arange(N)))[0])


def test_a_loop_counts_its_copy_of_a_carry_it_writes():
    graph = sr.trace(zero_ring_then_filled, SPEC)
    program = sr.partition(graph, sr.Mesh((1,), ("x",)))
    (scan,) = [i for i in program.instrs if i.op == "scan"]
    assert 0 in scan.attrs["body"].written_inputs and 0 not in scan.attrs.get("adopt", ())
    planned = program.peak_bytes() - X
    assert X <= planned <= X + 4 * N * 8  # the loop's ring, once, and a few rows
    x = np.random.default_rng(0).standard_normal((N, N))
    held = executor_bytes(program, x, warm=False)  # the loop's ring is made in the first run, then kept
    assert abs(held - planned) <= SLACK, (held, planned)
    np.testing.assert_allclose(sr.run(program, x)[0], sr.evaluate(graph, x)[0])
