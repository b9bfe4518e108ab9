"""Pictures of a training run: the loss curve and the per-rank compute/communication split of a step.

matplotlib is an optional extra (``pip install 'spmd_runtime[viz]'``): without it each function prints
one line saying so and returns None, so a demo never fails for want of a plotting library.
"""
from __future__ import annotations

from pathlib import Path

try:  # optional: the viz extra
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as _plt
except ImportError:
    _plt = None


def _pyplot(what: str):
    if _plt is None:
        print(f"skipping {what}: matplotlib is not installed (pip install 'spmd_runtime[viz]')")
    return _plt


def loss_curve_png(path, losses, reference=None, title: str = "training loss") -> Path | None:
    """Loss per step (and the unpartitioned reference run, when given) as a PNG."""
    plt = _pyplot(f"the loss curve {path}")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(range(1, len(losses) + 1), losses, label="SPMD run", lw=1.6)
    if reference is not None:
        ax.plot(range(1, len(reference) + 1), reference, "--", label="1-process reference", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def step_breakdown_png(path, breakdown: dict, title: str = "time per step") -> Path | None:
    """A stacked bar per rank: compute and communication milliseconds per step, from
    ``spmd_runtime.profile.step_breakdown(DIR)``."""
    plt = _pyplot(f"the step breakdown {path}")
    if plt is None:
        return None
    ranks = sorted(breakdown)
    per_step = [max(breakdown[r]["runs"], 1) for r in ranks]
    comp = [breakdown[r]["compute"] / n for r, n in zip(ranks, per_step)]
    comm = [breakdown[r]["comm"] / n for r, n in zip(ranks, per_step)]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.bar([str(r) for r in ranks], comp, label="compute")
    ax.bar([str(r) for r in ranks], comm, bottom=comp, label="communication (MPI)")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return _save(fig, plt, path)


def _save(fig, plt, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
