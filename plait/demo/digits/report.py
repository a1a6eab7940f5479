"""A digits demo run from the parent's side: :func:`run` validates the options and spawns
the ranks, :func:`summarize` turns what they returned into a :class:`DemoReport`, printed
and written to ``runs/<name>/`` (``report.json``, ``trace.json``, ``curves.png``);
:func:`check_passed` reads its ``--check`` verdict."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import plait
from plait.demo.digits.check import judge
from plait.demo.digits.config import FLOAT64_BOUND, NOISE_FACTOR, DemoConfig, push_lr, validate
from plait.demo.digits.train import train_rank
from plait.trace import Span, overlap_report, write_chrome


def _last_of_epoch(history: list[dict[str, Any]], point: dict[str, Any]) -> dict[str, Any]:
    return [h for h in history if h["epoch"] == point["epoch"]][-1]


def _print_ps(ps: dict[str, Any]) -> None:
    for s in ps["servers"]:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s["staleness"].items()))
        print(
            f"server {s['index']} (rank {s['rank']}): {s['updates']} updates from "
            f"{s['gradients']} gradients, {s['dropped']} dropped, queue max {s['queue_max']}, "
            f"mean staleness {s['mean_staleness']:.2f}, max {max(s['staleness'], default=0)} "
            f"(histogram {hist})"
        )
        if s["mode"] != "sync":
            print(
                f"  asynchronous: {s['scaled']} stale gradients applied divided by their "
                f"staleness (lr / staleness), {s['refused']} refused as too stale"
            )
        if s["ssp_waits"]:
            print(f"  ssp: {s['ssp_waits']} waits, {s['ssp_wait_s']:.2f} s in all")
        for rank, why in s["failed_workers"].items():
            print(f"  worker rank {rank} FAILED: {why}")
    for w in ps["workers"]:
        print(
            f"worker rank {w['rank']}: {w['steps']} steps, {w['steps_per_s']:.1f} steps/s, "
            f"{w['wait_s']:.2f} s waiting for servers, {w['compute_s']:.2f} s computing"
            + (f", {w['injected_s']:.2f} s injected delay" if w["injected_s"] else "")
        )


@dataclass
class DemoReport:
    config: DemoConfig
    test_accuracy: float
    samples_per_s: float
    train_seconds: float
    # None: the strategy's tracer recorded no communication span ("not traced"), which is
    # not the same as no communication
    comm_share: float | None
    hidden_fraction: float | None
    comm_seconds_per_rank: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    bytes: dict[str, Any] = field(default_factory=dict)
    # --check (judge): against one process (float64, or the same micro-batches)
    max_param_diff: float | None = None  # the largest parameter difference
    param_distance: float | None = None  # float32: relative to how far training moved them
    check_bound: float | None = None  # on param_distance in float32, else max_param_diff
    float32_noise: float | None = None  # float32: the distance of float32 in one process
    ps: dict[str, Any] = field(default_factory=dict)  # servers' and workers' statistics


def _plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [h["elapsed_s"] for h in history]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(t, [h["loss"] for h in history], "o-", color="tab:blue", label="train loss")
    ax1.set_xlabel("wall time (s)")
    ax1.set_ylabel("train loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(
        t, [h["test_accuracy"] for h in history], "s-", color="tab:green", label="test accuracy"
    )
    ax2.set_ylabel("test accuracy", color="tab:green")
    ax2.set_ylim(0, 1)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_passed(report: DemoReport) -> bool:
    """False when ``--check`` found the run farther from one process than rounding explains
    (:func:`judge`)."""
    if report.param_distance is not None:  # float32
        return report.check_bound is not None and report.param_distance <= report.check_bound
    if report.max_param_diff is None:
        return True
    bound = report.check_bound if report.check_bound is not None else FLOAT64_BOUND
    return report.max_param_diff <= bound


def run(config: DemoConfig, *, check: bool = False, out_dir: Path = Path("runs")) -> DemoReport:
    """Validate ``config``, train on ``config.world_size`` spawned ranks, report and write
    ``out_dir/<name>/``. Raises :class:`DemoOptionError` before spawning on a bad option."""
    validate(config)
    label = config.strategy if config.strategy != "ps" else f"ps-{config.ps_mode}"
    name = config.name or f"{label}-n{config.world_size}-{time.strftime('%H%M%S')}"
    run_dir = out_dir / name
    how = f"algorithm {config.algorithm}"
    if config.strategy == "ps":
        how = (
            f"mode {config.ps_mode}, {config.servers} server(s) + {config.trainers} workers"
            + (f", staleness {config.staleness}" if config.staleness is not None else "")
            + (
                f", lr {config.lr:g} per global batch = {push_lr(config):.3g} per push"
                + (" / its staleness" if config.staleness_aware else "")
                if config.ps_mode != "sync"
                else ""
            )
            + (
                f", max staleness {config.max_staleness}"
                if config.max_staleness is not None
                else ""
            )
            + (f", {config.backup_workers} backup" if config.backup_workers else "")
            + (
                f", rank {config.slow_worker[0]} slowed {config.slow_worker[1]:g}x"
                if config.slow_worker
                else ""
            )
        )
    print(
        f"plait demo: CNN on scikit-learn digits, {config.world_size} ranks, strategy "
        f"{config.strategy}, {how}, {config.epochs} epochs, global batch {config.batch_size}"
        + (f", {config.dtype}" if config.dtype != "float32" else "")
        + (
            f", reproducible (micro-batches of {config.microbatch_size})"
            if config.reproducible
            else ""
        ),
        flush=True,
    )
    results = plait.spawn(
        train_rank, world_size=config.world_size, args=(config, check), timeout=3600
    )
    return summarize(config, results, check=check, run_dir=run_dir)


def comm_traced(spans: list[Span]) -> bool:
    """Did any rank's tracer record a communication span?"""
    return any(s.stream == "comm" for s in spans)


