"""Program files are validated at load against the op definitions (issue 9): every program the partitioner
makes loads back, and each class of tampering (hash recomputed) is refused naming the instruction and rule."""
import hashlib
import json
import os
import re
import sys

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.collective_kinds import BY_START, KINDS
from spmd_runtime.comm import run_simulated
from spmd_runtime.cost import group_size
from spmd_runtime.program import SPMDProgram
from spmd_runtime.program_check import ProgramError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from op_cases import all_cases, partition_case  # noqa: E402

MESH = sr.Mesh((2, 3), ("a", "b"))


def test_every_table_program_and_a_training_step_load_back(tmp_path):
    """No false alarm: each op family's partitioned program (and a train step) passes validation."""
    programs = []
    for case in all_cases():
        programs.append(partition_case(case, case.specs[0], MESH)[1])
    cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2)
    programs.append(sr.build_train_step(cfg, sr.train_mesh((2, 2), "megatron_wus"), "megatron_wus",
                                        sr.AdamW(lr=0.1)).program)
    moe = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=4, experts=2, moe_every=1)
    programs.append(sr.build_train_step(moe, sr.train_mesh((2, 2), "moe_megatron"), "moe_megatron",
                                        sr.AdamW(lr=0.1)).program)
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # a planner exchange: all_to_allv
    exchange = sr.partition(sr.trace(lambda a: a * 1.0, x), sr.Mesh((2, 4), ("x", "y")),
                            in_specs=[sr.Sharding((("x",), ()), ("y",))], out_specs=[sr.Sharding((("y",), ()))])
    assert "all_to_allv" in exchange.collectives()
    programs.append(exchange)
    for program in programs:
        program.save(tmp_path / "p.json")
        assert sr.load_program(tmp_path / "p.json").hash == program.hash
        _assert_collective_shapes_follow_their_kinds(program)
    pytest.importorskip("ml_dtypes")
    bf16 = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2, dtype="bfloat16")
    program = sr.build_train_step(bf16, sr.train_mesh((2,), "dp"), "dp", sr.AdamW(lr=0.1)).program
    program.save(tmp_path / "p.json")
    assert sr.load_program(tmp_path / "p.json").hash == program.hash


def _assert_collective_shapes_follow_their_kinds(program):
    """Each collective's (or start's) local shape is its kind's rule applied to its operand's and the group size
    (collective_kinds.CollectiveKind.result_shape), loop bodies included."""
    for ins in program.instrs:
        for body in (v for value in ins.attrs.values() for v in (value if isinstance(value, tuple) else (value,))
                     if isinstance(v, SPMDProgram)):
            _assert_collective_shapes_follow_their_kinds(body)
        kind = KINDS.get(ins.op) or BY_START.get(ins.op)
        if kind is not None and kind.result is not None:
            k = group_size(kind.name, ins.attrs, program.mesh)
            assert ins.shape == kind.result_shape(program.instrs[ins.args[0]].shape, k, ins.attrs), ins


def _saved(tmp_path):
    graph = sr.trace(lambda x, w: snp.exp(x @ w).sum(axis=0), sr.TensorSpec((8, 6), "float64"), sr.TensorSpec((6, 4), "float64"))
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), None])
    program.save(tmp_path / "p.json")
    return json.loads((tmp_path / "p.json").read_text())


