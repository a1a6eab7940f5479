"""The tour's pictures (matplotlib, written as PNG files).

- :func:`timeline_png`: one training step as the tracer saw it, a screenshot-like view of
  ``trace.json``: two lanes per rank, compute (forward, backward, optimizer step) above and
  communication (each collective from launch to completion) below;
- :func:`tour_png`: the reference's loss against step, each layout's continuation against
  step and against wall time, and bars of parameter memory and bytes sent per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.trace import Span

_COMPUTE = {"forward": "#4e79a7", "backward": "#59a14f", "optimizer step": "#9c9c9c"}
# a pipeline's actions: F a micro-batch's forward, B its backward (I, W: its halves)
_ALIASES = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}
_COMM = "#f28e2b"
_OTHER = "#b07aa1"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(spans: Sequence[Span], path: Path, *, title: str) -> Path:
    """Draw ``spans`` (every rank's, one step) to ``path``: rank r's compute lane at
    y = 2r, its communication lane at 2r + 1, time in milliseconds from the first span."""
    plt = _pyplot()
    origin = min(s.start_ns for s in spans)
    ranks = sorted({s.rank for s in spans})
    fig, ax = plt.subplots(figsize=(11, 0.8 * len(ranks) + 1.6))
    for s in spans:
        lane = 2 * ranks.index(s.rank) + (0 if s.stream == "compute" else 1)
        colour = (
            _COMPUTE.get(_ALIASES.get(s.name, s.name), _OTHER) if s.stream == "compute" else _COMM
        )
        left, width = (s.start_ns - origin) / 1e6, s.duration_ns / 1e6
        ax.barh(lane, width, left=left, height=0.8, color=colour, edgecolor="white", lw=0.4)
    end = max(s.end_ns for s in spans)
    named: list[Span] = []
    for s in sorted(spans, key=lambda s: -s.duration_ns):  # names where they fit, outermost
        width = s.duration_ns / 1e6
        inside = any(
            o.rank == s.rank and o.stream == s.stream and o.start_ns <= s.start_ns
            and s.end_ns <= o.end_ns for o in named
        )  # fmt: skip
        if width > 0.06 * (end - origin) / 1e6 and not inside:
            named.append(s)
            lane = 2 * ranks.index(s.rank) + (0 if s.stream == "compute" else 1)
            ax.text(
                (s.start_ns - origin) / 1e6 + width / 2, lane, s.name[:18], ha="center",
                va="center", fontsize=6, color="white",
            )  # fmt: skip
    ax.set_yticks(range(2 * len(ranks)))
    ax.set_yticklabels([f"rank {r} {lane}" for r in ranks for lane in ("compute", "comm")])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the step began")
    ax.set_title(title, fontsize=10)
    colours = (*_COMPUTE.values(), _OTHER, _COMM)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours]
    names = [*_COMPUTE, "other (e.g. waiting for gradients)", "communication"]
    ax.legend(handles, names, fontsize=7, loc="lower right", ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: the wall-time panel plots the running mean of this many steps (each step's batch differs)
WALL_MEAN = 5


def _smooth(values: Sequence[float], k: int) -> list[float]:
    """Running mean over the last ``k`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def tour_png(
    path: Path,
    *,
    reference: Any,
    layouts: Sequence[tuple[str, Any]],
    rows: Sequence[Any],
) -> Path:
    """``reference``: a :class:`plait.demo.reference.Reference`; ``layouts``: (name,
    :class:`plait.demo.gpt.GPTDemoReport`) of each continuation; ``rows``: the table's
    :class:`plait.demo.tour.Row` s, in the same order."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(19, 8.5))
    (full, steps, speed), (wall, bars, peak) = axes
    n = len(reference.losses)
    k = max(1, n // 40)
    full.plot(range(1, n + 1), _smooth(reference.losses, k), color="black", lw=1,
              label=f"training loss (mean of {k} steps)")  # fmt: skip
    full.plot([h["step"] for h in reference.history],
              [h["held_out_loss"] for h in reference.history], "ks--", ms=4,
              label="held-out loss")  # fmt: skip
    for name, rep in layouts:
        full.plot(range(n + 1, n + 1 + len(rep.losses)), rep.losses, lw=1, label=name)
    full.set_title("the reference, one process, then each layout continues on 4 ranks")
    full.set_xlabel("step")
    full.set_ylabel("cross-entropy (nats per character)")
    full.legend(fontsize=7)
    for name, rep in layouts:
        x = range(n + 1, n + 1 + len(rep.losses))
        steps.plot(x, rep.losses, "o-", ms=3, lw=1, label=name)
        wall.plot(rep.step_ends, _smooth(rep.losses, WALL_MEAN), lw=1.5, label=name)
    steps.set_title("the continuations against the step\n(the dense layouts overlap: the same "
                    "function, checked against one process)", fontsize=10)  # fmt: skip
    steps.set_xlabel("step")
    steps.set_ylabel("training loss (nats per character)")
    steps.legend(fontsize=7)
    wall.set_title(f"the continuations against wall time (mean of {WALL_MEAN} steps)\n"
                   "(4 ranks sharing this machine's cores)", fontsize=10)  # fmt: skip
    wall.set_xlabel("seconds since the layout's first step")
    wall.set_ylabel("training loss (nats per character)")
    wall.legend(fontsize=7)
    names = [r.layout for r in rows]
    at = list(range(len(rows)))
    mem = [r.param_mib_per_rank for r in rows]
    sent = [r.mib_sent_per_step for r in rows]
    bars.bar([i - 0.2 for i in at], mem, width=0.4, color="#4e79a7",
             label="parameters per rank (MiB, largest rank)")  # fmt: skip
    twin = bars.twinx()
    twin.bar([i + 0.2 for i in at], sent, width=0.4, color="#f28e2b",
             label="sent per step by rank 0 (MiB)")  # fmt: skip
    bars.set_xticks(at)
    bars.set_xticklabels(names, fontsize=8, rotation=15)
    bars.set_ylabel("parameters per rank (MiB)", color="#4e79a7")
    twin.set_ylabel("MiB sent per step, rank 0", color="#f28e2b")
    bars.set_title("what each layout costs: memory (blue) and communication (orange)",
                   fontsize=10)  # fmt: skip
    h1, l1 = bars.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    bars.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    _speed_panels(speed, peak, rows)
    fig.suptitle(f"plait tour: the same GPT on 4 ranks under {len(layouts)} layouts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _speed_panels(speed: Any, peak: Any, rows: Sequence[Any]) -> None:
    """The tour's plait.metrics figures per layout: MFU and step time (``speed``), and the
    largest rank's peak memory (``peak``). A layout without a metrics summary shows no bar."""
    names = [r.layout for r in rows]
    at = list(range(len(rows)))
    mfu = [100 * r.mfu if r.mfu is not None else 0.0 for r in rows]
    speed.bar([i - 0.2 for i in at], mfu, width=0.4, color="#59a14f",
              label="MFU (%, model FLOP/s over the measured peak)")  # fmt: skip
    twin = speed.twinx()
    twin.bar([i + 0.2 for i in at], [r.step_ms for r in rows], width=0.4, color="#b07aa1",
             label="step time (ms)")  # fmt: skip
    speed.set_xticks(at)
    speed.set_xticklabels(names, fontsize=8, rotation=15)
    speed.set_ylabel("MFU (%)", color="#59a14f")
    twin.set_ylabel("ms per step", color="#b07aa1")
    speed.set_title("speed (plait.metrics): MFU (green) and step time (purple)\n"
                    "(4 ranks sharing this machine's cores)", fontsize=10)  # fmt: skip
    h1, l1 = speed.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    speed.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    mem = [r.memory_peak_mib if r.memory_peak_mib is not None else 0.0 for r in rows]
    peak.bar(at, mem, width=0.5, color="#76b7b2")
    peak.set_xticks(at)
    peak.set_xticklabels(names, fontsize=8, rotation=15)
    peak.set_ylabel("MiB")
    peak.set_title("largest rank's peak memory (plait.metrics; on a CPU the max RSS since\n"
                   "its process started: the tour's 4 ranks run every layout in turn,\n"
                   "so it only grows from layout to layout)", fontsize=9)  # fmt: skip
