"""Meshes to test a world of n ranks on: every 1-d and 2-d factorisation, plus one with reordered devices."""
from __future__ import annotations

from itertools import permutations

from spmd_runtime.mesh import Mesh


def meshes_for(n: int) -> list[Mesh]:
    """(n,), every (a, n // a) including the size-1 axes (1, n) and (n, 1), and a device-reordered mesh.

    The reordered mesh (devices reversed) checks that shard order follows the
    mesh, not the MPI rank order.
    """
    meshes = [Mesh((n,), ("x",))]
    meshes += [Mesh((a, n // a), ("x", "y")) for a in range(1, n + 1) if n % a == 0]
    if n > 1:
        a = max(d for d in range(1, n) if n % d == 0 and d * d <= n)
        meshes.append(Mesh((a, n // a), ("x", "y"), devices=tuple(reversed(range(n)))))
    return meshes


def axes_choices(mesh: Mesh) -> list[tuple[str, ...]]:
    """Every ordered subset of the mesh axes, () included: each order is a different shard numbering."""
    return [p for r in range(len(mesh.axis_names) + 1) for p in permutations(mesh.axis_names, r)]


def splits_two_axes(shape: tuple[int, ...]) -> bool:
    """Whether the mesh splits two axes or more: the 1- to 3-rank worlds have no such mesh (2x2 at 4 ranks; 2x4, 4x2
    at 8). What the sampled stages (3, 4 and 8 ranks) keep of each case table where they have one (tests/mpi/conftest.py)."""
    return sum(s > 1 for s in shape) >= 2
