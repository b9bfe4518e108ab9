"""SPMDProgram: listing, comm summary formulas, peak memory, save/load with version and hash checks."""
import json

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.program_check import ProgramError, check_program

MESH = sr.Mesh((2, 4), ("data", "model"))


def mlp_program(donate=()):
    graph = sr.trace(lambda x, w1, w2: snp.tanh(x @ w1) @ w2, sr.TensorSpec((8, 16), "float32"),
                     sr.TensorSpec((16, 32), "float32"), sr.TensorSpec((32, 16), "float32"))
    return sr.partition(graph, MESH, in_specs=[("data", None), (None, "model"), ("model", None)], donate=donate)


def test_listing_shows_local_shapes_shardings_and_collectives():
    text = str(mlp_program())
    assert "x: float32[8,16] [data, R]" in text  # inputs: global shape and sharding
    # local shape; "!": the dying partial sum is reduced in place (MPI.IN_PLACE)
    assert "all_reduce(%5!, axes=(model), op=sum) : float32[4,16] [data, R]" in text
    assert "Psum(model)" in text


def test_comm_summary_keys_and_wire_bytes():
    (c,) = mlp_program().comm_summary()
    assert c == {"kind": "all_reduce", "axes": ("model",), "group_size": 4, "bytes_in": 4 * 16 * 4,
                 "bytes_out": 4 * 16 * 4, "wire_bytes": 2 * 3 / 4 * 256,
                 "predicted_s": pytest.approx(2 * 3 / 4 * 256 * 1e-10)}  # the default model's 10 GB/s link
    assert mlp_program().wire_bytes == c["wire_bytes"]


def test_buffers_are_freed_after_last_use():
    program = mlp_program()
    freed = [s for i in program.instrs for s in i.free]
    outputs = {o.slot for o in program.outputs}
    assert sorted(freed) == sorted(i.out for i in program.instrs if i.out not in outputs)
    # local float32 inputs: x 4x16 (256 B), w1 16x8 (512 B), w2 8x16 (512 B) = 1280 B, held by the caller for
    # the whole run; the first einsum's 4x8 result (128 B), tanh'd in place, and the second's 4x16 partial
    # (256 B), all-reduced in place, are alive at once.
    assert program.peak_bytes() == 1280 + 128 + 256
    # donated inputs die at their last use: x and w1 at the first einsum, before the partial exists
    assert mlp_program(donate=(0, 1, 2)).peak_bytes() == 1280 + 128


def test_peak_breakdown_lists_what_is_live_at_the_peak():
    # the peak of test_buffers_are_freed_after_last_use: the three inputs, the tanh'd einsum, the partial
    found = mlp_program().peak_breakdown()
    assert [b.nbytes for b in found] == [512, 512, 256, 256, 128]
    assert {b.what for b in found if b.what.startswith("input")} == {"input x", "input w1", "input w2"}
    assert "float32[4,8]" in [b.type for b in found] and all(b.where == "" for b in found)
    assert [b.nbytes for b in mlp_program().peak_breakdown(top=2)] == [512, 512]
    # donated inputs die at their last use: the breakdown still sums to the peak
    assert sum(b.nbytes for b in mlp_program(donate=(0, 1, 2)).peak_breakdown()) == 1280 + 128


def ring_program():
    """A scan that writes each step's row into a carried buffer (a saved-input ring) and stacks its sums; its
peak is inside the loop (a [64, 64] temporary)."""
    def f(ring, xs):
        def body(buf, x_i):
            row, i = x_i
            square = snp.tanh(snp.expand_dims(row, 1) * snp.expand_dims(row, 0))  # [64, 64]: the loop's peak
            y = snp.sum(square, axis=0)
            return snp.dynamic_update_slice(buf, snp.expand_dims(y, 0), [i, 0]), snp.sum(y)
        return sr.scan(body, ring, (xs, snp.arange(4)))
    graph = sr.trace(f, sr.TensorSpec((4, 64), "float32"), sr.TensorSpec((4, 64), "float32"))
    return sr.partition(graph, sr.Mesh((1,), ("x",)), in_specs=[(None, None), (None, None)]), f


def test_peak_breakdown_inside_a_loop_sums_to_the_peak_and_names_the_loop():
    program, _ = ring_program()
    found = program.peak_breakdown()
    assert sum(b.nbytes for b in found) == program.peak_bytes()
    inside = [b for b in found if b.where]
    assert inside and all(" scan > " in b.where for b in inside)
    assert any(b.what == "stacked ys" and b.nbytes == 4 * 4 for b in inside)  # 4 float32 sums


