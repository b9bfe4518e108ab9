"""Live-buffer bounds of pipelined steps: every [iterations, stages, ...] buffer of the partitioned program (the
forward loop's stacked states and residuals, the backward loop's output cotangent and its stacks) is split over
the stage axis, so a rank holds its stage's share and not S times it (the GPipe backward once padded the
output cotangent into a replicated [M + S - 1, S, mb, s, h] buffer: 8 GiB at S = M = 32). Asserted on the
per-rank shapes of the partitioned program, for ``sr.pipeline`` (GPipe and circular) and the LM preset."""
import importlib.util
import os

import numpy as np
import pytest

import spmd_runtime as sr
from test_pipeline import B, D, circular_program, lm_step, program

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("pipeline_buffers",
                                                  os.path.join(ROOT, "scripts", "pipeline_buffers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def staged_values(prog, iterations: int, stages: int):
    """(global shape, local shape, sharding) of every value of ``prog`` and its loop bodies whose shape starts
    [iterations, ..., stages, ...] with the stages within the first three dims (floating values: the schedule's
    small boolean tables are replicated)."""
    out = []
    for ins in prog.instrs:
        shape = tuple(ins.global_shape)
        if len(shape) > 2 and shape[0] == iterations and stages in shape[1:3] and np.dtype(ins.dtype).kind == "f":
            out.append((shape, tuple(ins.shape), ins.sharding))
        if ins.op == "scan":
            out += staged_values(ins.attrs["body"], iterations, stages)
    return out


def assert_stage_shares(prog, mesh, iterations: int, stages: int, at_least: int):
    """Every [iterations, stages, ...] value holds 1/S of its stage dim on each rank."""
    found = staged_values(prog, iterations, stages)
    assert len(found) >= at_least, found
    for shape, local, sharding in found:
        dim = next(k for k in (1, 2) if shape[k] == stages)
        assert "stage" in sharding.dims[dim] and local[dim] * mesh.axis_size("stage") == stages, (shape, sharding)


@pytest.mark.parametrize("shape,axes", [((4,), ("stage",)), ((4, 2), ("stage", "data"))], ids=str)
def test_gpipe_output_cotangent_and_stacks_hold_one_stage_per_rank(shape, axes):
    mesh = sr.Mesh(shape, axes)
    S, M = 4, 3
    _, prog, _ = program(mesh, microbatches=M)
    # the forward's stacked states, its residual stacks and the backward's output cotangent [M + S - 1, S, B, D]
    assert_stage_shares(prog, mesh, M + S - 1, S, at_least=3)
    cotangent = [v for v in staged_values(prog, M + S - 1, S) if v[0] == (M + S - 1, S, B, D)]
    assert cotangent and all(local == (M + S - 1, 1, B, D) for _, local, _ in cotangent)


def test_circular_output_cotangent_holds_one_stage_per_rank():
    mesh = sr.Mesh((4,), ("stage",))  # 4 devices, 8 stages (2 rounds), 4 micro-batches of B = 2 rows
    v, m = 8, 4
    _, prog, _ = circular_program(mesh, v, m)
    t = m * (v // 4) + 4 - 1
    assert_stage_shares(prog, mesh, t, 4, at_least=3)


def test_lm_pipeline_preset_buffers_hold_one_stage_per_rank():
    """The LM preset on (stage=4, data=2), 4 micro-batches: every loop buffer with a stage dim is split over it,
    the largest per-rank buffer of the step is at most one stage's share of the [M + S - 1, S, ...] stacks, and
    the script's listing (scripts/pipeline_buffers.py) names the forward and backward loops' buffers."""
    S, M = 4, 4
    ts = lm_step((S, 2), M)
    assert_stage_shares(ts.program, ts.mesh, M + S - 1, S, at_least=10)
    script = load_script()
    buffers = script.loop_buffers(ts.program)
    assert {b["role"] for b in buffers} == {"carry", "xs", "ys"}
    assert any("reverse" in b["where"] for b in buffers)
    # a stacked buffer with a stage dim: at most its stage's share, whichever loop holds it
    for b in buffers:
        if len(b["shape"]) > 2 and S in b["shape"][1:3]:
            dim = 1 if b["shape"][1] == S else 2
            assert "stage" in b["sharding"].dims[dim], b


def test_pipeline_buffers_script_prints_the_listing(capsys):
    load_script().main(["--stages", "2", "--microbatches", "2", "--d", "16", "--seq", "4"])
    out = capsys.readouterr().out
    assert "loop buffers per rank" in out and "reverse" in out and "peak bytes per rank" in out
    assert np.all([("stage" in line) for line in out.splitlines() if "(3, 2," in line])


@pytest.mark.parametrize("preset", ["pipeline", "pipeline_1f1b"])
def test_embedding_and_head_split_over_the_stages_not_repeated_on_each(preset):
    """(stage=2, data=2, model=2), 2 micro-batches of 4 rows. GPipe: outside the pipeline loop the batch rows are
    split over (data, stage), so the embedding, the logits and the loss of the whole batch are computed once, not
    once per stage; the pipeline's output reaches that layout by an all_to_all over the stages, never an all-reduce
    of the whole batch's residual over them. 1F1B: the embedding and the head run per micro-batch in the loops, each
    stage on its own micro-batch, so no whole-batch residual or logits exist and nothing of a residual's size is
    all-reduced over the stages."""
    from test_pipeline import LM
    ts = lm_step((2, 2, 2), 2) if preset == "pipeline" else \
        sr.build_train_step(LM, sr.train_mesh((2, 2, 2), preset), preset, sr.AdamW(lr=1e-2), microbatches=2)
    whole = [i for i in ts.program.instrs if tuple(i.global_shape) in ((LM.batch, LM.seq, LM.vocab),
                                                                      (LM.batch, LM.seq, LM.d))]
    residual = LM.batch * LM.seq * LM.d * 8 // 2  # the whole batch's residual on one data shard
    if preset == "pipeline_1f1b":  # embedding and head per micro-batch inside the loops: no whole-batch value,
        assert not whole, [(i.op, i.shape) for i in whole]  # no stage all-reduce of any micro-batch's residual
        assert not [c for c in ts.program.comm_summary() if c["kind"] == "all_reduce" and "stage" in c["axes"]
                    and c["bytes_in"] >= residual // 2]
        return
    # the whole batch's logits and residual exist only outside the loop
    assert whole and all(i.shape[0] == LM.batch // 4 for i in whole), [(i.op, i.shape) for i in whole]
    outside = [c for c in ts.program.comm_summary() if not c.get("trips")]
    assert not [c for c in outside if c["kind"] == "all_reduce" and c["axes"] == ("stage",)
                and c["bytes_in"] >= residual]
    assert any(c["kind"] == "all_to_all" and c["axes"] == ("stage",) for c in outside)
