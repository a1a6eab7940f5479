"""``plait demo --tour``: the reference GPT learns to write, then six layouts continue it.

1. The dense GPT (:data:`MODEL`) trains in this process on Python's documentation until it
   writes words (:mod:`plait.demo.reference`: warm-up, cosine decay, every core), and is
   saved as a plait checkpoint.
2. Each layout loads that checkpoint on 4 local ranks and trains a short continuation
   (``steps``, at the reference's final learning rate, on the batches after it), checked
   against the dense GPT continued in one process (:func:`plait.demo.gpt.run` with
   ``check``). The continuations run in float64 (the float32 checkpoint loads exactly), so
   the check holds to 1e-8 on any CPU; in float32 (``dtype``) it judges the parameters'
   distance relative to how far they moved, against 10x what float32 in one process shows
   (:func:`plait.demo.gpt.judge`):

====================  ============================================================
DDP dp4               ``Mesh(dp=4)``: every rank a replica, gradients all-reduced
TP tp4                ``Mesh(tp=4)``: heads, MLP, embedding and head split four ways
PP pp4 1f1b           ``Mesh(pp=4)``: four stages, 1F1B over 8 micro-batches
PTD-P pp2 x tp2       ``Mesh(pp=2, dp=1, tp=2)``: two stages, each tensor-parallel
CP cp4 ring           ``Mesh(cp=4)``: a quarter of every window, K and V in a ring
MoE ep4               ``Mesh(ep=4)``: 4 experts in every second block, upcycled
====================  ============================================================

3. One table (with a two-line legend, the pipeline bubble measured, simulated and by the
   formula, one sentence per layout on what it trades, the ring's K/V bytes against the
   formula), and pictures beside it in
   ``runs/tour-<time>/``: ``tour.png`` (loss against step and wall time, memory and bytes
   per layout), ``schedule.png`` (the pipeline's last step as it ran) and ``timeline.png``
   (DDP's last step: compute and communication per rank, from the tracer).
4. A verdict: PASS when every layout ended within what rounding explains of one process,
   else FAIL and exit code 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from plait import RankPool, checkpoint, metrics
from plait.demo import context, reference
from plait.demo.gpt import GPTDemoReport, check_passed, judged_value, run
from plait.demo.options import GPTDemoConfig
from plait.demo.pictures import tour_png
from plait.models import GPT

#: the GPT of the tour: 0.37M parameters, which on 2 cores learn words in about 2 minutes
MODEL: dict[str, Any] = {"width": 96, "layers": 3, "heads": 4, "seq_len": 128, "batch_size": 32}
#: the reference's training (steps, learning-rate schedule)
SCHEDULE = reference.Schedule(steps=1000, warmup=30, peak_lr=3e-3, final_lr=3e-4, evals=10)
#: steps each layout continues the reference for
STEPS = 20


@dataclass(frozen=True)
class Stop:
    """One layout of the tour and what it trades, in one sentence."""

    name: str
    config: GPTDemoConfig
    trade: str


def stops(
    *,
    steps: int = STEPS,
    seed: int = 0,
    dtype: str = "float64",
    init: str = "",
    first_step: int = 0,
    lr: float = SCHEDULE.final_lr,
    model: dict[str, Any] | None = None,
) -> list[Stop]:
    """The tour's layouts on 4 ranks (plain data: print it, test it without processes)."""
    base = GPTDemoConfig(
        world_size=4, tp=1, steps=steps, evals=min(2, steps), seed=seed, dtype=dtype, lr=lr,
        init=init, first_step=first_step, **(MODEL if model is None else model),
    )  # fmt: skip
    return [
        Stop(
            "DDP dp4",
            replace(base),
            "every rank holds the whole model and a quarter of the batch, and all-reduces "
            "the gradients once a step: the fewest bytes of the dense layouts, the most memory",
        ),
        Stop(
            "TP tp4",
            replace(base, tp=4),
            "every rank holds a quarter of every layer but sees the whole batch, and "
            "all-reduces activations in every block, forward and backward: the least memory, "
            "the most bytes (it wants the fastest link)",
        ),
        Stop(
            "PP pp4 1f1b",
            replace(base, pp=4, microbatches=8),
            "every rank holds a quarter of the layers and passes activations to the next "
            "stage only: little memory and few bytes, paid for by the bubble",
        ),
        Stop(
            "PTD-P pp2 x tp2",
            replace(base, pp=2, tp=2, microbatches=4),
            "two stages, each split over two ranks: memory as low as TP's, bytes and bubble "
            "between TP's and PP's (Megatron's recipe for models no single scheme fits)",
        ),
        Stop(
            "CP cp4 ring",
            replace(base, cp=4, context="ring"),
            "every rank holds the whole model and two of the 8 chunks of every window (a "
            "quarter of its tokens, the causal work balanced), and passes K and V around the "
            "ring in every layer, forward and backward: a quarter of a window's activations "
            "per rank, so windows too long for one rank fit, paid for in bytes that grow with "
            "the window",
        ),
        Stop(
            "MoE ep4",
            replace(base, moe=True, ep=4),
            "a different model: 4 experts in every second block, one per rank, each token "
            "sent to 2 of them and back (all-to-all): more parameters at the same compute per "
            "token",
        ),
    ]


