"""shard_map cases shared by the simulated (tests/unit/test_shard_map.py) and MPI (tests/mpi/test_shard_map_mpi.py)
tests. Each case is a manual region and the same computation written for the automatic partitioner
(plain ``snp``, the region's in_specs as partition in_specs): the two must agree, values and gradients.
Shapes are built from the mesh so every split is even; the collectives run over axis "x" (mentioned in
the specs) while a second mesh axis "y", when there is one, is manual but unmentioned (each shard along it
holds the whole), except in the partially manual cases, where "y" stays automatic."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import P


@dataclass(frozen=True)
class Case:
    name: str
    region: Callable  # (mesh) -> fn(*args) with a shard_map inside
    auto: Callable  # fn(*args), the same with the automatic partitioner
    shapes: Callable  # (kx, ky) -> argument shapes
    in_specs: tuple  # partition in_specs of both versions
    out_spec: object
    two_d: bool = False  # needs a 2-d mesh ("y" automatic)


def _kx(mesh):
    return mesh.axis_size("x")


def _psum_matmul(mesh):
    return sr.shard_map(lambda a, b: sr.psum(a @ b, "x"), mesh, in_specs=(P(None, "x"), P("x")), out_specs=P())


def _reduce_scatter_matmul(mesh):
    """The hand-written reduce-scatter matmul: contraction split over x, result rows scattered over x."""
    def local(a, b):
        return sr.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True)
    return sr.shard_map(local, mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"))


def _all_gather(mesh):
    def local(x):
        whole = sr.all_gather(x, "x", axis=0, tiled=True)
        stacked = sr.all_gather(x, "x", axis=0)  # tiled=False: a new leading dim
        return snp.tanh(whole) + snp.sum(stacked, axis=0)[0:1, :] * 0 + 1.0
    return sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P())


def _all_to_all(mesh):
    return sr.shard_map(lambda x: sr.all_to_all(x * 2.0, "x", 1, 0), mesh, in_specs=P("x"),
                        out_specs=P(None, "x"))


def _shift(mesh):
    k = _kx(mesh)

    def local(x):
        return sr.ppermute(x, "x", [(i, (i + 1) % k) for i in range(k)]) * snp.exp(x)
    return sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P("x"))


def _shift_auto(x):
    n = x.shape[0]
    cut = n - n // _CURRENT["kx"]  # the last block moves to the front
    rolled = snp.concatenate([x[cut:], x[:cut]], axis=0) if cut else x
    return rolled * snp.exp(x)


def _axis_index(mesh):
    def local(x):
        return x * (sr.axis_index("x") + 1).astype(x.dtype)
    return sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P("x"))


def _axis_index_auto(x):
    k = _CURRENT["kx"]
    scale = np.repeat(np.arange(1, k + 1, dtype=np.float64), x.shape[0] // k)[:, None]
    return x * snp.asarray(scale)


def _pmax(mesh):
    def local(x):
        return snp.exp(x - sr.pmax(snp.max(x, axis=0, keepdims=True), "x"))
    return sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P("x"))


def _softmax_rows(s):
    m = snp.max(s, axis=-1, keepdims=True)
    e = snp.exp(s - m)
    return e / snp.sum(e, axis=-1, keepdims=True)


def ring_attention(mesh, axis="x"):
    """Attention with the sequence split over ``axis``: each shard keeps its queries and passes its key/value
    block around the ring with ppermute, folding each visiting block in with an online softmax."""
    k = mesh.axis_size(axis)
    ring = [(i, (i + 1) % k) for i in range(k)]

    def local(q, kb, vb):
        s = q @ kb.T
        m = snp.max(s, axis=-1, keepdims=True)
        p = snp.exp(s - m)
        l, o = snp.sum(p, axis=-1, keepdims=True), p @ vb
        for _ in range(k - 1):
            kb, vb = sr.ppermute(kb, axis, ring), sr.ppermute(vb, axis, ring)
            s = q @ kb.T
            m_new = snp.maximum(m, snp.max(s, axis=-1, keepdims=True))
            p, correction = snp.exp(s - m_new), snp.exp(m - m_new)
            l = l * correction + snp.sum(p, axis=-1, keepdims=True)
            o = o * correction + p @ vb
            m = m_new
        return o / l
    return sr.shard_map(local, mesh, in_specs=(P(axis), P(axis), P(axis)), out_specs=P(axis))


def attention(q, k, v):
    return _softmax_rows(q @ k.T) @ v


def _pytree(mesh):
    def local(d):
        return {"sum": sr.psum(d["a"] * d["b"], "x"), "a": d["a"] + 1.0}
    return sr.shard_map(local, mesh, in_specs=({"a": P("x"), "b": P("x")},), out_specs={"sum": P(), "a": P("x")})


def _pytree_region(mesh):
    f = _pytree(mesh)
    return lambda a, b: (lambda out: (out["sum"], out["a"]))(f({"a": a, "b": b}))


def _pytree_auto(a, b):
    k = _CURRENT["kx"]
    prod = a * b
    return snp.sum(snp.reshape(prod, (k, a.shape[0] // k) + a.shape[1:]), axis=0), a + 1.0


def _closure(mesh):
    """The body closes over ``b``, a value of the enclosing trace: whole on every shard, its cotangent summed."""
    def f(a, b):
        local = lambda x: sr.psum(snp.sum(x * b, axis=0, keepdims=True), "x")
        return sr.shard_map(local, mesh, in_specs=P("x"), out_specs=P())(a)
    return f


def _batch_on_y(mesh):
    """Partially manual: the batch dim stays automatic over y, the feature dim is manual over x."""
    region = sr.shard_map(lambda x, w: sr.psum(x @ w, "x"), mesh, in_specs=(P(None, "x"), P("x")), out_specs=P(),
                          axis_names=("x",))
    return lambda x, w: region(sr.mesh_split(x, mesh, P("y", sr.UNCONSTRAINED)), w)


def _contract_on_y(mesh):
    """Partially manual: rows manual over x; the contraction dim split over the automatic y, which the
    partitioner handles inside the body (partial sums over y reduced there)."""
    region = sr.shard_map(lambda a, w: snp.tanh(a @ w), mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                          axis_names=("x",))
    return lambda a, w: region(sr.mesh_split(a, mesh, P("x", "y")), sr.mesh_split(w, mesh, P("y")))


def _batch_on_y_auto(x, w):
    return x @ w


_CURRENT = {"kx": 1}  # the automatic versions that need the shard count read it here (set by build)

CASES = [
    Case("psum_matmul", _psum_matmul, lambda a, b: a @ b, lambda kx, ky: [(6, 4 * kx), (4 * kx, 5)],
         (P(None, "x"), P("x")), P()),
    Case("reduce_scatter_matmul", _reduce_scatter_matmul, lambda a, b: a @ b,
         lambda kx, ky: [(2 * kx, 3 * kx), (3 * kx, 4)], (P(None, "x"), P("x")), P("x")),
    Case("all_gather", _all_gather, lambda x: snp.tanh(x) + 1.0, lambda kx, ky: [(2 * kx, 3)], (P("x"),), P()),
    Case("all_to_all", _all_to_all, lambda x: x * 2.0, lambda kx, ky: [(2 * kx, 3 * kx)], (P("x"),), P(None, "x")),
    Case("ppermute_shift", _shift, _shift_auto, lambda kx, ky: [(2 * kx, 3)], (P("x"),), P("x")),
    Case("axis_index", _axis_index, _axis_index_auto, lambda kx, ky: [(2 * kx, 3)], (P("x"),), P("x")),
    Case("pmax_softmax_numerator", _pmax, lambda x: snp.exp(x - snp.max(x, axis=0, keepdims=True)),
         lambda kx, ky: [(3 * kx, 4)], (P("x"),), P("x")),
    Case("ring_attention", ring_attention, attention, lambda kx, ky: [(2 * kx, 4)] * 3, (P("x"),) * 3, P("x")),
    Case("pytree", _pytree_region, _pytree_auto, lambda kx, ky: [(2 * kx, 3)] * 2, (P("x"), P("x")), None),
    Case("closure", _closure, lambda a, b: snp.sum(a * b, axis=0, keepdims=True), lambda kx, ky: [(2 * kx, 3), (3,)],
         (P("x"), P()), P()),
    Case("partial_manual_batch_on_y", _batch_on_y, _batch_on_y_auto, lambda kx, ky: [(4 * ky, 2 * kx), (2 * kx, 3)],
         (P("y", "x"), P("x")), P("y"), two_d=True),
    Case("partial_manual_contract_on_y", _contract_on_y, lambda a, w: snp.tanh(a @ w),
         lambda kx, ky: [(2 * kx, 3 * ky), (3 * ky, 5)], (P("x", "y"), P("y")), P("x"), two_d=True),
]


def args_for(case: Case, mesh, seed=0):
    rng = np.random.default_rng(seed)
    ky = mesh.axis_size("y") if "y" in mesh.axis_names else 1
    return [rng.standard_normal(s) for s in case.shapes(_kx(mesh), ky)]


def build(case: Case, mesh, grad=False):
    """(region graph, automatic graph, args): the value, or with ``grad`` the gradient of sum(value * w)
    with respect to every argument, for a fixed random ``w`` per output."""
    _CURRENT["kx"] = _kx(mesh)
    args = args_for(case, mesh)
    region, auto = case.region(mesh), case.auto
    if grad:
        region, auto = _weighted_grad(region, args), _weighted_grad(auto, args)
    with mesh:
        return sr.trace(region, *args), sr.trace(auto, *args), args


def _weighted_grad(fn, args):
    def loss(*xs):
        ys = fn(*xs)
        ys = ys if isinstance(ys, tuple) else (ys,)
        rng = np.random.default_rng(1)
        return sum(snp.sum(y * snp.asarray(rng.standard_normal(y.shape))) for y in ys)
    return sr.grad(loss, tuple(range(len(args))))
