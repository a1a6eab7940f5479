"""Load statistics of the MoE layers, every step, and a plot of tokens per expert over time.

Each forward of a :class:`~plait.strategies.moe.MoE` leaves a :class:`MoEStats` in its
``last_stats``: counts are over the expert-parallel group when there is one (they come from
the counts all-gather the dispatch needs anyway: no extra communication), the losses are
this rank's. With ``pad_to_capacity=True`` there is no counts all-gather: the counts are
this rank's tokens, kept on the device by the forward and read on the host when
``last_stats`` is accessed. :func:`collect` reads them from a model; a training loop
appends the result to a list, and :func:`plot_tokens_per_expert` draws that list
(matplotlib, imported only there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn


@dataclass(frozen=True)
class MoEStats:
    """One forward of one MoE layer.

    ``tokens_per_expert``: choices each expert computed (kept); ``routed_per_expert``: choices
    the router made for it, before the capacity limit; ``dropped = sum(routed) - sum(kept)``;
    ``drop_rate = dropped / sum(routed)``; ``imbalance = max / mean`` of ``routed_per_expert``
    (1.0 is a perfectly balanced router); ``capacity``: C per group (S when dropless);
    ``aux_loss``, ``z_loss``: the unweighted soft-limit losses of this rank's tokens;
    ``rows_out``, ``rows_in``: rows this rank's dispatch all-to-all sent to and received from
    other ranks (0 without expert parallelism): the step's all-to-alls send
    ``(2 rows_out + 2 rows_in) * d_model * element_size`` bytes from this rank.
    """

    tokens_per_expert: list[int]
    routed_per_expert: list[int]
    dropped: int
    drop_rate: float
    imbalance: float
    capacity: int
    aux_loss: float
    z_loss: float
    rows_out: int = 0
    rows_in: int = 0

    @classmethod
    def of(
        cls,
        *,
        kept: list[int],
        routed: list[int],
        capacity: int,
        aux_loss: float,
        z_loss: float,
        rows_out: int = 0,
        rows_in: int = 0,
    ) -> MoEStats:
        total = sum(routed)
        dropped = total - sum(kept)
        mean = total / len(routed) if routed else 0.0
        return cls(
            tokens_per_expert=[int(k) for k in kept],
            routed_per_expert=[int(r) for r in routed],
            dropped=int(dropped),
            drop_rate=dropped / total if total else 0.0,
            imbalance=max(routed) / mean if mean else 1.0,
            capacity=capacity,
            aux_loss=aux_loss,
            z_loss=z_loss,
            rows_out=rows_out,
            rows_in=rows_in,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect(model: nn.Module) -> dict[str, MoEStats]:
    """The last forward's :class:`MoEStats` of every MoE layer of ``model``, by module path
    (layers that have not run yet are left out). Local: no communication."""
    from plait.strategies.moe.layer import moe_layers  # deferred: layer imports stats

    return {
        name: moe.last_stats
        for name, moe in moe_layers(model).items()
        if moe.last_stats is not None
    }


def plot_tokens_per_expert(
    history: Sequence[dict[str, MoEStats]], path: str | Path, *, title: str = ""
) -> Path:
    """Draw tokens per expert over training: one panel per MoE layer, one line per expert,
    the step on the x axis, plus the drop rate on a second axis. ``history[i]`` is
    :func:`collect` after step i. Writes a PNG to ``path`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("plot_tokens_per_expert: history is empty (collect() after each step)")
    layers = list(history[0])
    fig, axes = plt.subplots(
        len(layers), 1, figsize=(7, 2.6 * len(layers)), squeeze=False, sharex=True
    )
    steps = list(range(len(history)))
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        E = len(history[0][layer].tokens_per_expert)
        for e in range(E):
            ax.plot(steps, [h[layer].tokens_per_expert[e] for h in history], label=f"expert {e}")
        ax.set_ylabel("tokens")
        ax.set_title(layer, fontsize=9)
        drop = ax.twinx()
        drop.plot(steps, [h[layer].drop_rate for h in history], "k:", label="drop rate")
        drop.set_ylabel("drop rate")
        drop.set_ylim(0, 1)
        if E <= 16:
            ax.legend(fontsize=6, ncol=4, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["MoEStats", "collect", "plot_tokens_per_expert"]
