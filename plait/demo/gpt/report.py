"""A GPT demo run from the parent's side: :func:`run` validates and trains on spawned (or
kept) ranks, :func:`summarize` turns what they returned into a :class:`GPTDemoReport`:
printed, written to ``runs/<name>/`` with its pictures (curves, the last step's timeline,
the pipeline schedule, the experts' load) and a paragraph the model writes (:func:`sample`)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import plait
from plait import moe
from plait.demo import context
from plait.demo.gpt.check import check_lines, judge
from plait.demo.gpt.data import PROMPT, corpus, held_out_windows
from plait.demo.gpt.train import train_rank
from plait.demo.options import GPTDemoConfig, validate
from plait.demo.pictures import timeline_png
from plait.models import GPT, CharTokenizer
from plait.strategies.pipeline import bubble_report
from plait.strategies.pipeline.draw import draw_png
from plait.strategies.pipeline.report import slots_from_spans
from plait.strategies.pipeline.schedules import build
from plait.trace import write_chrome


def sample(
    state: dict[str, torch.Tensor], config: GPTDemoConfig, *, chars: int = 240, seed: int = 0
) -> str:
    """What the trained model writes after :data:`PROMPT` (temperature 0.8), on one process."""
    model = GPT(config.model_config())
    model.load_state_dict(state)
    model.eval()
    tok = CharTokenizer()
    ids = tok.encode(PROMPT).unsqueeze(0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(chars):
            logits = model(ids[:, -config.seq_len :])[0, -1] / 0.8
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tok.decode(ids[0])


@dataclass
class GPTDemoReport:
    config: GPTDemoConfig
    final_loss: float
    held_out_loss: float
    tokens_per_s: float
    train_seconds: float
    layout: str
    bytes_by_dim: dict[str, Any] = field(default_factory=dict)
    param_bytes_per_rank: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    # every step: the training loss (mean over the ranks' rows) and the seconds since the
    # start at its end (rank 0's clock, evaluations included)
    losses: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    text: str = ""
    # --check (see judge): against one process in float64 from the same start
    max_param_diff: float | None = None  # the largest parameter difference
    param_distance: float | None = None  # float32: distance, relative to how far they moved
    check_bound: float | None = None  # on max_param_diff (float64) or param_distance
    loss_bound: float | None = None  # float32: on max_loss_diff
    float32_noise: dict[str, Any] = field(default_factory=dict)  # float32: Float32Noise
    bubble: dict[str, Any] = field(default_factory=dict)  # --pp: the last step's
    moe: list[dict[str, Any]] = field(default_factory=list)  # --moe: stats per step
    # --cp: the attention bytes on cp, counted per rank and by the formula (context.check)
    cp_bytes: dict[str, Any] = field(default_factory=dict)
    max_loss_diff: float | None = None  # --check: the largest per-step loss difference
    metrics: dict[str, Any] = field(default_factory=dict)  # plait.metrics: info, summary


def metrics_line(m: dict[str, Any]) -> str:
    """The run's MFU and peak memory per rank in one line (``m``: a rank's
    ``{"info", "summary"}`` of :class:`plait.metrics.Metrics`)."""
    info, s = m["info"], m["summary"]
    mfu = "-" if s.get("mfu") is None else f"{s['mfu']:.1%}"
    peaks = info.get("peak_flops_per_rank") or [info.get("peak_flops") or 0.0]
    return (
        f"MFU {mfu} ({s.get('tflops_per_rank') or 0.0:.4f} model TFLOP/s per rank of "
        f"{max(peaks) / 1e12:.4f} peak), peak memory {s['memory_peak_bytes'] / 2**20:,.0f} "
        f"MiB per rank ({info['memory_kind']})"
    )


def last_step(result: dict[str, Any]) -> list[Any]:
    """One rank's spans of its last training step (forward, backward, optimizer step)."""
    a, b = result["last_step_ns"], result["last_step_end_ns"]
    return [sp for sp in result["spans"] if sp.start_ns >= a and sp.end_ns <= b]


