"""``sr.visualize_sharding``: a terminal grid of which rank holds which block (``jax.debug.visualize_array_sharding``).

One cell per block of a 1-d or 2-d array (rows: the shards of dim 0, columns:
the shards of dim 1); each cell lists the ranks that hold it and its global
index range. Partial sums are marked. Uses ``rich`` when it is installed
(``pip install spmd_runtime[viz]``) and plain box-drawing text otherwise.
"""
from __future__ import annotations

import itertools

try:  # optional: the viz extra
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
except ImportError:
    Console = escape = Table = None

from .comm.simulated import is_lead_rank
from .darray import DArray
from .mesh import Mesh, get_mesh
from .sharding import Sharding, block_bounds, parse_spec


def visualize_sharding(x, mesh: Mesh | None = None, shape=None, use_rich: bool | None = None,
                       file=None) -> str:
    """Print and return the grid for ``x``: to ``file`` when given (``file=False``: print nothing), else to
    stdout on rank 0 only (every rank lays out the same picture).

    ``x``: a DArray, or a Sharding / ``P`` spec with ``mesh`` (default: the
    context mesh) and optionally the global ``shape`` (then cells show index
    ranges). No communication.
    """
    sharding, mesh, shape = _layout(x, mesh, shape)
    if sharding.ndim > 2:
        raise ValueError(f"visualize_sharding draws 1-d and 2-d arrays (as JAX does); got a {sharding.ndim}-d "
                         f"layout {sharding} (reshape to 2-d to inspect it)")
    rows, cols = _grid(sharding, mesh, shape)
    title = f"{sharding} on {mesh}" + (f", global shape {list(shape)}" if shape is not None else "")
    text = _rich(rows, cols, title) if _want_rich(use_rich) else _plain(rows, cols, title)
    if file is not False and (file is not None or is_lead_rank()):
        print(text, file=file)
    return text


def _layout(x, mesh, shape):
    if isinstance(x, DArray):
        return x.sharding, x.mesh, x.shape
    mesh = mesh if mesh is not None else get_mesh(required_by="visualize_sharding of a spec")
    if isinstance(x, Sharding):
        return x, mesh, None if shape is None else tuple(shape)
    ndim = len(shape) if shape is not None else len(tuple(x))
    return parse_spec(x, mesh, ndim, "visualize_sharding"), mesh, None if shape is None else tuple(shape)


def _grid(sharding: Sharding, mesh: Mesh, shape):
    """A list of rows, each a list of cell texts (lines), and the column count. A 1-d array is one row."""
    dims = [(), sharding.dims[0]] if sharding.ndim == 1 else list(sharding.dims) + [()] * (2 - sharding.ndim)
    counts = [mesh.axis_size(d) for d in dims]
    holders: dict = {}
    for rank in sorted(mesh.devices):
        holders.setdefault(tuple(mesh.index_along(rank, d) for d in dims), []).append(rank)
    rows = []
    for i in range(counts[0]):
        row = []
        for j in range(counts[1]):
            lines = [_ranks(holders[(i, j)])]
            if shape is not None:
                index = (j,) if sharding.ndim == 1 else (i, j)[:len(shape)]
                bounds = [block_bounds(n, mesh.axis_size(d), b) for n, d, b in zip(shape, sharding.dims, index)]
                lines.append(", ".join(f"{a}:{b}" for a, b in bounds) if bounds else "scalar")
            if sharding.partial:
                lines.append(f"P{sharding.reduce_op}({','.join(sharding.partial)})")
            row.append(lines)
        rows.append(row)
    return rows, counts[1]


def _ranks(ranks) -> str:
    """"rank 3" or "ranks 0-3" / "ranks 0,2,4": the holders of one block."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs = []
    for _, group in itertools.groupby(enumerate(ranks), lambda p: p[1] - p[0]):
        g = [r for _, r in group]
        runs.append(f"{g[0]}-{g[-1]}" if len(g) > 2 else ",".join(map(str, g)))
    return "ranks " + ",".join(runs)


def _want_rich(use_rich) -> bool:
    if use_rich is False:
        return False
    if Table is None:
        if use_rich:
            raise ImportError("visualize_sharding(use_rich=True) needs rich: pip install 'spmd_runtime[viz]'; "
                              "got no rich module") from None
        return False
    return True


def _plain(rows, ncols, title) -> str:
    width = max(len(line) for row in rows for cell in row for line in cell) + 2
    height = max(len(cell) for row in rows for cell in row)
    rule = lambda left, mid, right: left + mid.join(["─" * width] * ncols) + right  # noqa: E731
    out = [title, rule("┌", "┬", "┐")]
    for k, row in enumerate(rows):
        for line in range(height):
            texts = [(cell[line] if line < len(cell) else "").center(width) for cell in row]
            out.append("│" + "│".join(texts) + "│")
        out.append(rule("├", "┼", "┤") if k < len(rows) - 1 else rule("└", "┴", "┘"))
    return "\n".join(out)


def _rich(rows, ncols, title) -> str:
    table = Table(show_header=False, show_lines=True)
    for _ in range(ncols):
        table.add_column(justify="center")
    for row in rows:
        table.add_row(*[escape("\n".join(cell)) for cell in row])
    console = Console(width=max(len(title) + 4, ncols * 24), force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return title + "\n" + capture.get().rstrip("\n")
