"""A schedule as a text table (rank x time step) and as a timeline picture (PNG).

:func:`table` prints the compute actions of each rank in simulated time with unit costs
(F and I and W one step, B two), so the staircase of the fill and the drain shows::

    rank 0 | 0F0 0F1 0F2 0F3  .   .   .  0B0 0B0 ...

:func:`draw_png` draws slots (simulated, or measured by the runtime's tracer) with
matplotlib: one row per rank, forwards blue, backwards (B, I) green, weight gradients W
orange, the micro-batch written in each box.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.strategies.pipeline.actions import Kind, Schedule
from plait.strategies.pipeline.simulate import Costs, Slot, run

_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#f28e2b"}


def table(sched: Schedule, *, costs: Costs | None = None, width: int = 5) -> str:
    """Rank x time-step table; each column is one unit of time (an idle one is ``.``)."""
    c = costs or Costs(f=1, b=2, i=1, w=1)
    slots = run(sched, c)
    unit = min((s.end - s.start for s in slots if s.end > s.start), default=1.0)
    steps = round(max((s.end for s in slots), default=0.0) / unit)
    grid = [["." for _ in range(steps)] for _ in range(sched.p)]
    for s in slots:
        for t in range(round(s.start / unit), round(s.end / unit)):
            grid[s.rank][t] = str(s.action)
    head = f"{sched.name}: p={sched.p} m={sched.m} v={sched.v} (time steps of {unit:g})"
    lines = [head]
    for r, row in enumerate(grid):
        lines.append(f"rank {r} | " + " ".join(cell.ljust(width) for cell in row).rstrip())
    return "\n".join(lines)


def draw_png(
    slots: Sequence[Slot], path: str, *, p: int, title: str = "", unit: str = "time"
) -> str:
    """Draw ``slots`` (from :func:`~.simulate.simulate` or measured) to ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.2))
    for s in slots:
        kind = s.action.kind
        if not kind.is_compute:
            continue
        ax.barh(
            s.rank,
            s.end - s.start,
            left=s.start,
            color=_COLOURS[kind.value],
            edgecolor="white",
            linewidth=0.5,
        )
        label = f"{s.action.mb}" if kind is not Kind.W else f"w{s.action.mb}"
        ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
