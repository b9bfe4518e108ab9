"""Fusions as compiled C loops (exec/backends/numpy_c.py): the loop nest a fusion gets, the compiled results
against the NumPy ufunc chain and the reference evaluator (special values included), the fallbacks."""
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.exec.backends import numpy_c as cpu_kernels
from spmd_runtime.exec.fused import Fusion, compiled_fusions
from spmd_runtime.exec.interpreter import Interpreter
from spmd_runtime.exec.runner import communicator
from spmd_runtime.models import gpt2
from spmd_runtime.ops import special
from simulated import run_everywhere
from test_fusion import CASES, both, fusions

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")
F32 = "float32"


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """Every fusion compiled (no size floor), into a fresh cache folder."""
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "1")
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "0")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    return tmp_path


def ulps(a, b):
    """Units in the last place between two float arrays (NaN == NaN, same-signed infinities equal)."""
    a, b = np.asarray(a), np.asarray(b)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    ints = {np.dtype("float32"): np.int32, np.dtype("float64"): np.int64}[a.dtype]
    ia, ib = a.view(ints).astype(np.float64), b.view(ints).astype(np.float64)
    ia, ib = [np.where(x < 0, np.iinfo(ints).min - x, x) for x in (ia, ib)]  # sign-magnitude -> ordered
    return np.max(np.where(np.isnan(a), 0, np.abs(ia - ib)), initial=0)


# ------------------------------------------------------------------------- the loop nest (table)
@pytest.mark.parametrize("shape, operands, extents, strides", [
    ((8, 128, 256), [(8, 128, 256)], [262144], [[1]]),  # contiguous: one flat loop
    ((8, 128, 256), [(8, 128, 256), (8, 128, 1)], [1024, 256], [[256, 1], [1, 0]]),  # per-row value
    ((8, 128, 256), [(8, 128, 256), (1, 1, 256)], [1024, 256], [[256, 1], [0, 1]]),  # bias
    ((4, 1, 6), [(4, 1, 6), (1, 1, 6)], [4, 6], [[6, 1], [0, 1]]),  # extent-1 dims dropped
    ((2, 3, 4, 5), [(2, 3, 4, 5), (2, 1, 4, 1)], [2, 3, 4, 5], [[60, 20, 5, 1], [4, 0, 1, 0]]),
    ((), [()], [1], [[1]]),  # a scalar
])
def test_a_fusion_loops_over_merged_dims_with_zero_strides_where_an_operand_repeats(shape, operands, extents,
                                                                                    strides):
    assert cpu_kernels._loop_nest(shape, operands)[:2] == (extents, strides)


def test_the_source_loads_each_operand_then_one_typed_statement_per_step_in_a_vectorised_inner_loop():
    fused, _ = both(lambda x, b: snp.exp(x - b), [sr.TensorSpec((4, 6), F32), sr.TensorSpec((4, 1), F32)],
                    sr.Mesh((1,), ("x",)), [(None, None), (None, None)])
    (f,) = fusions(fused)
    source = cpu_kernels.c_function(Fusion(f), [F32, F32], "k")
    assert source.splitlines() == [
        "void k(const float* p0, const float* p1, float* out) {",
        "  for (int64_t i0 = 0; i0 < 4LL; i0++)",
        "  #pragma omp simd",
        "  for (int64_t i1 = 0; i1 < 6LL; i1++)",
        "  {",
        "    const float a0 = p0[i0*6LL + i1];",
        "    const float a1 = p1[i0];",
        "    const float t0 = (a0 - a1);",
        "    const float t1 = spmd_expf(t0);" if cpu_kernels._vector_math() else "    const float t1 = expf(t0);",
        "    out[i0*6LL + i1] = t1;",
        "  }",
        "}"]


