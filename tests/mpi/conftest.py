"""Shared fixtures for tests run under mpiexec (``pytest --with-mpi``).

The suite runs on whichever array backend ``SPMD_BACKEND`` selects (scripts/gpu_check.sh runs
it with ``SPMD_BACKEND=cupy``): ``sr.run`` then returns CuPy arrays, so tests compare
``spmd_runtime.exec.backend.to_host(out)`` with NumPy, never ``out`` itself.
"""
import os
import zlib

import pytest
from mpi4py import MPI

from mesh_cases import meshes_for
from spmd_runtime.exec import backend


@pytest.fixture(scope="session")
def world_meshes():
    """Every 1-d and 2-d mesh (plus a device-reordered one) for this MPI world size."""
    return meshes_for(MPI.COMM_WORLD.Get_size())


@pytest.fixture(scope="session")
def array_backend() -> str:
    """ "numpy" or "cupy": the array module ``sr.run`` uses in this run (from SPMD_BACKEND)."""
    return backend.backend_name(backend.get_array_module())


def describe_backend() -> str:
    """One line: the array backend, its GPU and whether MPI takes device buffers (shown in pytest's header)."""
    try:
        xp = backend.get_array_module()
    except (RuntimeError, ValueError) as e:  # shown, not raised: the tests report it themselves
        return f"spmd_runtime backend: unavailable ({e})"
    line = f"spmd_runtime backend: {backend.backend_name(xp)} (SPMD_BACKEND={os.environ.get('SPMD_BACKEND', '')!r})"
    if backend.backend_name(xp) == "cupy":
        from spmd_runtime.comm.gpu import cuda_aware_mpi
        transfer = "direct (CUDA-aware)" if cuda_aware_mpi() else "staged through pinned host memory"
        line += (f", {xp.cuda.runtime.getDeviceCount()} GPU(s) visible, SPMD_DEVICE="
                 f"{os.environ.get('SPMD_DEVICE', '')!r}, MPI transfers {transfer}")
    return line


def pytest_report_header(config):
    return [f"{describe_backend()}; {MPI.Get_library_version().splitlines()[0].strip()}"]


# ---- case tables at large world sizes -----------------------------------------------------------------------
# The one sampling rule of the suite (scripts/test.sh's 20-minute budget: 3 to 8 ranks share 2 cores in CI; the unit
# stage's simulated worlds run the same op tables on every mesh of 1-8 ranks, 1-d and 2-d, and test_reshard_mpi.py,
# not sampled, exchanges uneven blocks on every mesh of the world). A test
# marked ``@pytest.mark.sample_at_large_world(group=..., specific=...)`` runs its whole table below LARGE_WORLD
# ranks; at LARGE_WORLD ranks and more, of each group of its cases (``group(**params)``: e.g. one op and
# sharding on this world's several meshes; the whole table when no group is given) it runs
#   - one case, picked by a stable hash of the group: one of those ``specific(**params)`` calls something only
#     a large world has (mesh_cases.splits_two_axes: two split axes, 2x2 at 4 ranks, 2x4 / 4x2 at 8), else any one;
#   - and every other case whose stable hash (crc32 of its name) is 0 modulo SAMPLE_EVERY.
# So no group is dropped at 3, 4 or 8 ranks and every rank selects the same cases. The rest are deselected (pytest says
# how many); SPMD_FULL_TABLES=1 runs every case at every world size.
LARGE_WORLD = 3
SAMPLE_EVERY = 6
_SAMPLED = pytest.StashKey[int]()  # how many this run deselected


def pytest_configure(config):
    config.addinivalue_line("markers", f"sample_at_large_world(group=None, specific=None): at {LARGE_WORLD} "
                            f"ranks or more, one case of each group and 1 in {SAMPLE_EVERY} of the rest "
                            "(tests/mpi/conftest.py)")


def sampled_out(items, world: int) -> set:
    """The marked items a world of ``world`` ranks does not run (the rule above)."""
    if world < LARGE_WORLD or os.environ.get("SPMD_FULL_TABLES", "") not in ("", "0"):
        return set()
    groups: dict[tuple, list] = {}
    for item in items:
        mark = item.get_closest_marker("sample_at_large_world")
        if mark is None or not hasattr(item, "callspec"):
            continue
        group, name = mark.kwargs.get("group"), f"{item.module.__name__}.{item.function.__qualname__}"
        key = (name, group(**item.callspec.params) if group else "")
        groups.setdefault(key, []).append((item, mark.kwargs.get("specific")))
    out = set()
    for (name, key), members in groups.items():
        pool = [item for item, specific in members if specific and specific(**item.callspec.params)]
        pool = pool or [item for item, _ in members]
        chosen = pool[zlib.crc32(f"{name}|{key}".encode()) % len(pool)]
        out.update(item for item, _ in members
                   if item is not chosen and zlib.crc32(item.name.encode()) % SAMPLE_EVERY)
    return out


def pytest_collection_modifyitems(config, items):
    drop = sampled_out(items, MPI.COMM_WORLD.Get_size())
    if drop:
        config.hook.pytest_deselected(items=[item for item in items if item in drop])
        items[:] = [item for item in items if item not in drop]
        config.stash[_SAMPLED] = len(drop)


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(_SAMPLED, 0):
        terminalreporter.write_line(
            f"sample_at_large_world: {config.stash[_SAMPLED]} table cases deselected at "
            f"{MPI.COMM_WORLD.Get_size()} ranks (one per group + 1 in {SAMPLE_EVERY} run; "
            "SPMD_FULL_TABLES=1 runs them all)")
