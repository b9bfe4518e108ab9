"""scripts/bench_megatron_table.py: its hand formulas against the paper's own figures, its model against eq. 2,
and a small row planned end to end (the script's rows are the published ones; the big ones are left to it)."""
import importlib.util
import os

import pytest

import spmd_runtime as sr
from spmd_runtime.train.plan import plan_train_step

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