# ------------------------------------------------------------------------- numerics
TRANSCENDENTAL = {"gelu_mlp", "masked_softmax"}  # exp/tanh: libmvec vs NumPy's SIMD loops, a few ulp apart


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("fn, shapes, in_specs, mesh", CASES, ids=[c[0].__name__ for c in CASES])
def test_compiled_fusions_agree_with_the_numpy_chain(fn, shapes, in_specs, mesh, dtype, compiled):
    """Bit-identical where only + - * / sqrt, comparisons, selects and casts run (IEEE order kept, no FMA
    contraction); within 4 ulp where exp or tanh do. Where a sum fuses, the fused chain feeds the double
    accumulator directly and the unfused one through a stored float32 value: there the compiled result is
    no further from the float64 computation than the unfused one (and agrees with NumPy's to float32
    rounding, test_fused_reductions_*). In float64 a fused sum adds in the loop's lane order, NumPy pairwise: the
    two orders agree to a few ulp of the sum's magnitude (which lanes the CPU has, -march=native, decides)."""
    fused, plain = both(fn, [sr.TensorSpec(s, dtype) for s in shapes], mesh, in_specs)
    assert compiled_fusions(fused)  # the compiled path runs
    rng = np.random.default_rng(0)
    args = [np.abs(rng.standard_normal(s) * 2).astype(dtype) for s in shapes]
    args[0][0, 0] = np.nan if fn.__name__ == "clamp_cast" else -args[0][0, 0]
    sums = any(i.op == "fused_reduce" and i.attrs["kind"] == "sum" for i in fused.instrs)
    summed = dtype == "float32" and sums
    exact = run_everywhere(both(fn, [sr.TensorSpec(s, "float64") for s in shapes], mesh, in_specs)[1],
                           *[a.astype("float64") for a in args]) if summed else None
    for r, (rank_got, rank_want) in enumerate(zip(run_everywhere(fused, *args), run_everywhere(plain, *args))):
        for k, (g, w) in enumerate(zip(rank_got, rank_want)):
            assert g.dtype == w.dtype and g.shape == w.shape
            if summed:
                x = exact[r][k]
                assert np.nanmax(np.abs(g - x)) <= np.nanmax(np.abs(w - x)) + np.finfo(dtype).eps * np.nanmax(np.abs(x))
            elif fn.__name__ in TRANSCENDENTAL:
                assert ulps(g, w) <= 4
            elif sums:  # float64: another order of the same additions
                np.testing.assert_allclose(g, w, rtol=0, atol=16 * np.finfo(dtype).eps * np.nanmax(np.abs(w)))
            else:
                np.testing.assert_array_equal(g, w)


SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 88.7, 89.0, -87.0, -87.5, -100.0,
                    -103.9, -104.5, -1e9, 709.0, -707.0, -745.0, -750.0, 3.0, -3.0, 20.0, -20.0, 0.5])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name, fn", [
    ("exp", lambda x, y: snp.exp(x - y)),  # in range, denormal results, underflow to 0, overflow, NaN
    ("log", lambda x, y: snp.log(snp.abs(x) + y)),
    ("tanh", lambda x, y: snp.tanh(x * y)),
    ("sqrt_div", lambda x, y: snp.sqrt(snp.abs(x)) / (y - 1.0)),
    ("pow", lambda x, y: snp.abs(x) ** y),
    ("max_min", lambda x, y: snp.minimum(snp.maximum(x, y), -x)),  # NaN propagates both ways
    ("select_cmp", lambda x, y: snp.where((x >= y) & (x != 0.0), -x, y * 2.0)),
    ("neg_abs", lambda x, y: -snp.abs(x) + y),
])
def test_special_values_give_numpys_results(name, fn, dtype, compiled):
    x = SPECIAL.astype(dtype)
    y = np.resize(np.array([0.0, 1.0, -2.0, np.nan, 0.5, np.inf], dtype), x.shape)
    fused, plain = both(fn, [sr.TensorSpec(x.shape, dtype)] * 2, sr.Mesh((1,), ("x",)), [(None,)] * 2)
    assert compiled_fusions(fused)
    with np.errstate(all="ignore"):
        (got,), (want,) = run_everywhere(fused, x, y)[0], run_everywhere(plain, x, y)[0]
    assert ulps(got, want) <= (4 if name in ("exp", "log", "tanh", "pow") else 0), (got, want)


@pytest.mark.parametrize("dtype, values", [
    ("int32", [-7, 0, 3, 2**31 - 1, -2**31]), ("int64", [-7, 0, 3, 2**62, -2**63]), ("uint8", [0, 1, 200, 255, 7])])