def _bubble(config: GPTDemoConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The last step's bubble: measured from every rank's spans, simulated with the measured
    action times, and the formula."""

    spans = [sp for r in results for sp in last_step(r)]
    cores = float(min(os.cpu_count() or config.pp, config.pp))
    rep = bubble_report(build(config.schedule, p=config.pp, m=config.m), spans, cores=cores)
    print(rep.describe())
    return {
        "measured": rep.measured,
        "simulated": rep.simulated,
        "formula": rep.formula,
        "on_cores": rep.simulated_on_cores,  # the simulator with the ranks sharing the cores
        "cores": rep.cores,
        "step_seconds": rep.step_seconds,
    }


def _draw_schedule(
    config: GPTDemoConfig, results: list[dict[str, Any]], path: Path, bubble: dict[str, Any]
) -> None:
    """The pipeline's last step as run: each rank's forwards and backwards in measured time
    (:func:`plait.strategies.pipeline.draw.draw_png`)."""
    slots = slots_from_spans([sp for r in results for sp in last_step(r)])
    draw_png(
        slots, str(path), p=config.pp, unit="seconds since the step began",
        title=(
            f"plait: {config.schedule} on {config.pp} stages, {config.m} micro-batches, the last "
            f"step as measured; bubble {bubble['measured']:.0%} measured, "
            f"{bubble['formula']:.0%} by the formula (p-1)/(m+p-1)"
        ),
    )  # fmt: skip


def _plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [h["elapsed_s"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [h["loss"] for h in history], "o-", label="training loss")
    ax.plot(t, [h["held_out_loss"] for h in history], "s-", label="held-out loss")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def describe(config: GPTDemoConfig) -> str:
    c = config
    if c.cp > 1:
        tp = f" x tp {c.tp}" if c.tp > 1 else ""
        how = f"dp {c.dp} x cp {c.cp}{tp} ({c.context} attention)"
    elif c.pp > 1 and (c.tp > 1 or c.dp > 1):
        sp = " + sequence parallelism" if c.sequence_parallel else ""
        how = f"pp {c.pp} x dp {c.dp} x tp {c.tp}{sp} ({c.schedule}, {c.m} micro-batches)"
    elif c.pp > 1:
        how = f"pp {c.pp} ({c.schedule}, {c.m} micro-batches)"
    elif c.moe:
        how = f"ep {c.ep} x dp {c.dp}, {c.experts} experts in every second block"
    else:
        sp = " + sequence parallelism" if c.sequence_parallel else ""
        grid = "" if c.tp_mode == "1d" else f" ({c.tp_mode} grid)"
        how = f"dp {c.dp} x tp {c.tp}{grid}{sp}"
    return (
        f"GPT ({c.layers} layers, width {c.width}, {c.heads} heads, sequence {c.seq_len}) on "
        f"Python's docs, {c.world_size} ranks as {how}"
    )


def _label(c: GPTDemoConfig) -> str:
    if c.cp > 1:
        return f"gpt-dp{c.dp}-cp{c.cp}-{c.context}" + (f"-tp{c.tp}" if c.tp > 1 else "")
    if c.pp > 1 and (c.tp > 1 or c.dp > 1):
        return f"gpt-pp{c.pp}-dp{c.dp}-tp{c.tp}-{c.schedule}"
    if c.pp > 1:
        return f"gpt-pp{c.pp}-{c.schedule}"
    if c.moe:
        return f"gpt-moe-ep{c.ep}-dp{c.dp}"
    grid = "" if c.tp_mode == "1d" else f"-{c.tp_mode}"
    return f"gpt-dp{c.dp}-tp{c.tp}{grid}" + ("-sp" if c.sequence_parallel else "")


def run(
    config: GPTDemoConfig,
    *,
    check: bool = False,
    out_dir: Path = Path("runs"),
    pool: plait.RankPool | None = None,
) -> GPTDemoReport:
    """Validate, train on ``config.world_size`` ranks, print and write the report.

    The ranks are spawned for this run, or are ``pool``'s when given (a kept
    :class:`~plait.RankPool` of ``config.world_size`` ranks: the tour runs its layouts on one,
    sparing four processes' start and imports per layout)."""
    validate(config)
    name = config.name or f"{_label(config)}-n{config.world_size}-{time.strftime('%H%M%S')}"
    run_dir = out_dir / name
    print(
        f"plait demo: {describe(config)}, {config.steps} steps of {config.batch_size} windows",
        flush=True,
    )
    if pool is None:
        results = plait.spawn(
            train_rank, world_size=config.world_size, args=(config, run_dir), timeout=3600
        )
    elif pool.world_size != config.world_size:
        raise ValueError(
            f"the pool has {pool.world_size} ranks, the layout {describe(config)} needs "
            f"{config.world_size}; pass a pool of that size or none (spawn)"
        )
    else:
        results = pool.run(train_rank, config, run_dir, timeout=3600)
    return summarize(config, results, check=check, run_dir=run_dir)


def summarize(
    config: GPTDemoConfig, results: list[dict[str, Any]], *, check: bool, run_dir: Path
) -> GPTDemoReport:
    """The report of a finished run (``results``: what :func:`train_rank` returned on each
    rank, in rank order), with ``check`` judged against one process: printed, and written
    to ``run_dir``."""
    lead = results[0]
    print(lead["layout"])
    history = lead["history"]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_chrome(run_dir / "trace.json", [r["spans"] for r in results])
    train_s = max(r["train_s"] for r in results)
    state: dict[str, torch.Tensor] = {}
    for r in results:  # tp: every rank has it all; pp and ep: each rank its stages / experts
        state.update(r["state"])
    report = GPTDemoReport(
        config=config,
        final_loss=history[-1]["loss"],
        held_out_loss=history[-1]["held_out_loss"],
        tokens_per_s=config.steps * config.batch_size * config.seq_len / train_s,
        train_seconds=train_s,
        layout=lead["layout"],
        bytes_by_dim=lead["bytes_by_dim"],
        param_bytes_per_rank=[r["param_bytes"] for r in results],
        history=history,
        # every layout's ranks hold equal shares of the batch, or each the whole batch's loss
        losses=[sum(per) / len(per) for per in zip(*(r["losses"] for r in results), strict=True)],
        step_ends=lead["ends"],
        text=sample(state, config),
        moe=lead["moe"],
        metrics=lead.get("metrics", {}),
    )
    timeline_png(
        [sp for r in results for sp in last_step(r)], run_dir / "timeline.png",
        title=f"plait: the last step of {describe(config)}",
    )  # fmt: skip
    pictures = ["timeline.png"]
    if config.pp > 1 and config.tp == 1 and config.dp == 1:
        report.bubble = _bubble(config, results)
        _draw_schedule(config, results, run_dir / "schedule.png", report.bubble)
        pictures.append("schedule.png")
    if config.moe:
        loads = [{k: moe.MoEStats(**v) for k, v in step.items()} for step in lead["moe"]]
        moe.plot_tokens_per_expert(loads, run_dir / "moe_load.png", title=_label(config))
    if config.cp > 1:
        rows = held_out_windows(config, corpus()[1])[0].shape[0]
        sent = [r["bytes_by_dim"] for r in results]
        report.cp_bytes = context.check(config, sent, held_out_rows=rows)
    if check:
        judge(report, state)
    (run_dir / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    _plot(history, run_dir / "curves.png", f"plait: {describe(config)}")
    print(f"\nfinal training loss   {report.final_loss:.4f} (held-out {report.held_out_loss:.4f})")
    print(f"throughput            {report.tokens_per_s:,.0f} tokens/s ({train_s:.1f} s)")
    if report.metrics:
        print(f"metrics               {metrics_line(report.metrics)}")
    mib = [b / 2**20 for b in report.param_bytes_per_rank]
    print(f"parameters per rank   {min(mib):.2f}-{max(mib):.2f} MiB")
    for dim, row in report.bytes_by_dim.items():
        total = sum(row.values())
        if total < 1024 * config.steps:  # the loss averages: a few bytes a step
            continue
        print(f"sent on {dim:<13} {total / 2**20 / config.steps:.3f} MiB per step by rank 0")
    if report.cp_bytes:
        print("\n".join(context.report_lines(config, report.cp_bytes, report.bytes_by_dim)))
    if report.bubble:
        b = report.bubble
        print(
            f"pipeline bubble       {b['measured']:.1%} measured in the last step, "
            f"{b['simulated']:.1%} simulated with its measured action times, "
            f"{b['formula']:.1%} by the formula"
        )
    if report.moe:
        last = report.moe[-1]
        for layer, st in last.items():
            print(
                f"{layer}: tokens per expert {st['tokens_per_expert']}, drop rate "
                f"{st['drop_rate']:.1%}, imbalance {st['imbalance']:.2f} (last step)"
            )
    print(f"\nthe model writes:\n{report.text}\n")
    if report.max_param_diff is not None:
        print("\n".join(check_lines(report)))
    pictures += ["moe_load.png"] if config.moe else []
    if (run_dir / "metrics.jsonl").exists():
        pictures += ["metrics.jsonl"]
    print(f"wrote {run_dir}/report.json, trace.json, curves.png, {', '.join(pictures)}")
    if not math.isfinite(report.final_loss):
        print("the loss diverged; lower --lr", file=sys.stderr)
    return report
