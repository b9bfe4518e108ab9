"""Type promotion against JAX's documented table (docs.jax.dev/en/latest/type_promotion.html, "Type promotion
semantics": the binary promotion table, copied below from the docs, not from the code), through the traced
ops: strong dtypes as traced tensors, the weak types i*, f*, c* as Python int, float and complex scalars. With
x64 the table's entries are the dtypes (a weak result is int64 / float64 / complex128); without x64 (the
default) a weak result is int32 / float32 / complex64 and a 64-bit entry that neither operand has is its 32-bit
twin (JAX without x64 has no 64-bit types; float64 tensors the user made stay float64). Then NumPy scalars and
arrays (canonicalized as JAX does), the issue's cases and the x64 switches."""
import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime import dtypes

CODES = "b1 u1 u2 u4 u8 i1 i2 i4 i8 bf f2 f4 f8 c8 c16 i* f* c*".split()
JAX_TABLE = """
b1  b1  u1  u2  u4  u8  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i*  f*  c*
u1  u1  u1  u2  u4  u8  i2  i2  i4  i8  bf  f2  f4  f8  c8  c16 u1  f*  c*
u2  u2  u2  u2  u4  u8  i4  i4  i4  i8  bf  f2  f4  f8  c8  c16 u2  f*  c*
u4  u4  u4  u4  u4  u8  i8  i8  i8  i8  bf  f2  f4  f8  c8  c16 u4  f*  c*
u8  u8  u8  u8  u8  u8  f*  f*  f*  f*  bf  f2  f4  f8  c8  c16 u8  f*  c*
i1  i1  i2  i4  i8  f*  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i1  f*  c*
i2  i2  i2  i4  i8  f*  i2  i2  i4  i8  bf  f2  f4  f8  c8  c16 i2  f*  c*
i4  i4  i4  i4  i8  f*  i4  i4  i4  i8  bf  f2  f4  f8  c8  c16 i4  f*  c*
i8  i8  i8  i8  i8  f*  i8  i8  i8  i8  bf  f2  f4  f8  c8  c16 i8  f*  c*
bf  bf  bf  bf  bf  bf  bf  bf  bf  bf  bf  f4  f4  f8  c8  c16 bf  bf  c8
f2  f2  f2  f2  f2  f2  f2  f2  f2  f2  f4  f2  f4  f8  c8  c16 f2  f2  c8
f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f8  c8  c16 f4  f4  c8
f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  c16 c16 f8  f8  c16
c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c16 c8  c16 c8  c8  c8
c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16
i*  i*  u1  u2  u4  u8  i1  i2  i4  i8  bf  f2  f4  f8  c8  c16 i*  f*  c*
f*  f*  f*  f*  f*  f*  f*  f*  f*  f*  bf  f2  f4  f8  c8  c16 f*  f*  c*
c*  c*  c*  c*  c*  c*  c*  c*  c*  c*  c8  c8  c8  c16 c8  c16 c*  c*  c*
"""
TABLE = {(row[0], col): entry for row in (line.split() for line in JAX_TABLE.strip().splitlines())
         for col, entry in zip(CODES, row[1:])}
NAMES = {"b1": "bool", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "i1": "int8", "i2": "int16",
         "i4": "int32", "i8": "int64", "bf": "bfloat16", "f2": "float16", "f4": "float32", "f8": "float64",
         "c8": "complex64", "c16": "complex128"}
WEAK = {"i*": 3, "f*": 2.5, "c*": 1 + 2j}
WEAK_AS = {True: {"i*": "int64", "f*": "float64", "c*": "complex128"},
           False: {"i*": "int32", "f*": "float32", "c*": "complex64"}}
TWIN = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}


def expected(a: str, b: str, x64: bool) -> str:
    entry = TABLE[a, b]
    if entry in WEAK:
        return WEAK_AS[x64][entry]
    name = NAMES[entry]
    if not x64 and name in TWIN and not {NAMES.get(a), NAMES.get(b)} & set(TWIN):
        return TWIN[name]
    return name


def operand(code: str):
    return dtypes.dtype(NAMES[code]) if code in NAMES else WEAK[code]


@pytest.fixture(params=[False, True], ids=["x64-off", "x64-on"])
def x64(request, monkeypatch):
    monkeypatch.setattr(dtypes.config, "_x64", request.param)
    return request.param


def test_the_table_is_symmetric_as_the_docs_say():
    assert all(TABLE[a, b] == TABLE[b, a] for a in CODES for b in CODES)


def test_the_lattice_joins_give_the_documented_table():
    """``dtypes.join`` on the one lattice table gives every entry of JAX's binary table."""
    got = {(a, b): dtypes.join(a, b) for a in CODES for b in CODES}
    assert got == TABLE


