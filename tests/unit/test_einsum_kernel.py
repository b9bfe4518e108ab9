"""The local einsum kernel (ops/einsum.py): contractions as batched BLAS matmuls, and einsums that sum
over nothing as one broadcasting multiply in the output's order; both against np.einsum."""
import numpy as np
import pytest

from spmd_runtime.ops.einsum import _einsum_kernel

SPECS = [  # (spec, lhs shape, rhs shape)
    ("bsd,d->dbs", (2, 3, 4), (4,)),  # a LayerNorm gain, output batch-first
    ("bsd,d->bsd", (2, 3, 4), (4,)),
    ("dbs,d->dbs", (4, 2, 3), (4,)),
    ("bs,d->bsd", (2, 3), (4,)),  # an additive bias through a ones operand
    ("b,sd->bsd", (2,), (3, 4)),  # the positional table over the batch
    ("ab,cd->cadb", (2, 3), (4, 5)),  # an outer product, permuted
    ("abc,cb->acb", (2, 3, 4), (4, 3)),
    ("aXY,YZ->aXZ", (2, 3, 4), (4, 5)),  # contractions: the matmul path
    ("bsd,dbs->d", (2, 3, 4), (4, 2, 3)),
    ("ab,bc->ca", (2, 3), (3, 4)),  # b's free letter first: planned as b @ a, BLAS writes the result in order
    ("abc,abd->dbc", (2, 3, 4), (2, 3, 5)),  # a contraction whose output is not BLAS's order: copied into the buffer
    ("bsd,bsd->d", (2, 3, 4), (2, 3, 4)),  # one dot product per output element: the library's einsum
    ("bsd,dbs->d", (2, 3, 4), (4, 2, 3)),
    ("abc,abc->ba", (2, 3, 4), (2, 3, 4)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec, sa, sb", SPECS, ids=[s[0] for s in SPECS])
def test_the_kernel_gives_np_einsum_into_a_planned_buffer_or_fresh(spec, sa, sb, dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
    want = np.einsum(spec, a, b)
    into = np.empty(want.size, dtype)
    fresh, planned = _einsum_kernel(np, a, b, spec), _einsum_kernel(np, a, b, spec, into=into)
    for got in (fresh, planned):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-13)
    assert np.shares_memory(planned, into)
    np.testing.assert_array_equal(into.reshape(want.shape), planned)  # the buffer holds the value, C-ordered
    if "," in spec and not set(spec.split("->")[0].replace(",", "")) - set(spec.split("->")[1]):
        np.testing.assert_array_equal(fresh, want)  # nothing summed: each element one product, exact
        assert fresh.flags.c_contiguous  # written in the output's order


@pytest.mark.parametrize("spec, sa, sb", [("aXY,YZ->aXZ", (2, 3, 4), (4, 5)), ("ab,bc->ca", (2, 3), (3, 4)),
                                          ("bsd,d->bsd", (2, 3, 4), (4,)), ("bsd,bsd->d", (2, 3, 4), (2, 3, 4))])
def test_a_16_bit_einsum_given_a_buffer_leaves_its_value_there(spec, sa, sb):
    """16-bit operands multiply as float32 copies (no 16-bit BLAS), products and dot products too (float32
    accumulation): the rounded result is copied in."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(sa).astype(np.float16), rng.standard_normal(sb).astype(np.float16)
    fresh = _einsum_kernel(np, a, b, spec)
    want = np.einsum(spec, a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(fresh, want)
    into = np.empty(fresh.size, np.float16)
    planned = _einsum_kernel(np, a, b, spec, into=into)
    assert np.shares_memory(planned, into) and planned.dtype == np.float16
    np.testing.assert_array_equal(into.reshape(fresh.shape), fresh)


@pytest.mark.parametrize("spec, sa, sb", [("bs,bsd->d", (4, 6), (4, 6, 5)), ("b,bsd->sd", (4,), (4, 6, 5))])
def test_a_broadcast_operand_is_summed_through_blas_with_np_einsums_value(spec, sa, sb, monkeypatch):
    """A bias's gradient contracts a broadcast ones operand (zero strides): it is made contiguous for BLAS
    (NumPy's matmul runs its own slow loop on zero strides) and the value stays np.einsum's."""
    import spmd_runtime.ops.einsum as einsum_module
    seen = []
    real = np.matmul
    monkeypatch.setattr(einsum_module.np, "matmul", lambda x, y, **kw: seen.append((x.strides, y.strides))
                        or real(x, y, **kw))
    rng = np.random.default_rng(2)
    a, b = np.broadcast_to(np.float32(1), sa), rng.standard_normal(sb).astype(np.float32)
    np.testing.assert_allclose(_einsum_kernel(np, a, b, spec), np.einsum(spec, a, b), rtol=1e-6)
    assert seen and all(0 not in strides for pair in seen for strides in pair)


@pytest.mark.parametrize("spec, shapes", [("...i,oi->...o", ((2, 3, 4), (5, 4))), ("...ij,...jk", ((2, 3, 4), (4, 5))),
                                          ("b...,b...->...b", ((2, 3, 4), (2, 3, 4))), ("...,...", ((3,), (3,)))])
def test_traced_einsum_takes_numpys_ellipsis(spec, shapes):
    import spmd_runtime as sr  # the traced front end, not the kernel above
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    with sr.Mesh((1,), ("x",)):
        got = np.asarray(sr.jit(lambda a, b: sr.numpy.einsum(spec, a, b))(*xs))
    np.testing.assert_allclose(got, np.einsum(spec, *xs), rtol=1e-5)
    with pytest.raises(ValueError, match="stands for the dims a term leaves unnamed"):
        sr.trace(lambda a: sr.numpy.einsum("ij...k->k", a), sr.TensorSpec((2, 3), "float32"))


# (spec, lhs, rhs): b's free letters lead the output (a weight's gradient x.T @ g held [out, in]; c_attn's
# (3, heads, head, in) from (b, t, in) and (b, t, 3, heads, head)). Before, the front end emitted the einsum in
# batch + a-free + b-free order and a transpose after it (9 of a 2-layer GPT-2 step's 23 transposes).
SWAPPED = [("abi,abo->oi", (2, 3, 4), (2, 3, 5)), ("btc,btshe->shec", (2, 3, 4), (2, 3, 3, 2, 2)),
           ("xab,xbc->xca", (2, 3, 4), (2, 4, 5))]


@pytest.mark.parametrize("spec, sa, sb", SWAPPED, ids=[s[0] for s in SWAPPED])
def test_an_output_led_by_the_second_operands_letters_is_one_matmul_in_order_and_traces_without_a_transpose(
        spec, sa, sb):
    import spmd_runtime as sr  # the traced front end
    from spmd_runtime.ops.einsum import _plan
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(sa).astype("float32"), rng.standard_normal(sb).astype("float32")
    assert _plan(spec, sa, sb).swapped and _plan(spec, sa, sb).in_order
    got = _einsum_kernel(np, a, b, spec)
    assert got.flags.c_contiguous  # BLAS wrote it in the output's order: no transposed view to copy later
    np.testing.assert_allclose(got, np.einsum(spec, a, b), rtol=1e-5)
    graph = sr.trace(lambda x, y: sr.numpy.einsum(spec, x, y), sr.TensorSpec(sa, "float32"),
                     sr.TensorSpec(sb, "float32"))
    assert [n.op for n in graph.nodes if n.inputs] == ["einsum"], [n.op for n in graph.nodes]


# attention's contractions whose output interleaves batch and free letters: the kernel writes each (b, h) slice
# through the result's strides (one BLAS call per slice, ldc = the row stride), so the einsum comes out in its
# own order and the reshape to (b, t, d) after it is a view, not a copy.
STRIDED = [("bhqk,bkhe->bqhe", (2, 3, 4, 5), (2, 5, 3, 6)), ("bhqk,bhqe->bkhe", (2, 3, 4, 5), (2, 3, 4, 6)),
           ("bqhe,bhqk->bkhe", (2, 4, 3, 6), (2, 3, 4, 5))]


@pytest.mark.parametrize("spec, sa, sb", STRIDED, ids=[s[0] for s in STRIDED])
def test_an_interleaved_output_is_written_through_its_strides_and_traces_without_a_transpose(spec, sa, sb,
                                                                                           monkeypatch):
    import spmd_runtime as sr  # the traced front end
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(sa).astype("float32"), rng.standard_normal(sb).astype("float32")
    outs = []
    real = np.matmul
    monkeypatch.setattr(np, "matmul", lambda x, y, out=None: outs.append(out) or real(x, y, out=out))
    got = _einsum_kernel(np, a, b, spec)
    monkeypatch.undo()
    assert got.flags.c_contiguous and outs and all(o is not None and np.shares_memory(o, got) for o in outs)
    np.testing.assert_allclose(got, np.einsum(spec, a, b), rtol=1e-5)
    graph = sr.trace(lambda x, y: sr.numpy.einsum(spec, x, y), sr.TensorSpec(sa, "float32"),
                     sr.TensorSpec(sb, "float32"))
    assert [n.op for n in graph.nodes if n.inputs] == ["einsum"], [n.op for n in graph.nodes]
