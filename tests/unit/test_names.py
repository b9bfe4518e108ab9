"""The user's names (parameters, pytree paths, mesh_split(name=...)) in listings, reports, notes and errors;
partitioner notes printed once per job, not once per rank."""
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated

MESH = sr.Mesh((2, 4), ("data", "model"))


def swap(x):
    return sr.mesh_split(sr.mesh_split(x, MESH, sr.P("data", "model"), name="before"), MESH,
                         sr.P("model", "data"), name="after")


def wide_halo(x, k):  # a halo wider than the other shards: the conv rule falls back to replicated with a note
    return snp.conv(sr.mesh_split(x, sr.Mesh((4,), ("x",)), sr.P(None, None, "x"), name="signal"), k, 1, ((4, 4),))


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_names_in_listing_report_and_notes():
    program = sr.partition(sr.trace(lambda params: swap(params["x"]), {"x": sr.TensorSpec((8, 8))}), MESH)
    listing = str(program)
    assert "%0 params.x: float32[8,8]" in listing and listing.count("# after") == 1
    assert program.report["after"] == (sr.Sharding((("model",), ("data",))), "user")
    assert program.report["params.x"][1] == "propagated"
    assert "%1 before: [data, model] (user)" in str(program.report)
    noted = sr.partition(sr.trace(wide_halo, sr.TensorSpec((2, 3, 4)), sr.TensorSpec((4, 3, 9))),
                         sr.Mesh((4,), ("x",)))
    assert noted.notes and all(n.startswith("at tensor %3 = conv float32[2, 4, 4] of %2 ('signal'), %1 ('k'): ")
                               for n in noted.notes), noted.notes
    with pytest.raises(KeyError, match="indexed by value id or by a name in"):
        program.report["nope"]


@pytest.mark.filterwarnings("ignore:spmd_runtime partitioner")
def test_names_survive_save_and_load(tmp_path):
    program = sr.partition(sr.trace(swap, sr.TensorSpec((8, 8))), MESH)
    program.save(tmp_path / "p.json")
    assert "# after" in str(sr.load_program(tmp_path / "p.json"))
    unnamed = sr.partition(sr.trace(lambda x: x * 2.0, sr.TensorSpec((8,))), MESH)
    assert "names" not in unnamed.body()  # programs without names keep their old hash


def test_errors_name_the_value():
    def bad(x):
        return sr.mesh_split(x, MESH, sr.P("data", "model", "data"), name="acts")
    with pytest.raises(ValueError, match=r"tensor %0 'acts' float32\[8, 8\]"):
        sr.trace(bad, sr.TensorSpec((8, 8)))


def test_notes_warn_once_per_job_not_once_per_rank():
    graph = sr.trace(wide_halo, sr.TensorSpec((2, 3, 4)), sr.TensorSpec((4, 3, 9)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        programs = run_simulated(4, lambda comm: sr.partition(graph, sr.Mesh((4,), ("x",))))
    notes = programs[0].notes
    assert notes and all(p.notes == notes for p in programs)  # every rank keeps them in program.notes
    mine = [w for w in caught if "spmd_runtime partitioner" in str(w.message)]
    assert len(mine) == len(notes)  # printed by rank 0 only