@dataclass
class Row:
    layout: str
    step_ms: float
    param_mib_per_rank: float  # the largest rank's
    mib_sent_per_step: float  # rank 0, every mesh dimension together
    bubble: float | None  # the last step's, measured (pipeline only)
    bubble_simulated: float | None  # the simulator with the measured action times
    bubble_on_cores: float | None  # the same, the ranks sharing this machine's cores
    bubble_formula: float | None  # (p - 1) / (m + p - 1) for 1F1B
    cp_attention_bytes: int | None  # cp: rank 0's attention bytes on cp, the whole run
    cp_formula_bytes: int | None  # the same by context.attention_formula
    final_loss: float
    held_out_loss: float
    max_param_diff: float  # float32: the parameters' distance (plait.demo.gpt.judge)
    check_bound: float  # the difference --check accepts
    passed: bool = False
    mfu: float | None = None  # plait.metrics: model FLOP/s over the ranks' measured peak
    memory_peak_mib: float | None = None  # plait.metrics: the largest rank's peak


def row(name: str, report: GPTDemoReport) -> Row:
    c = report.config
    sent = sum(sum(r.values()) for r in report.bytes_by_dim.values())
    b = report.bubble or {}
    cp = report.cp_bytes or {}
    summary = report.metrics.get("summary", {})
    return Row(
        layout=name,
        step_ms=1e3 * report.train_seconds / c.steps,
        param_mib_per_rank=max(report.param_bytes_per_rank) / 2**20,
        mib_sent_per_step=sent / 2**20 / c.steps,
        bubble=b.get("measured"),
        bubble_simulated=b.get("simulated"),
        bubble_on_cores=b.get("on_cores"),
        bubble_formula=b.get("formula"),
        cp_attention_bytes=sum(cp["counted"][0].values()) if cp else None,
        cp_formula_bytes=sum(cp["formula"].values()) if cp else None,
        final_loss=report.final_loss,
        held_out_loss=report.held_out_loss,
        max_param_diff=checked if (checked := judged_value(report)) is not None else -1.0,
        check_bound=report.check_bound if report.check_bound is not None else -1.0,
        passed=report.max_param_diff is not None and check_passed(report),
        mfu=summary.get("mfu"),
        memory_peak_mib=summary["memory_peak_bytes"] / 2**20 if summary else None,
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _mfu(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(rows: list[Row]) -> str:
    head = (
        "| layout | step ms | MFU | params/rank MiB | sent/step MiB | bubble meas / sim / formula "
        "| loss | held-out | diff vs 1 process (bound) |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        bubble = (
            "-"
            if r.bubble is None
            else f"{_pct(r.bubble)} / {_pct(r.bubble_simulated)} / {_pct(r.bubble_formula)}"
        )
        lines.append(
            f"| {r.layout} | {r.step_ms:.0f} | {_mfu(r.mfu)} | {r.param_mib_per_rank:.2f} | "
            f"{r.mib_sent_per_step:.2f} | {bubble} | {r.final_loss:.3f} | "
            f"{r.held_out_loss:.3f} | {r.max_param_diff:.1e} ({r.check_bound:.0e}) |"
        )
    return "\n".join(lines)


#: the table's legend, two lines
LEGEND = (
    "step ms: wall time per step, 4 ranks sharing this machine's cores; MFU: the model's "
    "FLOP/s over the ranks' measured peak (plait.metrics); params/rank: the largest rank's "
    "parameters, in the run's dtype (x4 with gradients and Adam); sent/step: what rank 0 "
    "sends.\n"
    "bubble: idle share of the pipeline's ranks in its last step, measured / simulated / "
    "formula; loss: nats per character; diff: largest parameter difference to one process "
    "(float32: the parameters' distance to it, relative to how far training moved them)."
)


def bubble_note(stop: Stop, r: Row, cores: int) -> str:
    """Why the pipeline's measured bubble is what it is, in two sentences."""
    c = stop.config
    p, m = c.pp, c.m
    note = (
        f"{stop.name}: {p} stages and {m} micro-batches: the formula (p-1)/(m+p-1) = "
        f"{p - 1}/{m + p - 1} = {_pct(r.bubble_formula)} is the fill and the drain, when a "
        f"stage has no micro-batch yet or any more; with the measured action times the "
        f"simulator gives {_pct(r.bubble_simulated)}"
    )
    if (r.bubble_simulated or 0.0) > (r.bubble_formula or 0.0) + 0.03:
        note += (
            f" (the formula assumes equal stages; the embedding, {c.layers} blocks and the "
            f"head cut {p} ways are not, and the slowest sets the pace)"
        )
    note += "."
    if cores < p and r.bubble_on_cores is not None:
        note += (
            f" Measured {_pct(r.bubble)}: the {p} ranks share {cores} cores, so a rank also "
            f"waits for a core (the simulator on {cores} cores: {_pct(r.bubble_on_cores)}); "
            f"with a core per rank it approaches the simulated value."
        )
    else:
        note += (
            f" Measured {_pct(r.bubble)}: the rest is Python between the actions and the "
            f"messages between stages."
        )
    return note


def context_note(stop: Stop, r: Row) -> str:
    """What the ring sent, per layer and per step by the formula, and rank 0's count over
    the run against it, in two sentences."""
    c = stop.config
    mib = 2**20
    step = context.attention_formula(replace(c, steps=1, evals=0), held_out_rows=0)
    layer = step["cp_kv"] / c.layers / mib  # one layer's forward: K and V of cp - 1 other ranks
    counted, formula = r.cp_attention_bytes or 0, r.cp_formula_bytes or 0
    same = "equal to" if counted == formula else "NOT equal to"
    return (
        f"{stop.name}: every layer's forward brings K and V of the other {c.cp - 1} ranks' "
        f"chunks around the ring, {layer:.2f} MiB per rank, and its backward twice that (K and "
        f"V again to recompute, dK and dV home): {sum(step.values()) / mib:.1f} MiB a training "
        f"step over {c.layers} layers (bytes that grow with the window; DDP's gradients do "
        f"not). Counted on cp, rank 0 sent {counted / mib:.1f} MiB of attention over the "
        f"run (held-out forwards included), {same} the formula's {formula / mib:.1f} MiB."
    )


@dataclass
class Tour:
    """What the tour left: the rows, the reference and where the files are."""

    rows: list[Row]
    reference: reference.Reference
    folder: Path
    text: str  # what the reference writes
    files: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)


def tour(
    *,
    steps: int = STEPS,
    schedule: reference.Schedule = SCHEDULE,
    out_dir: Path = Path("runs"),
    dtype: str = "float64",
    model: dict[str, Any] | None = None,
) -> Tour:
    """Train the reference, continue it under every layout with ``--check``, print the
    table and write the pictures."""
    stamp = time.strftime("%H%M%S")
    folder = out_dir / f"tour-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    ref_config = replace(stops(model=model, dtype="float32")[0].config, steps=schedule.steps)
    print(
        f"plait demo --tour\n\n1. the reference: the GPT ({ref_config.layers} layers, width "
        f"{ref_config.width}, sequence {ref_config.seq_len}) learns Python's documentation "
        f"in one process, {schedule.steps} steps of {ref_config.batch_size} windows\n",
        flush=True,
    )
    ref = reference.train(
        ref_config, schedule, root=folder / "reference", metrics_dir=folder / "reference-metrics"
    )
    model_ = GPT(ref_config.model_config())
    checkpoint.load(ref.root, model=model_, rng=False)
    text = reference.write(model_, ref_config, chars=300)
    print(
        f"\nthe reference after {ref.step} steps ({ref.train_seconds:.0f} s): held-out loss "
        f"{ref.held_out_nats:.3f} nats = {ref.held_out_bits:.2f} bits per character; it "
        f"writes:\n\n{text}\n\nsaved as a plait checkpoint: {ref.root}\n",
        flush=True,
    )
    all_stops = stops(
        steps=steps, dtype=dtype, init=ref.root, first_step=ref.step, model=model,
        lr=schedule.final_lr,
    )  # fmt: skip
    print(
        f"2. {len(all_stops)} layouts on 4 ranks each load it and continue for {steps} "
        f"steps in {dtype}, each checked against one process\n",
        flush=True,
    )
    done: list[tuple[str, GPTDemoReport]] = []
    world = all_stops[0].config.world_size
    with RankPool(world) as pool:  # one set of ranks runs every layout in turn
        for i, stop in enumerate(all_stops, 1):
            print(f"=== {i}/{len(all_stops)}: {stop.name} ===", flush=True)
            config = replace(stop.config, name=f"tour-{stamp}-{i}")
            done.append((stop.name, run(config, check=True, out_dir=out_dir, pool=pool)))
            print(flush=True)
    rows = [row(name, rep) for name, rep in done]
    result = Tour(rows, ref, folder, text)
    _write(result, done, all_stops, out_dir, stamp)
    _print(result, all_stops)
    return result


def _write(
    t: Tour,
    done: list[tuple[str, GPTDemoReport]],
    all_stops: list[Stop],
    out_dir: Path,
    stamp: str,
) -> None:
    (t.folder / "tour.md").write_text(table(t.rows) + "\n\n" + LEGEND + "\n")
    saved = {
        "rows": [asdict(r) for r in t.rows],
        "reference": {
            "steps": t.reference.step,
            "held_out_nats_per_char": t.reference.held_out_nats,
            "held_out_bits_per_char": t.reference.held_out_bits,
            "train_seconds": t.reference.train_seconds,
            "history": t.reference.history,
            "losses": t.reference.losses,
            "text": t.text,
        },
        "passed": t.passed,
    }
    (t.folder / "tour.json").write_text(json.dumps(saved, indent=1))
    tour_png(t.folder / "tour.png", reference=t.reference, layouts=done, rows=t.rows)
    t.files = ["tour.md", "tour.json", "tour.png"]
    for i, stop in enumerate(all_stops, 1):  # the pictures of single layouts, beside it
        run_dir = out_dir / f"tour-{stamp}-{i}"
        if stop.name.startswith("DDP"):
            shutil.copy(run_dir / "timeline.png", t.folder / "timeline.png")
            t.files.append("timeline.png")
        if stop.config.pp > 1 and (run_dir / "schedule.png").exists():
            shutil.copy(run_dir / "schedule.png", t.folder / "schedule.png")
            t.files.append("schedule.png")
    if _tensorboard(t.folder, all_stops, out_dir, stamp):
        t.files.append("tensorboard")


def _tensorboard(folder: Path, all_stops: list[Stop], out_dir: Path, stamp: str) -> bool:
    """The reference's and every layout's ``metrics.jsonl`` (:mod:`plait.metrics`) as
    TensorBoard runs under ``folder/tensorboard``, one folder each; False without
    tensorboard installed."""
    runs = [("0-reference", folder / "reference-metrics" / "metrics.jsonl")] + [
        (f"{i}-{re.sub('[^a-z0-9]+', '-', stop.name.lower())}",
         out_dir / f"tour-{stamp}-{i}" / "metrics.jsonl")
        for i, stop in enumerate(all_stops, 1)
    ]  # fmt: skip
    try:
        for name, path in runs:
            if path.exists():
                metrics.to_tensorboard(path, folder / "tensorboard" / name)
    except ImportError as exc:
        print(f"no TensorBoard events: {exc}")
        return False
    return True


def _print(t: Tour, all_stops: list[Stop]) -> None:
    print("3. the layouts side by side\n")
    print(table(t.rows))
    print("\n" + LEGEND + "\n")
    for stop, r in zip(all_stops, t.rows, strict=True):
        print(f"- {stop.name}: {stop.trade}.")
        if r.bubble is not None:
            print("  " + bubble_note(stop, r, os.cpu_count() or 1))
        if r.cp_attention_bytes is not None:
            print("  " + context_note(stop, r))
    print(f"\npictures in {t.folder}/:")
    print("  tour.png      loss against step and wall time; memory and bytes per layout")
    if "schedule.png" in t.files:
        print("  schedule.png  the pipeline's last step as it ran (forwards blue, backwards green)")
    if "timeline.png" in t.files:
        print("  timeline.png  DDP's last step: compute and communication per rank")
    if "tensorboard" in t.files:
        print(
            f"  tensorboard/  every run's loss, tokens/s, MFU, peak memory and bytes per step: "
            f"tensorboard --logdir {t.folder}/tensorboard"
        )
    first = t.folder.name
    print(
        f"  every layout's own folder {first}-<1..{len(all_stops)}>/: trace.json (open it in "
        f"https://ui.perfetto.dev or chrome://tracing), curves.png, timeline.png, "
        f"metrics.jsonl (plait.metrics, a line a step); the MoE's "
        f"moe_load.png shows tokens per expert over training\n"
    )
    worst = max(t.rows, key=lambda r: r.max_param_diff / r.check_bound if r.check_bound > 0 else 1)
    if t.passed:
        print(
            f"PASS: all {len(t.rows)} layouts match one process (largest parameter difference "
            f"{worst.max_param_diff:.1e}, {worst.layout}, bound {worst.check_bound:.0e}); the "
            f"reference reaches {t.reference.held_out_nats:.3f} nats per held-out character"
        )
    else:
        bad = [r for r in t.rows if not r.passed]
        print(
            "FAIL: "
            + "; ".join(
                f"{r.layout} ended {r.max_param_diff:.1e} from one process (bound "
                f"{r.check_bound:.0e})"
                for r in bad
            ),
            file=sys.stderr,
        )
    if not math.isfinite(t.reference.held_out_nats):
        print("the reference diverged", file=sys.stderr)


def main(args: Any) -> int:
    """Exit code 1 when any layout ended farther from one process than rounding explains."""
    steps = args.steps if args.steps is not None else STEPS
    ref_steps = getattr(args, "reference_steps", None)
    schedule = SCHEDULE if ref_steps is None else replace(SCHEDULE, steps=ref_steps)
    result = tour(
        steps=steps, schedule=schedule, out_dir=Path(args.out),
        dtype=getattr(args, "dtype", None) or "float64",
    )  # fmt: skip
    return 0 if result.passed and math.isfinite(result.reference.held_out_nats) else 1