def _write_with_hash(tmp_path, doc):
    body = {k: doc[k] for k in ("mesh", "inputs", "outputs", "instrs", "notes")}
    doc["hash"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (tmp_path / "p.json").write_text(json.dumps(doc))


def _first(doc, op):
    return next(i for i in doc["instrs"] if i["op"] == op)


TAMPERING = {
    "kernel name from the file": (lambda d: _first(d, "reduce")["attrs"].update(kind="__import__"),
                                  "attribute 'kind' must be one of"),
    "unknown op": (lambda d: _first(d, "exp").update(op="system"), "the op must be one the interpreter runs"),
    "extra attribute": (lambda d: _first(d, "reduce")["attrs"].update(where="x"), "attributes must be ['axes', 'kind']"),
    "missing attribute": (lambda d: _first(d, "einsum")["attrs"].pop("spec"), "attributes must be ['spec']"),
    "bad einsum spec": (lambda d: _first(d, "einsum")["attrs"].update(spec="os.system"),
                        "attribute 'spec' must be an einsum spec"),
    "unknown mesh axis": (lambda d: _first(d, "all_reduce")["attrs"].update(axes=["y"]),
                          "attribute 'axes' must be distinct axes of Mesh(x=2)"),
    "collective op": (lambda d: _first(d, "all_reduce")["attrs"].update(op="xor"),
                      "attribute 'op' must be one of ['max', 'min', 'prod', 'sum']"),
    "object dtype": (lambda d: _first(d, "exp").update(dtype="object"), "dtype must be a numeric dtype"),
    "undefined operand": (lambda d: _first(d, "exp").update(args=[999]), "undefined slot(s) [999]"),
    "string where a number goes": (lambda d: _first(d, "reduce")["attrs"].update(axes="0"),
                                   "attribute 'axes' must be a tuple"),
    "negative shape": (lambda d: _first(d, "exp").update(shape=[-1, 4]), "shape must be in [0, inf)"),
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_tampered_program_with_recomputed_hash_is_refused(tmp_path, name):
    edit, message = TAMPERING[name]
    doc = _saved(tmp_path)
    edit(doc)
    _write_with_hash(tmp_path, doc)
    with pytest.raises(ProgramError, match=r"^(instruction %\d+ = \w+: |output|input)") as info:
        sr.load_program(tmp_path / "p.json")
    assert message in str(info.value)


def _saved_fusion(tmp_path):
    """A donated x times a broadcast b, fused: ``fusion(%0!, %1)`` with shapes ((4, 4), (1, 4))."""
    graph = sr.trace(lambda x, b: snp.tanh(x * b + 1.0) * 2.0, sr.TensorSpec((8, 4), "float32"),
                     sr.TensorSpec((4,), "float32"))
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), None], donate=(0,))
    program.save(tmp_path / "p.json")
    return json.loads((tmp_path / "p.json").read_text())


def _saved_overlapped(tmp_path):
    """An all_reduce_start (%3) with independent work (exp of %1) before its done."""
    graph = sr.trace(lambda a, w: a.sum() + snp.exp(w).sum(), sr.TensorSpec((8,), "float64"),
                     sr.TensorSpec((4,), "float64"))
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x",), None], fuse=False).save(tmp_path / "p.json")
    return json.loads((tmp_path / "p.json").read_text())


def _set(**changes):
    return lambda ins: ins.update(changes)


def _attr(**changes):
    return lambda ins: ins["attrs"].update(changes)


# Issue 30: edits that passed the check and then failed in NumPy, or wrote past a buffer (the donated broadcast
# operand: the compiled loop wrote 16 floats into 4). (program, op edited, edit, the rule the message names)
RESULT_RULES = {
    "donated broadcast operand": (_saved_fusion, "fusion", _set(donate=1),
                                  "a donated operand's buffer receives the result, so it must be of the result's "
                                  "shape and dtype float32[4, 4]"),
    "donation of another dtype": (_saved, "exp", _set(dtype="float32"), "the dtype must be what the exp rule gives"),
    "parameter index out of range": (_saved, "parameter", _attr(index=5),
                                     "attribute 'index' must be an input position in [0, 2); got 5"),
    "unknown einsum letter": (_saved, "einsum", _attr(spec="XY,YZ->XW"),
                              "output letters must be distinct operand letters; got 'XW'"),
    "einsum letters for another rank": (_saved, "einsum", _attr(spec="XYQ,YZ->XZ"),
                                        "must name each dim of operand 0 (4, 6) once; got 'XYQ'"),
    "einsum letter of two extents": (_saved, "einsum", _attr(spec="XY,XZ->YZ"),
                                     "letter 'X' must have one extent; got 4 and 6"),
    "edited instruction shape": (_saved, "exp", _set(shape=[4, 5]), "the local shape must be what the exp rule "
                                 "gives for operand shape(s) [(4, 4)], (4, 4); got (4, 5)"),
    "edited receive shape": (_saved, "all_reduce", _set(shape=[8]), "the local shape must be what the all_reduce "
                             "rule gives for operand shape(s) [(4,)], (4,); got (8,)"),
    "reduced axis out of range": (_saved, "reduce", _attr(axes=[2]), "attribute 'axes' must be distinct dims in "
                                  "[0, 2); got (2,)"),
    "fusion shapes not the operand's": (_saved_fusion, "fusion",
                                        lambda ins: ins["attrs"]["shapes"].__setitem__(1, [1, 5]),
                                        "attribute 'shapes'[1] must view operand 1 (4,)"),
    "fusion ref past its operands": (_saved_fusion, "fusion",
                                     _attr(code="t0=mul(p0,p5); t1=add(t0,c0); t2=tanh(t1); t3=mul(t2,c1)"),
                                     "refs must name operands p0..p1 and literals c0..c1; got ['p5']"),
    "operand freed earlier": (_saved, "reduce", _set(args=[2]),
                              "operands must not have been freed by an earlier instruction; got slot(s) [2]"),
    "a start's handle read by another op": (_saved_overlapped, "exp", lambda ins: ins.update(args=[3]),
                                            "a collective start's value is taken only by its done"),
    "fusion result dtype": (_saved_fusion, "fusion", _set(dtype="float64"), "the dtype must be what the fusion "
                            "rule gives"),
}


