"""scripts/bench_megatron_table.py: its hand formulas against the paper's own figures, its model against eq. 2,
and a small row planned end to end (the script's rows are the published ones; the big ones are left to it)."""
import importlib.util
import math
import os

import pytest

import spmd_runtime as sr
from spmd_runtime.models.lm import param_shapes
from spmd_runtime.sharding import parse_spec
from spmd_runtime.train.plan import plan_train_step
from spmd_runtime.train.step import saves_layer_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("bench_megatron_table",
                                              os.path.join(ROOT, "scripts", "bench_megatron_table.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

# Table 1's "number of parameters (billion)" column, which eq. 2 should reproduce from the shapes
PUBLISHED_BILLIONS = {"1.7B": 1.7, "3.6B": 3.6, "7.5B": 7.5, "18B": 18.4, "39B": 39.1, "76B": 76.1, "145B": 145.6,
                      "310B": 310.1, "530B": 529.6, "1T": 1008.0}


@pytest.mark.parametrize("row", bench.TABLE1, ids=lambda r: r[0])
def test_eq2_gives_the_published_parameter_counts(row):
    name, a, h, l, t, p, gpus, batch = row
    f = bench.megatron_formulas(a, h, l, t, p, gpus // (t * p), batch, "full")
    assert f["P"] / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.03)
    assert f["M"] * (gpus // (t * p)) * bench.MICRO == batch


def test_the_benchmarked_model_has_eq2s_parameters():
    """Biases and a tied output layer: Megatron's GPT, so our count is eq. 2 plus the final LayerNorm (2 h)."""
    l, h, a, v, s = 3, 64, 4, 96, 16
    cfg = sr.LMConfig(layers=l, d=h, heads=a, ffn=4 * h, vocab=v, seq=s, batch=4, bias=True, tied=True)
    plan = plan_train_step(cfg, sr.Mesh((2, 2), ("data", "model")), "megatron")
    eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert plan.memory["params_global"] == pytest.approx(4 * (eq2 + 2 * h), abs=1e-6)


def test_a_row_prints_ours_next_to_the_formulas(capsys):
    assert bench.main(["--rows", "1.7B", "--max-ranks", "32"]) == 0
    out = capsys.readouterr().out
    assert "1.7B: l=24 h=2304 a=24  t=1 p=1 d=32 (32 ranks)" in out and "preset megatron" in out
    held = next(line for line in out.splitlines() if "params + optimizer state / rank" in line)
    assert "ratio   1.00" in held  # eq. 2 x 12 bytes (fp32 weights, Adam's m and v) on one model replica
    assert bench.main(["--rows", "1T", "--max-ranks", "32"]) == 0
    assert "skipped: 3072 ranks > --max-ranks 32" in capsys.readouterr().out
    assert bench.main(["--rows", "2T"]) == 2


def test_sequence_parallel_rows_take_korthikantis_activations_and_the_sp_presets(capsys):
    """``--sp``: Korthikanti et al.'s activations with sequence parallelism, s b h (34 + 5 a s / h) / t per layer
    (without remat) and each layer's input 2 s b h / t (full recompute); the pipeline's sends 1/t; the rows planned
    with the _sp presets, their reduce-scatters counted for the all-reduces."""
    name, a, h, l, t, p, gpus, batch = next(r for r in bench.TABLE1 if r[0] == "145B")
    d, sbh = gpus // (t * p), bench.SEQ * bench.MICRO * h
    plain, sp = (bench.megatron_formulas(a, h, l, t, p, d, batch, "none", s) for s in (False, True))
    in_flight = min(p, plain["M"])
    assert sp["peak"] - 16 * sp["P"] / (t * p) == pytest.approx(
        sbh * (34 + 5 * a * bench.SEQ / h) / t * l / p * in_flight, rel=1e-12)
    assert sp["stage"] * t == plain["stage"] and sp["model"] == plain["model"]
    full = bench.megatron_formulas(a, h, l, t, p, d, batch, "full", True)
    assert full["peak"] - 16 * full["P"] / (t * p) == pytest.approx(
        2 * sbh / t * l / p * in_flight + sbh * (34 + 5 * a * bench.SEQ / h) / t, rel=1e-12)
    assert bench.main(["--rows", "3.6B", "--sp", "--max-ranks", "64"]) == 0
    out = capsys.readouterr().out
    assert "preset megatron_sp" in out and "TP reduce-scatters of b*s*h per layer" in out


def test_rows_are_planned_with_in_place_updates_unless_told_not_to():
    """The peak formula's 16 bytes per parameter hold one copy of the weights and Adam's state (Megatron updates
    them in place), so the script donates them by default."""
    assert bench.parse_args([]).donate is True
    assert bench.parse_args(["--no-donate"]).donate is False and bench.parse_args(["--donate"]).donate is True


MEGATRON_LM = sr.LMConfig(layers=4, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, remat="full", tied=True,
                          bias=True)


@pytest.mark.parametrize("shape,m", [((2, 2, 2), 4), ((4, 1, 2), 2), ((4, 1, 2), 4), ((4, 2, 1), 4)], ids=str)
def test_pipeline_1f1b_preset_collectives_per_layer_and_one_gradient_reduction_per_step(shape, m):
    """Planned from shapes (Megatron's GPT: biases, tied embedding; full recompute), (stage, data, model):
    6 tensor-parallel all-reduces of the (b, s, h) activation per layer and tick in the layer loops (forward 2; the
    backward's recompute 2 and its 2; 5 where the stages save each layer's input and recompute layer by layer),
    over the M + S - 1 forward and backward ticks; beside them at most one for
    the embedding per forward tick and one for the head's input gradient per steady tick; every data-parallel
    reduction after the loops, once per step: their bytes are the parameters' (the tied embedding's two gradients
    reduced as one) plus the loss. (M differs from the L / S layers of a stage: the counter tells the layer loops by
    their length.)"""
    s, data, t = shape
    plan = plan_train_step(MEGATRON_LM, sr.Mesh(shape, ("stage", "data", "model")), "pipeline_1f1b", sr.AdamW(),
                           microbatches=m)
    prog = plan.step.program
    activation = MEGATRON_LM.batch // m // data * MEGATRON_LM.seq * MEGATRON_LM.d * 4
    in_layers, rest = bench.activation_all_reduces(prog, activation, MEGATRON_LM.layers // s)
    ticks = m + s - 1
    # saving each layer's input, the backward's recompute of a layer skips its last all-reduce (nothing reads it)
    per_layer = 5 if saves_layer_inputs(MEGATRON_LM, plan.step.layout, m) else 6
    assert in_layers == (per_layer * MEGATRON_LM.layers // s * ticks if t > 1 else 0)
    assert rest <= (ticks + m if t > 1 else 0)  # the embedding may all-gather its (small) table instead
    reductions = [c for c in prog.comm_summary() if c["kind"] in ("all_reduce", "reduce_scatter")
                  and "data" in c["axes"]]
    assert not [c for c in reductions if c.get("trips")]
    if data > 1:  # each gradient in the layout the model uses its weight in (the embedding's gathered over stages)
        assert sum(c["bytes_in"] for c in reductions) == used_bytes(plan.step.layout, MEGATRON_LM) + 4


def used_bytes(layout, cfg) -> int:
    """Per-rank bytes of the float32 parameters in the layouts the model uses them in."""
    shapes = param_shapes(cfg)
    return sum(4 * math.prod(parse_spec(layout.use[n], layout.mesh, len(shape)).local_shape(shape, layout.mesh))
               for n, shape in shapes.items())
