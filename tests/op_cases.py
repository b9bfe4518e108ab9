"""Table of op cases shared by the simulated and the MPI test suites.

Each case is a function written once against a NumPy-like module ``m``: run with
``m=spmd_runtime.numpy`` it is traced; with ``m=numpy`` it gives an independent
expectation that checks the reference evaluator itself. Specs use the symbolic
axes "A" (first mesh axis) and "B" (second mesh axis; replicated on a 1-d mesh),
resolved per mesh by ``resolve``. Sharded dims are 24 = lcm of 1, 2, 3, 4, 6, 8.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    fn: object  # fn(m, *args)
    shapes: tuple
    specs: tuple  # alternatives: each a tuple with one spec per argument (None = unannotated)
    dtype: str = "float64"
    positive: bool = False


def _softmax(m, x):
    e = m.exp(x - m.max(x, axis=-1, keepdims=True))
    return e / m.sum(e, axis=-1, keepdims=True)


def _attention(m, x, wq, wk, wv, wo):
    b, s, d = x.shape
    h = 12
    q = (x @ wq).reshape(b, s, h, d // h)
    k = (x @ wk).reshape(b, s, h, d // h)
    v = (x @ wv).reshape(b, s, h, d // h)
    scores = m.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(d // h))
    p = _softmax(m, scores)
    ctx = m.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d)
    return ctx @ wo


R2, A_, B_ = (None, None), ("A", None), (None, "A")
CASES = [
    Case("add", lambda m, x, y: x + y, ((24, 24), (24, 24)), (((A_, A_)), (("A", "B"), ("A", "B")), (A_, B_),
                                                              (("B", "A"), None))),
    Case("sub_mul_div", lambda m, x, y: (x - y) * y / (y + 3.0), ((24, 24), (24, 24)), ((A_, None), (B_, ("A", "B")))),
    Case("unary", lambda m, x: m.tanh(m.exp(-x)) + m.log(x) + m.sqrt(x) + m.abs(-x), ((24, 12),),
         ((A_,), (("A", "B"),)), positive=True),
    Case("max_min_pow", lambda m, x, y: m.maximum(x, y) - m.minimum(x, y) + x ** 2.0, ((24, 24), (24, 24)),
         ((A_, B_), (("A", "B"), None))),
    Case("where_compare", lambda m, x, y: m.where((x > y) & (x != 0.5), x, y) + (x <= y).astype("float64")
         + (x >= y) * 1.0 + (x < y) * 2.0 + (x == x) * 1.0, ((24, 24), (24, 24)), ((A_, B_), (("A", "B"), ("A", "B")))),
    Case("cast_f32", lambda m, x: (x.astype("float32") * 2.0).astype("float64"), ((24, 8),), ((A_,),)),
    Case("int_ops", lambda m, x, y: x * y + 3 - m.maximum(x, y), ((24, 24), (24, 24)),
         ((A_, B_),), dtype="int64"),
    Case("broadcast_row", lambda m, x, b: x + b, ((24, 24), (24,)), ((A_, ("A",)), (("A", "B"), None), (B_, ("A",)))),
    Case("broadcast_scalar_col", lambda m, x, c: x * c.reshape(24, 1) + 1.0,
         ((24, 24), (24,)), ((A_, None), (None, ("A",)))),
    Case("reshape_merge", lambda m, x: x.reshape(24 * 24) * 2.0, ((24, 24),), ((A_,), (B_,))),
    Case("reshape_split", lambda m, x: x.reshape(24, 4, 6).sum(axis=2), ((24, 24),), ((A_,), (B_,), (("A", "B"),))),
    Case("reshape_3d", lambda m, x: x.reshape(6, 4, 24).transpose(2, 0, 1).reshape(24, 24), ((24, 24),),
         ((A_,), (B_,))),
    Case("transpose", lambda m, x: x.T + 1.0, ((24, 24),), ((A_,), (("A", "B"),), (("B", "A"),))),
    Case("transpose3", lambda m, x: m.transpose(x, (2, 0, 1)) * 3.0, ((24, 4, 24),), ((("A", None, "B"),),)),
    Case("reduce_sum_axis", lambda m, x: m.sum(x, axis=1) + m.sum(x, axis=0), ((24, 24),),
         ((A_,), (B_,), (("A", "B"),), (("B", "A"),))),
    Case("reduce_max_min", lambda m, x: m.max(x, axis=0) - m.min(x, axis=(0,)), ((24, 24),), ((A_,), (("A", "B"),))),
    Case("reduce_all", lambda m, x: m.sum(x) + m.max(x) + m.mean(x), ((24, 24),), ((A_,), (("A", "B"),))),
    Case("mean_keepdims", lambda m, x: x - m.mean(x, axis=-1, keepdims=True), ((24, 24),), ((A_,), (B_,))),
    Case("matmul", lambda m, x, w: x @ w, ((24, 24), (24, 24)),
         ((A_, None), (B_, A_), (A_, A_), (("A", "B"), ("B", None)), (None, ("B", "A")))),
    Case("batched_einsum", lambda m, x, w: m.einsum("bij,bjk->bik", x, w), ((24, 6, 24), (24, 24, 6)),
         ((("A", None, "B"), ("A", "B", None)), (("A", None, None), None), (None, (None, "A", None)))),
    Case("einsum_free_contract", lambda m, x, w: m.einsum("bsd,dhk->bshk", x, w), ((4, 24, 24), (24, 12, 6)),
         (((None, "A", "B"), None), ((None, None, "A"), ("A", None, None)), (None, (None, "B", None)))),
    Case("constant_array", lambda m, x: x + m.asarray(np.arange(24.0)) * 2.0, ((24, 24),), ((A_,), (B_,))),
    Case("softmax", _softmax, ((24, 24),), ((A_,), (B_,), (("A", "B"),))),
    Case("attention", _attention, ((24, 24, 24), (24, 24), (24, 24), (24, 24), (24, 24)),
         (((("A", None, None)), (None, "B"), (None, "B"), (None, "B"), ("B", None)), (None,) * 5,
          (((None, "A", None)),) + (None,) * 4)),
    # uneven sizes: 10, 7 and 5 split over up to 8 shards (padding masked before reductions/contractions)
    Case("uneven_add_bcast", lambda m, x, b: x * 2.0 + b, ((10, 7), (7,)), ((A_, None), (B_, ("A",)),
                                                                         ((("A", "B"), None), None))),
    Case("uneven_reduce", lambda m, x: m.sum(x, axis=0) + m.max(x, axis=0) - m.min(x, axis=0) + m.mean(x),
         ((10, 7),), ((A_,), (B_,), (("A", "B"),))),
    Case("uneven_matmul", lambda m, x, w: x @ w, ((10, 7), (7, 5)), ((B_, A_), (A_, B_), (("A", "B"), None))),
    Case("uneven_softmax", _softmax, ((5, 10),), ((B_,), (("A", "B"),))),
    Case("uneven_log_mask", lambda m, x: m.sum(m.log(x), axis=1) + m.max(-m.log(x)), ((6, 7),), ((B_,),),
         positive=True),
    Case("uneven_transpose_reshape", lambda m, x: (x.T * 1.0).reshape(7 * 10) + 1.0, ((10, 7),),
         ((A_,), (B_,))),
    Case("uneven_int_max", lambda m, x: m.max(x, axis=1) + m.min(x, axis=0).sum(), ((7, 10),), ((B_,), (A_,)),
         dtype="int64"),
    Case("mlp_chain", lambda m, x, w1, w2: m.maximum(x @ w1, 0.0) @ w2, ((24, 24), (24, 48), (48, 24)),
         ((A_, (None, "B"), ("B", None)), ((None, None), (None, "A"), ("A", None)))),
]


def resolve(spec, mesh):
    """Replace symbolic axes A/B by the mesh's axis names (B -> None on a 1-d mesh)."""
    if spec is None:
        return None
    names = dict(zip("AB", mesh.axis_names))

    def entry(e):
        if e is None:
            return None
        if isinstance(e, tuple):
            got = tuple(names[a] for a in e if a in names)
            return got or None
        return names.get(e)
    return tuple(entry(e) for e in spec)