@pytest.mark.parametrize("name", sorted(RESULT_RULES))
def test_a_result_of_another_shape_or_dtype_than_its_ops_rule_is_refused(tmp_path, name):
    """Each instruction's shape and dtype are derived from its operands by its op's rule, and a donation must be
    of the result's buffer: every class of edit is refused, naming the instruction and the rule."""
    saved, op, edit, message = RESULT_RULES[name]
    doc = saved(tmp_path)
    edit(_first(doc, op))
    _write_with_hash(tmp_path, doc)
    with pytest.raises(ProgramError, match=rf"^instruction %\d+ = {op}: ") as info:
        sr.load_program(tmp_path / "p.json")
    assert message in str(info.value)


def test_an_exchange_receives_its_sharding_of_its_global_shape(tmp_path):
    """all_to_allv makes a buffer of the shape it is given: that shape must be its sharding's block of its global
    shape (a receive shape edited alone is refused)."""
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    program = sr.partition(sr.trace(lambda a: a * 1.0, x), sr.Mesh((2, 4), ("x", "y")),
                           in_specs=[sr.Sharding((("x",), ()), ("y",))], out_specs=[sr.Sharding((("y",), ()))])
    program.save(tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    _first(doc, "all_to_allv").update(shape=[16, 32])
    _write_with_hash(tmp_path, doc)
    with pytest.raises(ProgramError, match=r"^instruction %\d+ = all_to_allv: the local shape must be what the "
                                           r"all_to_allv rule gives .*, \(16, 64\); got \(16, 32\)"):
        sr.load_program(tmp_path / "p.json")

def test_the_fusion_file_unedited_loads_and_runs(tmp_path):
    """The base of the fusion edits is valid as saved (no false alarm)."""
    _saved_fusion(tmp_path)
    program = sr.load_program(tmp_path / "p.json")
    x, b = np.ones((8, 4), np.float32), np.arange(4, dtype=np.float32)
    for outs in run_simulated(2, lambda comm: sr.run(program, x.copy(), b, comm=comm)):
        np.testing.assert_allclose(outs[0], np.tanh(x * b + 1) * 2, rtol=1e-6)


def test_a_few_hundred_mutated_program_files_never_crash_the_runtime():
    """scripts/fuzz_program_files.py on the quick bases: every mutant is refused, runs, or fails with a Python
    exception; none kills its (sub)process."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "scripts"))
    from fuzz_program_files import fuzz
    counts, crashed = fuzz(400, seed=1, quick=True, hang_s=60)
    assert not crashed and counts["crashed"] == 0, (counts, crashed)
    assert counts["refused"] > 100 and counts["ran correctly"] > 20, counts

def test_a_broadcast_from_a_program_file_is_checked_by_its_kind_and_runs(tmp_path):
    """broadcast, added through the kinds table alone (collective_kinds.py and its binder in comm/collectives.py),
    is checked with its kind's attributes and runs: the all-reduce of the partial sums turned into a broadcast of
    rank 1's."""
    doc = _saved(tmp_path)
    _first(doc, "all_reduce").update(op="broadcast", attrs={"axes": ["x"], "root": 1}, donate=-1)
    _write_with_hash(tmp_path, doc)
    program = sr.load_program(tmp_path / "p.json")
    x, w = np.arange(48.0).reshape(8, 6) / 48, np.arange(24.0).reshape(6, 4) / 24
    for outs in run_simulated(2, lambda comm: sr.run(program, x, w, comm=comm)):
        np.testing.assert_allclose(outs[0], np.exp(x[4:] @ w).sum(axis=0))
    _first(doc, "broadcast")["attrs"].update(dim=0)
    _write_with_hash(tmp_path, doc)
    with pytest.raises(ProgramError, match=r"attributes must be \['axes'\] \(optional \['root'\]\); got"):
        sr.load_program(tmp_path / "p.json")


def test_keyed_hmac_authenticates_program_files(tmp_path, monkeypatch):
    doc = _saved(tmp_path)  # saved without a key
    monkeypatch.setenv("SPMD_PROGRAM_KEY", "s3cret")
    with pytest.raises(ValueError, match="must carry an HMAC made with that key; got none"):
        sr.load_program(tmp_path / "p.json")
    graph = sr.trace(lambda x: x * 2.0, sr.TensorSpec((4,), "float64"))
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x",)]).save(tmp_path / "k.json")
    assert sr.load_program(tmp_path / "k.json") is not None
    monkeypatch.setenv("SPMD_PROGRAM_KEY", "other")
    with pytest.raises(ValueError, match="got a different one"):
        sr.load_program(tmp_path / "k.json")
    del doc


def test_reduction_kernel_takes_kinds_from_an_allow_list():
    from spmd_runtime.program_check import reduction
    assert reduction(np, "max") is np.max
    with pytest.raises(ValueError, match="must be one of"):
        reduction(np, "load")


def test_tracing_errors_say_what_to_use_instead():
    def body(x):
        with pytest.raises(TypeError, match=r"float\(\) needs values.*not known while tracing.*use snp.exp"):
            float(x)
        with pytest.raises(TypeError, match=r"a NumPy function \(np.exp, np.asarray, ...\) needs values.*snp.exp"):
            np.exp(x)
        with pytest.raises(ValueError, match=r"matmul \(@\) needs the last dim of a equal to the second-to-last dim "
                                             r"of b; got shapes \(3, 4\) @ \(5, 2\)") as info:
            x @ np.ones((5, 2))
        assert "'Y'" not in str(info.value)
        return np.ones(4) * x + np.float64(2.0) * x  # NumPy operands still defer to the Tensor's operators
    graph = sr.trace(body, sr.TensorSpec((3, 4), "float64"))
    x = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(sr.evaluate(graph, x)[0], 3 * x)


@pytest.mark.parametrize("fn,name", [(np.sum, "sum"), (np.mean, "mean"), (np.concatenate, "concatenate")])
def test_a_numpy_array_function_on_a_traced_tensor_names_the_snp_function(fn, name):
    """np.sum(t) used to fail inside NumPy with "sum() got an unexpected keyword argument 'out'"."""
    arg = (lambda a: fn([a, a])) if name == "concatenate" else fn
    with pytest.raises(TypeError, match=rf"np.{name} needs values, and a traced Tensor has none: values are not "
                                        rf"known while tracing; use snp.{name} "):
        sr.trace(arg, sr.TensorSpec((4,), "float32"))
    assert sr.trace(lambda a: a * np.ndim(a) + np.size(a) + np.shape(a)[0], sr.TensorSpec((4,), "float32"))


def test_a_collective_checks_per_call_an_operand_whose_shape_the_check_does_not_derive(tmp_path, capsys):
    """take_block has no shape rule in the check: a file may state another shape for it, and the all_reduce it
    feeds (sized by that shape) then refuses the operand before MPI sees it."""
    graph = sr.trace(lambda t, i: snp.take(t, i, axis=0, mode="clip"), sr.TensorSpec((8, 4), "float64"),
                     sr.TensorSpec((3,), "int64"))
    sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x", None), None]).save(tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    _first(doc, "take_block").update(shape=[2, 4])
    _first(doc, "all_reduce").update(shape=[2, 4])
    _write_with_hash(tmp_path, doc)
    program = sr.load_program(tmp_path / "p.json")
    table, index = np.arange(32.0).reshape(8, 4), np.array([0, 5, 7])
    with pytest.raises(Exception, match="MPI_Abort"):  # a rank's error during a run ends the job, naming it
        run_simulated(2, lambda comm: sr.run(program, table, index, comm=comm))
    assert re.search(r"instruction %\d+ = all_reduce: its operand %\d+ \(take_block\) must be float64\[2, 4\] as "
                     r"the program says; got float64\[3, 4\]", capsys.readouterr().err)