def test_integer_chains_wrap_as_numpy_does(dtype, values, compiled):
    x = np.array(values, dtype)
    fn = lambda a: snp.maximum(a * a + a, a - 1)  # overflow wraps; uint8 0 - 1 wraps to 255
    fused, plain = both(fn, [sr.TensorSpec(x.shape, dtype)], sr.Mesh((1,), ("x",)), [(None,)])
    assert compiled_fusions(fused)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(run_everywhere(fused, x)[0][0], run_everywhere(plain, x)[0][0])


@pytest.mark.parametrize("name, fn", [("maximum", snp.maximum), ("minimum", snp.minimum)])
def test_maximum_and_minimum_break_ties_as_numpy_does_down_to_the_sign_of_zero(name, fn, compiled):
    """A tie gives the second operand (np.maximum(-0.0, 0.0) is 0.0) and a NaN on either side propagates."""
    x = np.array([-0.0, 0.0, -0.0, 0.0, np.nan, 1.0, 2.0, -np.inf] * 3, np.float32)
    y = np.array([0.0, -0.0, -0.0, 0.0, 1.0, np.nan, 2.0, -np.inf] * 3, np.float32)
    fused, plain = both(lambda a, b: fn(a * 1.0, b), [sr.TensorSpec(x.shape, F32)] * 2, sr.Mesh((1,), ("x",)),
                        [(None,)] * 2)
    assert compiled_fusions(fused)
    (got,), (want,) = run_everywhere(fused, x, y)[0], run_everywhere(plain, x, y)[0]
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))  # the bits, signs of zeros included


BOOL_CHAINS = [  # bools are bytes in the C loop: every bool result must stay 0 or 1, as NumPy's
    ("mask select", lambda x, m: snp.where(m, x * 2.0, 0.0)),
    ("to bool", lambda x, m: snp.where(snp.astype(x * 0.5, "bool"), x, -1.0)),  # 0.5, NaN, -0.0, 1e30
    ("bool add", lambda x, m: snp.where(snp.astype(snp.astype(m, "int32") + 2, "bool") & m, x, 3.0)),
    ("compare not", lambda x, m: snp.astype(~(x < 0.5) | m, "float32") + x),
]


@pytest.mark.parametrize("name, fn", BOOL_CHAINS, ids=[c[0] for c in BOOL_CHAINS])
def test_bool_operands_and_results_give_numpys_values(name, fn, compiled):
    x = np.array([0.0, 1.0, 0.5, np.nan, -0.0, 1e30, -3.0, 2.0] * 3, np.float32)
    m = np.resize(np.array([True, False, False, True, True]), x.shape)
    fused, plain = both(fn, [sr.TensorSpec(x.shape, F32), sr.TensorSpec(m.shape, "bool")], sr.Mesh((1,), ("x",)),
                        [(None,)] * 2)
    assert compiled_fusions(fused)
    with np.errstate(all="ignore"):
        (got,), (want,) = run_everywhere(fused, x, m)[0], run_everywhere(plain, x, m)[0]
    np.testing.assert_array_equal(got, want)


def test_a_masked_select_reads_bytes_loaded_before_it_so_its_loop_vectorises():
    """GCC vectorises no loop over _Bool, nor one whose select arm loads an operand (a masked load)."""
    fn = lambda x, r, m: snp.where(m, x + r, 0.0)
    specs = [sr.TensorSpec((4, 6), F32), sr.TensorSpec((4, 1), F32), sr.TensorSpec((4, 6), "bool")]
    fused, _ = both(fn, specs, sr.Mesh((1,), ("x",)), [(None, None)] * 3)
    (f,) = fusions(fused)
    source = cpu_kernels.c_function(Fusion(f), [F32, F32, "bool"], "k")
    assert "const uint8_t* p2" in source and "_Bool" not in source
    body = source.split("{")[2]
    assert all(f"p{i}[" not in line for i in range(3) for line in body.splitlines() if " t" in line.split("=")[0])


def test_a_strided_operand_is_read_correctly(compiled):
    """A transposed operand reaches the loop C-ordered (copied first); the result matches the reference."""
    fn = lambda a, b: snp.tanh(snp.transpose(a) * 2.0 + b)
    specs = [sr.TensorSpec((6, 4), F32), sr.TensorSpec((4, 6), F32)]
    program = sr.partition(sr.trace(fn, *specs), sr.Mesh((2,), ("x",)), in_specs=[(None, "x"), ("x", None)])
    assert compiled_fusions(program)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((6, 4)).astype(F32), rng.standard_normal((4, 6)).astype(F32)
    for (got,) in run_everywhere(program, a, b):
        assert ulps(got, np.tanh(a.T * np.float32(2.0) + b)) <= 4