@pytest.mark.parametrize("a", CODES)
def test_traced_add_promotes_by_the_table(a, x64):
    """One traced ``add`` per pair: a strong operand is a traced tensor, a weak one a Python scalar (two Python
    scalars: the first is made a traced value of its own default dtype, so it is strong; those pairs are checked
    through result_type instead)."""
    for b in CODES:
        want = expected(a, b, x64)
        assert dtypes.result_type(operand(a), operand(b)) == want, (a, b)
        if a in WEAK:
            continue
        spec = sr.TensorSpec((2,), NAMES[a])
        other = sr.TensorSpec((2,), NAMES[b]) if b in NAMES else None
        fn = (lambda x, y: snp.add(x, y)) if other is not None else (lambda x, b=b: snp.add(x, WEAK[b]))
        graph = sr.trace(fn, spec, other) if other is not None else sr.trace(fn, spec)
        assert graph.nodes[graph.outputs[0]].dtype == want, (a, b)


def test_numpy_scalars_and_arrays_are_strong_and_32_bit_without_x64(x64):
    x = np.ones(3, np.float32)
    i = np.ones(3, np.int32)
    cases = [(lambda v, k: v * np.float64(2), "float64" if x64 else "float32"),
             (lambda v, k: v + np.ones(3), "float64" if x64 else "float32"),
             (lambda v, k: k + np.int64(1), "int64" if x64 else "int32"),
             (lambda v, k: k * np.float32(2), "float32"),
             (lambda v, k: v + np.float16(1), "float32"),
             (lambda v, k: snp.asarray(np.arange(3.0)) + k, "float64"),  # converted on purpose: kept
             (lambda v, k: snp.asarray([1.0, 2.0, 3.0]) + k, "float64" if x64 else "float32")]
    for fn, want in cases:
        graph = sr.trace(fn, x, i)
        assert graph.nodes[graph.outputs[0]].dtype == want


def test_the_issue_cases_stay_float32_without_x64(x64):
    """snp.where(x < 0, -1.0, 1.0), snp.arange(4) * 1.0 and x * np.float64(2) gave float64 silently."""
    x = np.linspace(-1, 1, 4).astype(np.float32)
    outs = sr.evaluate(sr.trace(lambda v: (snp.where(v < 0, -1.0, 1.0), snp.arange(4) * 1.0, v * np.float64(2),
                                           snp.mean(snp.arange(4)), snp.exp(snp.arange(4)), snp.arange(4) / 2), x),
                       x)
    assert [o.dtype for o in outs] == [np.dtype("float64" if x64 else "float32")] * 2 + [
        np.dtype("float64" if x64 else "float32")] + [np.dtype("float64" if x64 else "float32")] * 3
    np.testing.assert_array_equal(outs[0], [-1.0, -1.0, 1.0, 1.0])


def test_explicit_float64_stays_float64_without_x64():
    x = np.ones(3, np.float64)
    outs = sr.evaluate(sr.trace(lambda v: (v * 2.0, v + np.float32(1), snp.astype(v, "float32") * 1.0,
                                           snp.full((2,), 1.0, "float64"), snp.asarray(1.0, "float64")), x), x)
    assert [o.dtype.name for o in outs] == ["float64", "float64", "float32", "float64", "float64"]


def test_weak_scalars_keep_a_narrow_dtype():
    for dtype in ("uint8", "int8", "float16", "bfloat16"):
        graph = sr.trace(lambda v: (v + 1, v * 2), sr.TensorSpec((3,), dtype))
        assert {graph.nodes[o].dtype for o in graph.outputs} == {dtype}


def test_x64_switch_by_config_and_by_environment(monkeypatch):
    monkeypatch.setattr(dtypes.config, "_x64", None)
    monkeypatch.delenv(dtypes.X64_ENV, raising=False)
    assert not sr.config.enable_x64 and dtypes.result_type(1.0) == np.float32
    monkeypatch.setenv(dtypes.X64_ENV, "1")
    assert sr.config.enable_x64 and dtypes.result_type(1.0) == np.float64
    sr.config.update("jax_enable_x64", False)
    assert not sr.config.enable_x64 and dtypes.result_type(1) == np.int32
    sr.config.update("enable_x64", True)
    assert dtypes.result_type(np.float64(1), np.float32(1)) == np.float64
    with pytest.raises(ValueError, match="knows 'enable_x64'.*got 'x64'"):
        sr.config.update("x64", True)


def test_an_unknown_dtype_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"type promotion knows .*got <U1"):
        dtypes.result_type(np.array(["a"]))


@pytest.mark.parametrize("x64, bounds, want", [
    (False, (3,), "int32"), (False, (3.0,), "float32"), (False, (np.int64(3),), "int32"), (False, (0, 3, 0.5), "float32"),
    (True, (3,), "int64"), (True, (3.0,), "float64"), (True, (np.int32(3),), "int32")])
def test_arange_takes_jax_dtypes(x64, bounds, want):
    # jnp.arange: Python bounds are weak (the default int / float), NumPy scalars their canonical type
    mesh = sr.Mesh((1,), ("x",))
    previous = sr.config.enable_x64
    sr.config.update("enable_x64", x64)
    try:
        assert sr.jit(lambda: snp.arange(*bounds), mesh=mesh)().dtype == np.dtype(want)
    finally:
        sr.config.update("enable_x64", previous)
