"""sr.visualize_sharding: which rank holds which block, for 1-d and 2-d meshes (plain text and rich)."""
import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated

MESH_1D = sr.Mesh((4,), ("x",))
MESH_2D = sr.Mesh((2, 4), ("data", "model"))


def test_1d_mesh_uneven_vector_is_one_row():
    text = sr.visualize_sharding(sr.P("x"), MESH_1D, shape=(10,), use_rich=False, file=False)
    assert text == "\n".join([
        "[x] on Mesh(x=4), global shape [10]",
        "┌────────┬────────┬────────┬────────┐",
        "│ rank 0 │ rank 1 │ rank 2 │ rank 3 │",
        "│  0:3   │  3:6   │  6:9   │  9:10  │",
        "└────────┴────────┴────────┴────────┘"])


def test_2d_mesh_matrix_grid_and_replicated_holders():
    text = sr.visualize_sharding(sr.P("model", "data"), MESH_2D, shape=(8, 6), use_rich=False, file=False)
    assert text.splitlines()[0] == "[model, data] on Mesh(data=2, model=4), global shape [8, 6]"
    grid = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines()[2::3]]
    assert grid == [["rank 0", "rank 4"], ["rank 1", "rank 5"], ["rank 2", "rank 6"], ["rank 3", "rank 7"]]
    bounds = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines()[3::3]]
    assert bounds[0] == ["0:2, 0:3", "0:2, 3:6"] and bounds[3] == ["6:8, 0:3", "6:8, 3:6"]
    rows = sr.visualize_sharding(sr.P(None, "data"), MESH_2D, use_rich=False, file=False).splitlines()
    assert [c.strip() for c in rows[2].strip("│").split("│")] == ["ranks 0-3", "ranks 4-7"]


def test_partial_and_reordered_devices():
    mesh = sr.Mesh((2, 2), ("a", "b"), devices=(3, 2, 1, 0))
    text = sr.visualize_sharding(sr.P("a", partial="b"), mesh, use_rich=False, file=False)
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines()[2:]
             if line.startswith("│")]
    assert cells == [["ranks 2,3", "ranks 0,1"], ["Psum(b)", "Psum(b)"]]  # a 1-d array: one row


def test_darray_and_rich_output():
    rich = pytest.importorskip("rich")  # noqa: F841 - the optional [viz] extra
    x = np.arange(12.0).reshape(3, 4)

    def body(comm):
        d = sr.device_put(x, sr.P("data", "model"), MESH_2D, comm=comm)
        return sr.visualize_sharding(d, file=False)
    text = run_simulated(8, body)[0]
    assert text.splitlines()[0] == "[data, model] on Mesh(data=2, model=4), global shape [3, 4]"
    for r in range(8):
        assert f"rank {r}" in text
    assert "2:3, 3:4" in text and "┌" in text


def test_more_than_two_dims_is_refused():
    with pytest.raises(ValueError, match="draws 1-d and 2-d arrays"):
        sr.visualize_sharding(sr.P("x", None, None), MESH_1D, file=False)