def test_an_operand_of_another_dtype_than_the_program_says_is_refused(compiled):
    fused, _ = both(lambda x: snp.exp(x * 2.0), [sr.TensorSpec((8,), F32)], sr.Mesh((1,), ("x",)), [(None,)])
    (f,) = fusions(fused)
    run = cpu_kernels.compiled_chain(Fusion(f), compiled_fusions(fused)[f.out], [F32], None)
    with pytest.raises(ValueError, match=r"must be float32\[8 elements\].*got float64\[8\]"):
        run(np.zeros(8))
    np.testing.assert_array_equal(run(np.zeros(8, F32)), np.ones(8, F32))


@pytest.mark.parametrize("donate, planned, message", [
    (1, None, r"donated operand 1 must hold what it writes, float32\[32 elements\]; got float32\[8 elements\]"),
    (-1, np.empty(8, F32), r"planned buffer must hold what it writes, float32\[32 elements\]; got float32\[8 el"),
    (-1, np.empty(32, np.float64), r"planned buffer must hold what it writes, float32\[32 elements\]; got float64"),
])
def test_a_compiled_loop_refuses_at_bind_a_result_buffer_it_would_overrun(compiled, donate, planned, message):
    """The loop writes through a raw pointer: a donated operand (here the broadcast one, of 8 elements for 32) or a
    planned buffer of another size or dtype is refused once, at bind, whatever the program check let through."""
    fused, _ = both(lambda x, b: snp.tanh(x * b + 1.0), [sr.TensorSpec((4, 8), F32), sr.TensorSpec((8,), F32)],
                    sr.Mesh((1,), ("x",)), [(None, None), (None,)])
    (f,) = fusions(fused)
    kernel = compiled_fusions(fused)[f.out]
    with pytest.raises(ValueError, match=message):
        cpu_kernels.compiled_chain(Fusion(f.copy(donate=donate)), kernel, [F32, F32], planned)

def test_training_step_compiled_matches_unfused(compiled, monkeypatch):
    cfg = sr.LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=4)
    steps = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("SPMD_FUSE", fuse)
        steps[fuse] = sr.build_train_step(cfg, sr.train_mesh((2,), "megatron"), "megatron", sr.AdamW())
    assert compiled_fusions(steps["1"].program)
    state = steps["1"].init(0)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 24, (4, 8)), rng.integers(0, 24, (4, 8))
    args = [state["params"], state["opt_state"], {"tokens": x.astype(np.int32), "labels": y.astype(np.int32)}]
    for g, w in zip(run_everywhere(steps["1"].program, *args)[0], run_everywhere(steps["0"].program, *args)[0]):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def test_gpt2_loss_and_gradients_compiled_equal_the_reference_evaluator(compiled):
    """nanoGPT's GPT-2 (exact GELU, a vocab of 50304 as GPT-2 124M's: the cross-entropy's sums over long rows)
    with every loop compiled (the GELU and its backward's erfc alone, the long one-hot sums) against the
    reference evaluator's loss and gradients, to float32 rounding."""
    cfg = gpt2.GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)
    names = list(gpt2.param_shapes(cfg))
    params = gpt2.init_params(cfg, seed=2)
    rng = np.random.default_rng(3)
    idx, targets = (rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32) for _ in range(2))

    def fn(*args):
        loss, grads = sr.value_and_grad(lambda p: gpt2.loss(cfg, dict(zip(names, p)), *args[-2:]))(list(args[:-2]))
        return [loss] + grads
    specs = [sr.TensorSpec(params[n].shape, F32) for n in names] + [sr.TensorSpec(idx.shape, "int32")] * 2
    graph = sr.trace(fn, *specs)
    program = sr.partition(graph, sr.Mesh((1,), ("x",)), in_specs=[(None,) * len(s.shape) for s in specs])
    ops = {i.op for i in program.instrs}
    assert {"gelu_exact", "erfc", "fused_reduce"} <= ops
    assert len(compiled_fusions(program)) > 10
    args = [params[n] for n in names] + [idx, targets]
    got, want = run_everywhere(program, *args)[0], sr.evaluate(graph, *args)
    for name, g, w in zip(["loss"] + names, got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-7 * np.abs(w).max(), err_msg=name)