def test_a_carried_buffer_updated_slot_by_slot_is_written_in_place_and_computes_the_same():
    program, f = ring_program()
    (scan_ins,) = [i for i in program.instrs if i.op == "scan"]
    body = scan_ins.attrs["body"]
    (dus,) = [i for i in body.instrs if i.op == "dynamic_update_slice"]
    assert dus.donate == 0 and 0 in body.written_inputs  # into the carry's own buffer, not a copy of it
    # the body holds no second ring: its peak beyond its inputs is below one ring (4 x 64 float32)
    assert body.peak_bytes() - sum(body.input_bytes()) < 4 * 64 * 4 + 64 * 64 * 4
    rng = np.random.default_rng(0)
    ring, xs = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    before = ring.copy()
    got = sr.run(program, ring, xs)
    want = sr.evaluate(sr.trace(f, ring, xs), ring, xs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(ring, before)  # the caller's array is never written (the loop's own copy)


def test_a_saved_program_keeps_its_in_place_update_and_refuses_a_bad_one(tmp_path):
    program, f = ring_program()
    program.save(tmp_path / "ring.json")
    loaded = sr.load_program(tmp_path / "ring.json")
    assert loaded.hash == program.hash and "dynamic_update_slice(%" in str(loaded) and "!, %" in str(loaded)
    body = next(i for i in loaded.instrs if i.op == "scan").attrs["body"]
    k = next(k for k, i in enumerate(body.instrs) if i.op == "dynamic_update_slice")
    check_program(body)
    dus = body.instrs[k]  # its result larger than the buffer it is written into
    body.instrs[k] = dus.copy(shape=(dus.shape[0] + 1,) + dus.shape[1:])
    with pytest.raises(ProgramError, match="dynamic_update_slice rule"):
        check_program(body)


def test_save_load_roundtrip_keeps_hash_and_text(tmp_path):
    program = mlp_program()
    path = tmp_path / "p.json"
    program.save(path)
    loaded = sr.load_program(path)
    assert loaded.hash == program.hash and str(loaded) == str(program)
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["format"] == "spmd_runtime.program"


def test_constants_survive_save_exactly(tmp_path):
    c = np.random.default_rng(0).standard_normal(24)
    # a float64 program: with a float32 x the constant is float32 (JAX's promotion: a NumPy operand is 32-bit)
    program = sr.partition(sr.trace(lambda x: x + c, sr.TensorSpec((24,), "float64")), sr.Mesh((4,), ("x",)),
                           in_specs=[("x",)])
    program.save(tmp_path / "p.json")
    (const,) = [i for i in sr.load_program(tmp_path / "p.json").instrs if i.op == "constant"]
    np.testing.assert_array_equal(const.attrs["value"], c)


def test_edited_program_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    mlp_program().save(path)
    doc = json.loads(path.read_text())
    doc["instrs"][-1]["attrs"]["op"] = "max"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="must match its hash"):
        sr.load_program(path)


def test_other_version_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    mlp_program().save(path)
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 1; got 'spmd_runtime.program' version 99"):
        sr.load_program(path)


def test_complex_inputs_and_constants_save_load_and_run(tmp_path):
    """Complex arrays (.npy in base64) and complex literals ({"complex": [re, im]}) round-trip exactly and run."""
    from spmd_runtime.comm import run_simulated
    x = (np.arange(8) + 1j * np.arange(8)).astype(np.complex128)
    table = np.array([1j, 2, 3, 4, 5, 6, 7, 8j])
    graph = sr.trace(lambda a: a * np.complex128(2 + 1j) + snp.asarray(table), x)
    program = sr.partition(graph, sr.Mesh((2,), ("x",)), in_specs=[("x",)])
    program.save(tmp_path / "p.json")
    fusion = next(i for i in json.loads((tmp_path / "p.json").read_text())["instrs"] if i["op"] == "fusion")
    assert fusion["attrs"]["consts"] == [[{"complex": [2.0, 1.0]}, "complex128"]]
    loaded = sr.load_program(tmp_path / "p.json")
    assert loaded.hash == program.hash
    for outs in run_simulated(2, lambda comm: sr.run(loaded, x, comm=comm)):
        np.testing.assert_array_equal(outs[0], x * (2 + 1j) + table)


def test_an_attribute_json_has_no_form_for_is_refused_naming_it(tmp_path):
    program = mlp_program()
    program.instrs[-1].attrs["extra"] = object()
    program.__dict__.pop("_hash", None)
    with pytest.raises(TypeError, match=r"not supported: object <object object at"):
        program.save(tmp_path / "p.json")