def summarize(
    config: DemoConfig, results: list[dict[str, Any]], *, check: bool, run_dir: Path
) -> DemoReport:
    """The report of a finished run (``results``: what :func:`train_rank` returned on each
    rank, in rank order): printed, and written to ``run_dir``."""
    lead = results[config.lead]
    history = lead["history"]
    spans: list[Span] = [s for r in results for s in r["spans"]]
    overlap = overlap_report(spans)
    traced = comm_traced(spans)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_chrome(run_dir / "trace.json", [r["spans"] for r in results])
    epochs = [h for h in history if h["seconds"] > 0 and h is _last_of_epoch(history, h)]
    total = sum(h["seconds"] for h in epochs)
    steps = lead["steps_per_epoch"] * config.epochs
    report = DemoReport(
        config=config,
        test_accuracy=history[-1]["test_accuracy"],
        samples_per_s=steps * config.batch_size / total,
        train_seconds=total,
        comm_share=overlap.comm_share if traced else None,
        hidden_fraction=overlap.hidden_fraction if traced else None,
        comm_seconds_per_rank=overlap.comm_s if traced else None,
        history=history,
        bytes=lead["comm"],
    )
    if config.strategy == "ps":
        report.ps = {
            "servers": [r["ps"] for r in results if r["role"] == "server"],
            "workers": [r["ps"] for r in results if r["role"] == "worker"],
        }
    comparable = config.strategy != "ps" or (config.ps_mode, config.backup_workers) == ("sync", 0)
    if check and comparable:
        judge(config, results, report)
    elif check:
        print("--check: only synchronous training without backup workers equals one process")
    (run_dir / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    _plot(
        history,
        run_dir / "curves.png",
        f"plait {config.strategy}, {config.world_size} ranks: digits CNN",
    )
    print(f"\nfinal test accuracy   {report.test_accuracy:.2%}")
    print(
        f"throughput            {report.samples_per_s:,.0f} samples/s "
        f"({report.train_seconds:.1f} s of training)"
    )
    if traced:
        print(
            f"communication share   {overlap.comm_share:.1%} of traced time exposed, "
            f"{overlap.comm_s:.2f} s of communication per rank"
        )
        print(f"hidden behind backward {overlap.hidden_fraction:.1%}")
    elif config.strategy == "none":
        print("communication share   none (one process, --strategy none)")
    else:
        print(
            f"communication share   not traced (strategy {config.strategy} records no "
            f"communication spans in the timeline)"
        )
    if report.ps:
        _print_ps(report.ps)
    if report.max_param_diff is not None and config.reproducible:
        verdict = "bitwise" if check_passed(report) else "NOT BITWISE: a bug, please report"
        print(
            f"--check: one process on the same micro-batches of {config.microbatch_size}: "
            f"max diff {report.max_param_diff:g} ({verdict})"
        )
    elif report.param_distance is not None:
        verdict = "ok" if check_passed(report) else "LARGER THAN EXPECTED"
        print(
            f"--check: after epoch 1, parameter distance to one process in float64, relative "
            f"to how far training moved them: {report.param_distance:.2e} ({verdict}: bound "
            f"{report.check_bound:.1e})\n  bound = {NOISE_FACTOR:g} x how far float32 in one "
            f"process lands from float64 ({report.float32_noise:.2e}; the global batch summed "
            f"in two orders), the rounding training amplifies, measured here for this run; "
            f"later epochs amplify it chaotically. --dtype float64 checks the end to "
            f"{FLOAT64_BOUND:g}"
        )
    elif report.max_param_diff is not None:
        verdict = "ok" if check_passed(report) else "LARGER THAN EXPECTED"
        print(
            f"--check: largest parameter difference to one process on the global batch: "
            f"{report.max_param_diff:.2e} ({verdict}: bound {report.check_bound:.1e})"
        )
    print(f"wrote {run_dir}/report.json, trace.json, curves.png")
    if not math.isfinite(report.history[-1]["loss"]):
        print("the loss diverged; lower --lr", file=sys.stderr)
    return report