# ------------------------------------------------------------------------- policy and fallbacks
def program_of_one_big_fusion(n):
    fused, _ = both(lambda x: snp.tanh(x * 2.0 + 1.0), [sr.TensorSpec((n,), F32)], sr.Mesh((1,), ("x",)),
                    [(None,)])
    return fused


def test_fusions_below_the_size_floor_stay_numpy_chains(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "100")
    assert compiled_fusions(program_of_one_big_fusion(99)) == {}
    assert len(compiled_fusions(program_of_one_big_fusion(100))) == 1
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "0")
    assert compiled_fusions(program_of_one_big_fusion(100)) == {}


@pytest.mark.parametrize("name, op, compiled_alone", [("exp", snp.exp, True), ("tanh", snp.tanh, True),
                                                      ("log", snp.log, True), ("sqrt", snp.sqrt, False),
                                                      ("neg", lambda x: -x, False)])
def test_a_transcendental_op_outside_any_fusion_runs_compiled_and_others_stay_ufuncs(name, op, compiled_alone,
                                                                                    monkeypatch, tmp_path):
    """The program keeps the plain op (its listing and tables unchanged); the runtime gives exp/log/tanh/pow a
    compiled loop of their own (fused.COMPILED_ALONE) from the size floor on."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "64")
    x = np.random.default_rng(4).uniform(0.1, 3.0, (8, 16)).astype(F32)
    program = sr.partition(sr.trace(op, sr.TensorSpec(x.shape, F32)), sr.Mesh((1,), ("x",)), in_specs=[(None, None)])
    assert [i.op for i in program.instrs if i.op != "parameter"] == [name]
    interp = Interpreter(program, communicator(program.mesh), np)
    assert bool(interp.cpu_kernels) == compiled_alone
    (got,) = interp.run([x])
    (want,) = sr.evaluate(sr.trace(op, sr.TensorSpec(x.shape, F32)), x)
    assert ulps(got, want) <= 4
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "129")
    assert not Interpreter(program, communicator(program.mesh), np).cpu_kernels  # 128 elements: below the floor


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", ["erf", "erfc", "gelu_exact"])
def test_the_special_functions_run_compiled_alone_equal_to_the_reference_to_rounding(name, dtype, monkeypatch,
                                                                                    tmp_path):
    """erf, erfc and the exact GELU (ops/special.py: float64 NumPy passes) get a compiled loop of their own
    (glibc's erf/erfc in double, rounded once): on an uneven shape spanning both tails, zeros and the special
    values, float32 results within 1 ulp of the reference evaluator's, float64 ones
    within both approximations' errors (Cody's 1e-15 relative), NaN where it gives NaN."""
    op = getattr(special, name)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(cpu_kernels.MIN_ENV, "64")
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-9, 9, 37 * 61 - 40), rng.uniform(-1e-3, 1e-3, 30),
                        [0.0, -0.0, 30.0, -30.0, 1e30, -1e30, np.inf, -np.inf, np.nan, 1e-40]]).astype(dtype)
    x = x.reshape(37, 61)
    traced = sr.trace(op, sr.TensorSpec(x.shape, dtype))
    program = sr.partition(traced, sr.Mesh((1,), ("x",)), in_specs=[(None, None)])
    assert [i.op for i in program.instrs if i.op != "parameter"] == [name]
    interp = Interpreter(program, communicator(program.mesh), np)
    assert interp.cpu_kernels, f"{name} must run as a compiled loop"
    (got,) = interp.run([x])
    (want,) = sr.evaluate(traced, x)
    assert got.dtype == want.dtype == np.dtype(dtype)
    if dtype == F32:
        assert ulps(got, want) <= 1
    else:  # ulps() measures float64 to 2^9 ulps only (its int64 -> float64 step)
        np.testing.assert_allclose(got, want, rtol=2e-15, atol=0)


@pytest.mark.parametrize("cc, says", [("/no/such/cc", "no C compiler"), ("false", "must succeed; got exit 1")])
def test_no_compiler_or_a_failing_one_says_so_once_and_runs_the_numpy_chain(cc, says, compiled, monkeypatch):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(cpu_kernels, "_warned", set())
    program = program_of_one_big_fusion(64)
    with pytest.warns(RuntimeWarning, match=says):
        assert compiled_fusions(program) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process, not per program
        assert compiled_fusions(program) == {}
    x = np.linspace(-2, 2, 64).astype(F32)
    np.testing.assert_allclose(run_everywhere(program, x)[0][0], np.tanh(x * 2 + 1), rtol=1e-6)


def test_a_library_is_compiled_once_and_reused_from_the_cache(compiled):
    program = program_of_one_big_fusion(32)
    compiled_fusions(program)
    (library,) = list(compiled.glob("fusions_*.so"))
    made = library.stat().st_mtime_ns
    cpu_kernels.KernelLibrary._loaded.clear()  # a new process: loads from disk, no compile
    compiled_fusions(program)
    assert list(compiled.glob("fusions_*.so")) == [library] and library.stat().st_mtime_ns == made



def _evil_library(folder, marker):
    """A shared library whose constructor creates ``marker``: what dlopen would run before any check."""
    source = folder / "evil.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{ '
                      f'FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    out = folder / "evil.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


def test_a_replaced_cached_library_is_rebuilt_never_loaded(compiled, tmp_path_factory):
    """A .so swapped into the cache (its sidecar sha256 no longer matches) is compiled again by the next process:
    its constructor never runs, and the program's loop is the real one."""
    cpu_kernels.KernelLibrary._loaded.clear()  # compiled here, into this test's cache
    compiled_fusions(program_of_one_big_fusion(32))
    (library,) = list(compiled.glob("fusions_*.so"))
    elsewhere = tmp_path_factory.mktemp("evil")
    marker = elsewhere / "constructor_ran"
    os.replace(_evil_library(elsewhere, marker), library)
    here = os.path.dirname(os.path.abspath(__file__))
    script = ("import sys; sys.path[:0] = [%r, %r]; import numpy as np; from test_cpu_kernels import "
              "program_of_one_big_fusion; from simulated import run_everywhere; x = np.linspace(-2, 2, 32)"
              ".astype('float32'); y = run_everywhere(program_of_one_big_fusion(32), x)[0][0]; "
              "np.testing.assert_allclose(y, np.tanh(x * 2 + 1), rtol=1e-6)" % (here, os.path.dirname(here)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    assert cpu_kernels._trusted(library, library.with_suffix(".sha256"))  # rebuilt: the recorded bytes again


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_folder_others_can_write_is_not_used(compiled, mode, monkeypatch):
    """A group- or world-writable cache folder: its libraries could be anyone's; a private folder is used instead,
    said once."""
    os.chmod(compiled, mode)
    monkeypatch.setattr(cpu_kernels, "_warned", set())
    program = program_of_one_big_fusion(32)
    cpu_kernels.KernelLibrary._loaded.clear()
    with pytest.warns(RuntimeWarning, match=r"must be owned by this user and writable by no one else; got mode"):
        kernels = compiled_fusions(program)
    assert kernels and not list(compiled.glob("fusions_*.so"))
    os.chmod(compiled, 0o700)

# ------------------------------------------------------------------------- fused reductions
REDUCTIONS = [  # (name, fn, terms summed per result: (count, their magnitudes)); operands (4, 6, 40), (1, 1, 40)
    ("sum_rows", lambda x, b: snp.sum(snp.exp(x - 1.0) * b, axis=-1),
     lambda x, b: (40, np.nansum(np.abs(np.exp(x - 1.0) * b), axis=-1))),
    ("sum_two_dims", lambda x, b: snp.sum(-x * b, axis=(1, 2)), lambda x, b: (240, np.nansum(np.abs(x * b), (1, 2)))),
    ("max_rows", lambda x, b: snp.max(x + b, axis=-1), None),
    ("min_rows", lambda x, b: snp.min(x * 2.0, axis=-1), None),
]


def _reduction_programs(fn, dtype):
    shapes = [(4, 6, 40), (1, 1, 40)]
    fused, plain = both(fn, [sr.TensorSpec(s, dtype) for s in shapes], sr.Mesh((2,), ("x",)),
                        [("x", None, None), (None, None, None)])
    assert [i.op for i in fused.instrs if i.op == "fused_reduce"] == ["fused_reduce"]
    return fused, plain


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name, fn, terms", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_fused_reductions_compiled_agree_with_the_unfused_to_rounding(name, fn, terms, dtype, compiled):
    """Against the reference evaluator (NumPy's chain and reduce kernel, no compiled loop): sums accumulate in
    double and differ from its sums (float32 or float64 rows by BLAS) by no more than their own rounding
    bound, n * eps * the sum of the terms' magnitudes; max and min exactly, NaN included."""
    fused, _ = _reduction_programs(fn, dtype)
    assert compiled_fusions(fused)
    rng = np.random.default_rng(1)
    x, b = rng.standard_normal((4, 6, 40)).astype(dtype), rng.standard_normal((1, 1, 40)).astype(dtype)
    x[1, 2, 3] = np.nan
    (w,) = sr.evaluate(sr.trace(fn, x, b), x, b)
    for (g,) in run_everywhere(fused, x, b):
        assert np.array_equal(np.isnan(g), np.isnan(w)) and np.isnan(g).any()
        if terms is None:
            np.testing.assert_array_equal(g, w)
            continue
        n, magnitude = terms(x.astype("float64"), b.astype("float64"))
        bound = n * np.finfo(dtype).eps * magnitude
        assert np.all(np.isnan(g) | (np.abs(g - w) <= bound)), (g - w, bound)


@pytest.mark.parametrize("name, fn", [("max", snp.max), ("min", snp.min)])
def test_fused_max_and_min_keep_numpys_nan_and_tie_rules(name, fn, compiled):
    """Compiled over lanes: a NaN anywhere in a row (first, last, in the tail past the lanes) gives NaN;
    infinities pass; a tie between 0.0 and -0.0 gives NumPy's sign on these rows (the later element within a
    lane, then the later lane, as NumPy's SIMD loops)."""
    rows = np.array([[0.0, -0.0] * 21, [-0.0, 0.0] * 21, [np.nan] + [1.0] * 41, [1.0] * 41 + [np.nan],
                     [1.0] * 39 + [np.nan, 1.0, 1.0], [-np.inf] * 42, [np.inf] + [0.0] * 41,
                     list(np.arange(42.0) * (1 if name == "max" else -1))], np.float32)
    fused, _ = both(lambda a: fn(a * 1.0, axis=-1), [sr.TensorSpec(rows.shape, F32)], sr.Mesh((1,), ("x",)),
                    [(None, None)])
    assert [i.op for i in fused.instrs if i.op == "fused_reduce"] == ["fused_reduce"] and compiled_fusions(fused)
    (got,), want = run_everywhere(fused, rows)[0], getattr(np, name)(rows, axis=-1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_the_reduction_source_accumulates_each_row_and_stores_no_chain_value():
    fused, _ = _reduction_programs(REDUCTIONS[0][1], F32)
    (ins,) = [i for i in fused.instrs if i.op == "fused_reduce"]
    from spmd_runtime.exec.fused import chain_of
    source = cpu_kernels.c_function(Fusion(chain_of(ins)), [F32, F32], "f", reduce=("sum", 1))
    assert "double acc = 0.0;" in source and "#pragma omp simd reduction(+:acc)" in source
    assert "acc += (double)t2;" in source and "out[i0] = (float)acc;" in source
    assert source.count("out[") == 1  # one store per row: the chain's values never reach memory


def test_float64_sums_over_rows_longer_than_blas_sums_stay_numpy(compiled):
    """float64 rows over ops/core.MAX_BLAS_ROW keep NumPy's pairwise sum (unfused too): no compiled loop, same
    bits (one double accumulator's error would grow as n)."""
    n = 5000
    fused, plain = both(lambda a: snp.sum(a * 2.0, axis=-1), [sr.TensorSpec((3, n), "float64")],
                        sr.Mesh((1,), ("x",)), [(None, None)])
    assert [i.op for i in fused.instrs if i.op == "fused_reduce"] == ["fused_reduce"]
    assert not compiled_fusions(fused)
    x = np.random.default_rng(0).standard_normal((3, n))
    np.testing.assert_array_equal(run_everywhere(fused, x)[0][0], run_everywhere(plain, x)[0][0])


def test_float32_sums_over_long_rows_compile_and_land_within_float32_rounding_of_the_exact_sum(compiled):
    """A cross-entropy's one-hot pick over 50304 classes (uneven rows, one holding its label last, one whose
    terms cancel): one compiled pass accumulating in double, within one float32 rounding of the exact (float64)
    sum, as close as the reference evaluator's pairwise float32 sum or closer."""
    n, rows = 50304, 7
    fn = lambda x, label: snp.sum(x * snp.astype(label[:, None] == snp.arange(n, dtype="int32")[None, :], F32) +
                                  x * 1e-3, axis=-1)
    specs = [sr.TensorSpec((rows, n), F32), sr.TensorSpec((rows,), "int32")]
    fused, _ = both(fn, specs, sr.Mesh((1,), ("x",)), [(None, None), (None,)])
    assert [i.op for i in fused.instrs if i.op == "fused_reduce"] == ["fused_reduce"]
    assert compiled_fusions(fused)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, n)).astype(F32) * 30
    x[2] = np.concatenate([np.full(n // 2, 1e4, F32), np.full(n - n // 2, -1e4, F32)])  # cancels to 0
    label = np.array([0, n - 1, 5, 17, 40000, 3, 9], np.int32)
    (got,) = run_everywhere(fused, x, label)[0]
    (want,) = sr.evaluate(sr.trace(fn, *specs), x, label)
    xd = x.astype("float64")
    exact = xd[np.arange(rows), label] + (xd * np.float64(np.float32(1e-3))).sum(-1)
    err, ref_err = np.abs(got - exact), np.abs(want.astype("float64") - exact)
    magnitude = np.abs(xd).sum(-1) * 1e-3 + np.abs(xd[np.arange(rows), label])
    assert np.all(err <= np.maximum(ref_err, np.spacing(np.abs(exact).astype(F32)).astype("float64") +
                                    n * 2.0 ** -52 * magnitude)), (err, ref_err)
    assert got[2] == np.float32(x[2, 5] + 0.0)  # the cancelling row: exactly its label's logit


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_a_plain_reduction_over_rows_runs_as_a_compiled_loop_too(kind, compiled):
    """A softmax's row max (its operand also feeds the subtraction, so nothing fuses into it) stays a ``reduce``
    in the program and runs as the same compiled row loop, with an identity chain."""
    fn = getattr(snp, kind)
    fused, _ = both(lambda a: a - fn(a, axis=-1, keepdims=True), [sr.TensorSpec((6, 40), F32)],
                    sr.Mesh((1,), ("x",)), [(None, None)])
    (red,) = [i for i in fused.instrs if i.op == "reduce"]
    assert red.out in compiled_fusions(fused)
    x = np.random.default_rng(0).standard_normal((6, 40)).astype(F32)
    x[2, 7] = np.nan
    got, want = run_everywhere(fused, x)[0][0], x - getattr(np, kind)(x, axis=-1, keepdims=True)  # NumPy's own
    if kind == "sum":
        np.testing.assert_allclose(got, want, rtol=0, atol=40 * np.finfo(F32).eps * np.nansum(np.abs(x), -1).max())
    else:
        np.testing.assert_array_equal(got, want)


def test_a_max_whose_rows_do_not_merge_into_one_loop_stays_numpys(compiled):
    """Lanes run over one merged row loop: a max over two trailing dims where an operand repeats along one
    of them (two loops) keeps NumPy's max."""
    fused, _ = both(lambda a, b: snp.max(a + b, axis=(1, 2)), [sr.TensorSpec((4, 6, 40), F32),
                    sr.TensorSpec((4, 6, 1), F32)], sr.Mesh((1,), ("x",)), [(None, None, None)] * 2)
    (red,) = [i for i in fused.instrs if i.op == "fused_reduce"]
    assert red.out not in compiled_fusions(fused)
    x, b = (np.random.default_rng(0).standard_normal(s).astype(F32) for s in ((4, 6, 40), (4, 6, 1)))
    np.testing.assert_array_equal(run_everywhere(fused, x, b)[0][0], np.max(x + b, axis=(1, 2)))
