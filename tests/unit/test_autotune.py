"""sr.autotune's choice of what to time (spmd_runtime/autotune.py) and its refusals; the timing itself runs under
MPI (tests/mpi/test_autotune_mpi.py)."""
import pytest

import spmd_runtime as sr
from spmd_runtime.autoshard import Candidate
from spmd_runtime.autotune import front_runners

CFG = sr.LMConfig(1, 32, 2, 64, 64, 16, 4)


def _c(preset, shape, step_ms, fits=True):
    return Candidate(preset, shape, step_s=step_ms / 1e3, peak_bytes=1, fits=fits)


def test_the_best_predicted_fitting_layout_of_each_preset_is_timed_in_predicted_order():
    found = [_c("megatron", (1, 2), 9.0), _c("dp", (2,), 7.0), _c("megatron", (2, 1), 5.0),
             _c("fsdp", (2,), 3.0, fits=False), _c("wus", (2,), 8.0), Candidate("seq", (2,), error="refused")]
    picks = front_runners(found, limit=8)
    assert [(c.preset, c.mesh_shape) for c in picks] == [("megatron", (2, 1)), ("dp", (2,)), ("wus", (2,))]
    assert [c.preset for c in front_runners(found, limit=2)] == ["megatron", "dp"]


def test_nothing_to_time_or_a_mesh_of_another_size_is_refused_naming_the_values():
    with pytest.raises(ValueError, match="needs a candidate that fits; got none among 1"):
        front_runners([_c("dp", (2,), 1.0, fits=False)], 8)
    with pytest.raises(ValueError, match="at least one candidate; got limit=0"):
        front_runners([_c("dp", (2,), 1.0)], 0)
    with pytest.raises(ValueError, match=r"meshes must have 1 devices; got \[4\] \(run it under mpiexec -n"):
        sr.autotune([_c("dp", (4,), 1.0)], CFG)  # this process is a world of one rank
    with pytest.raises(ValueError, match="at least 1 round and 1 step.*got rounds=0"):
        sr.autotune([_c("dp", (1,), 1.0)], CFG, rounds=0)


def test_the_cli_times_the_front_runners_after_the_prediction(capsys):
    from spmd_runtime.__main__ import main
    small = ["--layers", "1", "--d", "32", "--heads", "2", "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch", "4"]
    assert main(["autoshard", "--devices", "1", "--hardware", "dgx-h100", "--presets", "dp,fsdp", "--measure", "2",
                 *small]) == 0
    out = capsys.readouterr().out
    assert "autoshard on dgx-h100" in out and "autotune: 2 layouts timed, fastest measured first" in out
    assert main(["autoshard", "--devices", "2", "--hardware", "dgx-h100", "--presets", "dp", "--measure", "1",
                 *small]) == 2  # a job of one rank cannot time layouts of two
    assert "meshes must have 1 devices; got [2]" in capsys.readouterr().err
