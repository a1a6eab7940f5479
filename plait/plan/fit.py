"""``plait plan fit``: will it fit, per layout, with the headroom; the memory breakdown per
rank as data, as a table and as a PNG bar chart (matplotlib, optional).

The breakdown of a layout's largest rank (the pipeline rank whose own parts sum to the
most; ``rank``), in bytes (:class:`MemoryBreakdown`)::

    parameters + gradients + optimizer states      plait.plan.states (the ZeRO paper)
    + activations                                  plait.plan.activations (Korthikanti)
    + communication buffers                        plait.plan.buffers
    = needed;  usable = device memory - fragmentation margin (Cluster.memory_reserve)
    headroom = usable - needed   (fits: headroom >= 0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.plan.hardware import Cluster
from plait.plan.search import Plan

GB = 1e9
PARTS = (
    "parameters",
    "gradients",
    "optimizer states",
    "activations",
    "communication buffers",
)


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory (module doc); bytes."""

    layout: str
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    communication_buffers: float
    fragmentation_margin: float
    device: float
    needed: float
    headroom: float
    fits: bool
    rank: int = 0  # the pipeline rank these parts are of

    def parts(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            ("activations", self.activations),
            ("communication buffers", self.communication_buffers),
        ]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def breakdown(plan: Plan, cluster: Cluster) -> MemoryBreakdown:
    st = plan.states
    return MemoryBreakdown(
        layout=plan.layout.label(),
        parameters=st.params_bytes,
        gradients=st.grads_bytes,
        optimizer_states=st.optimizer_bytes,
        activations=plan.activations.total,
        communication_buffers=plan.buffers,
        fragmentation_margin=cluster.memory_bytes - plan.usable_bytes,
        device=cluster.memory_bytes,
        needed=plan.memory_bytes,
        headroom=plan.headroom,
        fits=plan.fits,
        rank=plan.rank,
    )


def format_fit(rows: list[MemoryBreakdown]) -> str:
    """One line per layout: yes/no, headroom, and the breakdown in GB."""
    head = (
        f"{'fits':<5}{'headroom':>11}  {'layout':<50}{'rank':>5}{'params':>8}{'grads':>8}"
        f"{'optim':>8}"
        f"{'activ.':>8}{'buffers':>9}{'needed':>9}{'usable':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{'yes' if r.fits else 'no':<5}{r.headroom / GB:>+8.2f} GB  {r.layout:<50}"
            f"{r.rank:>5}{r.parameters / GB:>8.2f}{r.gradients / GB:>8.2f}"
            f"{r.optimizer_states / GB:>8.2f}"
            f"{r.activations / GB:>8.2f}{r.communication_buffers / GB:>9.2f}"
            f"{r.needed / GB:>9.2f}{(r.device - r.fragmentation_margin) / GB:>9.2f}"
        )
    lines.append(
        "GB per rank (the largest rank of each layout: its pipeline rank, its own parts); "
        "usable = device memory less the fragmentation margin"
    )
    return "\n".join(lines)


def plot(rows: list[MemoryBreakdown], path: str, *, title: str = "") -> str:
    """A stacked bar per layout (its largest rank), the device and usable lines; PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from e
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows) + 3), 5))
    xs = range(len(rows))
    bottom = [0.0] * len(rows)
    for i, name in enumerate(PARTS):
        vals = [r.parts()[i][1] / GB for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if rows:
        device = rows[0].device / GB
        usable = device - rows[0].fragmentation_margin / GB
        ax.axhline(device, color="black", linewidth=1, label="device memory")
        ax.axhline(
            usable,
            color="black",
            linestyle="--",
            linewidth=1,
            label="usable (less fragmentation margin)",
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.layout for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB per rank (largest rank)")
    ax.set_title(title or "memory per rank")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["MemoryBreakdown", "PARTS", "breakdown", "format_fit", "plot"]
