"""``plait demo --tour``: the reference GPT trained on 4 local ranks under five layouts.

One after the other, each a real multi-process run of :mod:`plait.demo.gpt` on the same
text, the same global batches and the same seed, checked against the dense GPT trained in
one process:

====================  ============================================================
DDP                   ``Mesh(dp=4)``: every rank a replica, gradients all-reduced
TP                    ``Mesh(tp=4)``: heads, MLP, embedding and head split four ways
PP                    ``Mesh(pp=4)``: four stages, 1F1B over 8 micro-batches
PTD-P pp2 x tp2       ``Mesh(pp=2, dp=1, tp=2)``: two stages, each tensor-parallel
MoE ep4               ``Mesh(ep=4)``: a 4-expert GShard MoE in every second block
====================  ============================================================

It ends with one table (layout, step time, parameters per rank, bytes rank 0 sent per
step, the pipeline bubble, final loss, largest parameter difference to one process) and
one plot of the training loss of every layout against the step, written with the table to
``runs/tour-<time>/`` beside each layout's own run folder.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from plait.demo.gpt import GPTDemoConfig, GPTDemoReport, run


@dataclass(frozen=True)
class Stop:
    """One layout of the tour."""

    name: str
    config: GPTDemoConfig


def stops(*, steps: int = 40, seed: int = 0, dtype: str = "float32") -> list[Stop]:
    """The tour's layouts on 4 ranks (plain data: print it, test it without processes)."""
    base = GPTDemoConfig(
        world_size=4, tp=1, steps=steps, evals=min(4, steps), seed=seed, batch_size=16,
        dtype=dtype,
    )  # fmt: skip
    return [
        Stop("DDP dp4", replace(base)),
        Stop("TP tp4", replace(base, tp=4)),
        Stop("PP pp4 1f1b", replace(base, pp=4, microbatches=8)),
        Stop("PTD-P pp2 x tp2", replace(base, pp=2, tp=2, microbatches=4)),
        Stop("MoE ep4", replace(base, moe=True, ep=4)),
    ]


@dataclass
class Row:
    layout: str
    step_ms: float
    param_mib_per_rank: float  # the largest rank's
    mib_sent_per_step: float  # rank 0, every mesh dimension together
    bubble: float | None  # the last step's, measured (pipeline only)
    final_loss: float
    max_param_diff: float
    check_bound: float  # the difference --check accepts (measured in float32)


def row(name: str, report: GPTDemoReport) -> Row:
    c = report.config
    sent = sum(sum(r.values()) for r in report.bytes_by_dim.values())
    return Row(
        layout=name,
        step_ms=1e3 * report.train_seconds / c.steps,
        param_mib_per_rank=max(report.param_bytes_per_rank) / 2**20,
        mib_sent_per_step=sent / 2**20 / c.steps,
        bubble=report.bubble.get("measured") if report.bubble else None,
        final_loss=report.final_loss,
        max_param_diff=report.max_param_diff if report.max_param_diff is not None else -1.0,
        check_bound=report.check_bound if report.check_bound is not None else -1.0,
    )


def table(rows: list[Row]) -> str:
    head = (
        "| layout | step ms | params per rank (MiB) | sent per step, rank 0 (MiB) | bubble "
        "| final loss | max diff vs one process (bound) |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        bubble = "-" if r.bubble is None else f"{r.bubble:.0%}"
        lines.append(
            f"| {r.layout} | {r.step_ms:.1f} | {r.param_mib_per_rank:.3f} | "
            f"{r.mib_sent_per_step:.3f} | {bubble} | {r.final_loss:.4f} | "
            f"{r.max_param_diff:.1e} ({r.check_bound:.0e}) |"
        )
    return "\n".join(lines)


def _plot(reports: list[tuple[str, GPTDemoReport]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rep in reports:
        steps = [h["step"] for h in rep.history]
        ax.plot(steps, [h["loss"] for h in rep.history], "o-", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per character)")
    ax.set_title(
        "plait tour: the same GPT on 4 ranks\n(the dense layouts compute the same function: "
        "their curves overlap)",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tour(*, steps: int = 40, out_dir: Path = Path("runs"), dtype: str = "float32") -> list[Row]:
    """Run every stop with ``--check``, print and write the table and the plot."""
    stamp = time.strftime("%H%M%S")
    folder = out_dir / f"tour-{stamp}"
    all_stops = stops(steps=steps, dtype=dtype)
    print(f"plait demo --tour: {len(all_stops)} layouts of the GPT on 4 local ranks\n")
    done: list[tuple[str, GPTDemoReport]] = []
    for i, stop in enumerate(all_stops, 1):
        print(f"=== {i}/{len(all_stops)}: {stop.name} ===", flush=True)
        config = replace(stop.config, name=f"tour-{stamp}-{i}")
        done.append((stop.name, run(config, check=True, out_dir=out_dir)))
        print(flush=True)
    rows = [row(name, rep) for name, rep in done]
    folder.mkdir(parents=True, exist_ok=True)
    text = table(rows)
    (folder / "tour.md").write_text(text + "\n")
    (folder / "tour.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    _plot(done, folder / "tour.png")
    print(text)
    print(
        "\nstep ms: wall time per training step (evaluations included) on this machine; "
        "max diff: float32 parameters against the dense GPT trained in one process; bound: "
        "10x how far that one process lands from itself with the batch summed in two halves"
    )
    print(f"wrote {folder}/tour.md, tour.json, tour.png")
    return rows


def main(args: Any) -> int:
    """Exit code 1 when any layout ended farther from one process than rounding explains."""
    steps = args.steps if args.steps is not None else 40
    rows = tour(steps=steps, out_dir=Path(args.out), dtype=getattr(args, "dtype", "float32"))
    bad = [r.layout for r in rows if not 0 <= r.max_param_diff <= r.check_bound]
    if bad:
        print(f"plait demo --tour: --check failed for {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