def make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    if case.dtype.startswith("int"):
        return [rng.integers(-5, 6, size=s).astype(case.dtype) for s in case.shapes]
    draw = (lambda s: rng.uniform(0.5, 2.0, size=s)) if case.positive else (lambda s: rng.standard_normal(s))
    return [draw(s).astype(case.dtype) for s in case.shapes]


def partition_case(case: Case, specs, mesh):
    """(graph, program, inputs, expected outputs) for one table entry."""
    import spmd_runtime as sr
    import spmd_runtime.numpy as snp
    args = make_inputs(case)
    graph = sr.trace(lambda *a: case.fn(snp, *a), *args)
    program = sr.partition(graph, mesh, in_specs=[resolve(s, mesh) for s in specs])
    return graph, program, args, sr.evaluate(graph, *args)


def tolerance(dtype: str) -> float:
    return {"float32": 1e-4, "float64": 1e-10}.get(dtype, 0.0)


def all_cases() -> list[Case]:
    """The core table plus every family table ``tests/op_cases_<family>.py`` (its ``CASES`` list)."""
    import glob
    import importlib
    import os
    cases = list(CASES)
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "op_cases_*.py"))):
        cases += getattr(importlib.import_module(os.path.basename(path)[:-3]), "CASES", [])
    return cases
