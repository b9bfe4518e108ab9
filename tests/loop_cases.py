"""Loop cases (scan, fori_loop, while_loop, cond, remat, nested and pytree carries) shared by the simulated
and the MPI tests: each builds, for a mesh, a traced function (values and, where differentiable, gradients)
and its arguments; the partitioned run must match the reference evaluator."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp


@dataclass(frozen=True)
class LoopCase:
    name: str
    build: Callable  # mesh -> (fn, args)


def _axes(mesh):
    """(first axis, second axis or None): the carry splits on the first, weights on the second."""
    names = mesh.axis_names
    return names[0], (names[1] if len(names) > 1 else None)


def with_grads(loss, argnums):
    """(value, *grads) of ``loss``, keeping its parameter names."""
    def f(*args):
        value, grads = sr.value_and_grad(loss, argnums)(*args)
        return (value, *grads)
    f.__signature__ = inspect.signature(loss)
    return f


def _rng(seed):
    return np.random.default_rng(seed)


def rnn(mesh):
    """Carry split over rows (5 rows: uneven on 2, 3, 4, 8), stacked weights split on their last dim."""
    a, b = _axes(mesh)

    def loss(h, ws, bias):
        h = sr.mesh_split(h, mesh, (a, None))
        ws = sr.mesh_split(ws, mesh, (None, None, b))

        def body(c, w):
            c = snp.tanh(c @ w + bias)
            return c, snp.sum(c, axis=1)
        c, ys = sr.scan(body, h, ws)
        return snp.sum(c * c) + snp.sum(ys * ys)
    r = _rng(0)
    return with_grads(loss, (0, 1, 2)), [r.standard_normal((5, 6)), 0.5 * r.standard_normal((3, 6, 6)),
                                         r.standard_normal(6)]


def replicated_carry(mesh):
    """A replicated scalar carry accumulating over xs split on its non-scanned dim; reverse scan."""
    a, _ = _axes(mesh)

    def loss(xs, w):
        xs = sr.mesh_split(xs, mesh, (None, a))

        def body(c, x):
            c = c * 0.5 + snp.sum(snp.tanh(x * w))
            return c, x * c
        c, ys = sr.scan(body, snp.zeros((), "float64"), xs, reverse=True)
        return c + snp.sum(ys)
    r = _rng(1)
    return with_grads(loss, (0, 1)), [r.standard_normal((4, 7)), r.standard_normal(7)]


def fori_constrained(mesh):
    """fori_loop whose body pins the carry with mesh_split (the init is not annotated)."""
    a, b = _axes(mesh)

    def loss(x, w):
        def body(i, c):
            c = sr.mesh_split(c, mesh, (a, b))
            return snp.tanh(c @ w) + snp.astype(i, "float64") * 0.1
        return snp.sum(sr.fori_loop(0, 3, body, x) ** 2.0)
    r = _rng(2)
    return with_grads(loss, (0, 1)), [r.standard_normal((6, 5)), 0.4 * r.standard_normal((5, 5))]


def while_count(mesh):
    """while_loop with a traced bound: doubles a split array until its sum passes a limit."""
    a, _ = _axes(mesh)

    def f(x, limit):
        x = sr.mesh_split(x, mesh, (a, None))
        out, n = sr.while_loop(lambda c: snp.sum(c[0]) < limit, lambda c: (c[0] * 2.0 + 1.0, c[1] + 1),
                               (x, snp.asarray(np.int32(0))))
        return out, n
    return f, [np.abs(_rng(3).standard_normal((5, 3))), np.float64(200.0)]


def cond_both(mesh):
    """cond with a traced predicate, once true once false, differentiated through both branches."""
    a, b = _axes(mesh)

    def loss(x, w, sign):
        x = sr.mesh_split(x, mesh, (a, None))
        w = sr.mesh_split(w, mesh, (None, b))
        y = sr.cond(snp.sum(x) * sign > 0, lambda u: snp.tanh(u @ w), lambda u: u * snp.sum(w, axis=0), x)
        return snp.sum(y * y)
    r = _rng(4)
    x = r.standard_normal((5, 4))
    return with_grads(loss, (0, 1)), [x, r.standard_normal((4, 4)), np.float64(np.sign(x.sum()))]


def remat_policies(mesh):
    """The same scan under each remat policy: equal gradients."""
    a, b = _axes(mesh)

    def loss(h, ws):
        h = sr.mesh_split(h, mesh, (a, b))
        total = 0.0
        for policy in ("nothing_saveable", "dots_saveable", "cheap_recomputed", "everything_saveable"):
            body = sr.remat(lambda c, w: (snp.tanh(c @ w) * 0.9 + c, None), policy)
            c, _ = sr.scan(body, h, ws)
            total = total + snp.sum(c * c)
        return total
    r = _rng(5)
    return with_grads(loss, (0, 1)), [r.standard_normal((5, 4)), 0.3 * r.standard_normal((3, 4, 4))]


def nested_pytree(mesh):
    """A scan inside a scan, carries a dict and a tuple, a closed-over weight of the outer function."""
    a, b = _axes(mesh)

    def loss(x, ws, v):
        x = sr.mesh_split(x, mesh, (a, None))

        def outer(carry, w):
            def inner(c, _):
                return {"h": snp.tanh(c["h"] @ w), "s": c["s"] + snp.sum(c["h"] * v)}, None
            c, _ = sr.scan(inner, carry, length=2)
            return c, c["s"]
        c, ss = sr.scan(outer, {"h": x, "s": snp.zeros((), "float64")}, ws)
        return snp.sum(c["h"]) + c["s"] + snp.sum(ss)
    r = _rng(6)
    return with_grads(loss, (0, 1, 2)), [r.standard_normal((6, 4)), 0.5 * r.standard_normal((2, 4, 4)),
                                         r.standard_normal(4)]


CASES = [LoopCase(f.__name__, f) for f in (rnn, replicated_carry, fori_constrained, while_count, cond_both,
                                            remat_policies, nested_pytree)]


def build_case(case: LoopCase, mesh):
    """(graph, program, args, expected outputs from the reference evaluator)."""
    fn, args = case.build(mesh)
    graph = sr.trace(fn, *args)
    program = sr.partition(graph, mesh)
    return graph, program, args, sr.evaluate(graph, *args)
