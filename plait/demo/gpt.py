"""``plait demo --model gpt``: the reference GPT on Python's own documentation, on a mesh.

The text is Python's reference topics (``pydoc_data``, no download), tokenised by character
(:mod:`plait.models.text`); the first 90% trains, the last 10% is held out. Every step draws
one global batch of ``batch_size`` random windows (the same on every rank, seeded by the
step), and the world is laid out as ``Mesh(dp=n/tp, tp=tp)``:

- ``tp`` ranks hold one tensor-parallel model (:func:`plait.prepare` with ``strategy="tp"``:
  attention heads and the MLP split, vocabulary-parallel embedding, head and loss; with
  ``sp`` also sequence parallelism) and see the same rows;
- ``dp`` replicas each take ``batch_size / dp`` rows and average their gradients with
  plait's DDP on the ``dp`` group (tp = 1 is plain DDP).

With ``pp`` the world is ``Mesh(pp=n)`` instead: the GPT cut into ``pp`` stages trained by a
pipeline schedule (``schedule``, ``microbatches``; :class:`plait.strategies.pipeline.
PipelineParallel`), and the report adds the measured bubble of the last step beside the
simulated one and the formula. With ``moe`` every second MLP is a GShard mixture of
``experts`` experts, the world is ``Mesh(ep=ep, dp=n/ep)`` (:mod:`plait.moe`, ``strategy="ep"``),
and the report adds the load statistics and ``moe_load.png`` (tokens per expert over training).
With ``cp`` the world is ``Mesh(dp=n/(cp*tp), cp=cp, tp=tp)``: context parallelism
(``context`` ring or Ulysses attention over cp, :mod:`plait.demo.context`), and the report
adds the attention bytes counted on cp against the formula (a difference fails the demo).
Composing pp, tp and ep with each other, or cp with pp or ep, is not supported by the demo
(refused up front).

The leading rank prints progress (a tqdm bar on a terminal, one line per evaluation point
otherwise): training loss, held-out loss and tokens per second. At the end the parent
writes ``runs/<name>/``: ``report.json`` (history, bytes sent per mesh dimension, parameter
bytes per rank, a text sample), ``trace.json`` and ``curves.png`` (training and held-out
loss against time), and prints a paragraph the trained model writes from a prompt.

``--check`` trains the dense GPT in this process in float64 from the same start on the same
global batches and compares the run with it (:func:`judge`; the run's parameters through
:func:`plait.checkpoint.full_state_dict`), against bounds that hold on any CPU. In float64
the largest parameter difference must stay within :data:`FLOAT64_BOUND`. In float32 Adam
amplifies rounding (an element whose gradient is near zero steps by about lr whatever its
sign), so a largest elementwise difference is chaotic; the check takes the parameters' L2
distance relative to how far training moved them (:mod:`plait.demo.closeness`) and every
step's loss, each within :data:`NOISE_FACTOR` times what float32 shows in one process
(:func:`float32_noise`, measured in the run).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import plait
from plait import comm, moe
from plait.demo import context, layouts
from plait.demo.closeness import distance, max_diff, one_thread
from plait.demo.options import GPTDemoConfig, validate
from plait.demo.pictures import timeline_png
from plait.extras import require
from plait.metrics import Metrics
from plait.models import GPT, CharTokenizer, python_docs, token_batches
from plait.models.gpt import loss
from plait.strategies.pipeline import bubble_report
from plait.strategies.pipeline.draw import draw_png
from plait.strategies.pipeline.report import slots_from_spans
from plait.strategies.pipeline.schedules import build
from plait.strategies.tensor.grid import grid_mesh
from plait.trace import Tracer, write_chrome

PROMPT = "The assert statement"


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): Python's docs by character, split 90/10."""
    tokens = CharTokenizer().encode(python_docs())
    cut = int(0.9 * tokens.numel())
    return tokens[:cut], tokens[cut:]


def global_batch(config: GPTDemoConfig, tokens: torch.Tensor, step: int) -> tuple[Any, Any]:
    """Step ``step``'s global batch (inputs, next tokens), the same on every rank; counted
    from ``config.first_step`` (a run continuing a checkpoint draws the batches after it)."""
    seed = config.seed * 100_003 + config.first_step + step
    return token_batches(tokens, batch=config.batch_size, seq_len=config.seq_len, seed=seed)


def held_out_windows(config: GPTDemoConfig, tokens: torch.Tensor) -> tuple[Any, Any]:
    """About 16 held-out windows, a multiple of the global batch (so that it splits into
    micro-batches and over ranks as a training batch does)."""
    rows = config.batch_size * max(1, round(16 / config.batch_size))
    return token_batches(tokens, batch=rows, seq_len=config.seq_len, seed=1)


@dataclass
class Point:
    step: int
    loss: float  # mean training loss since the previous point
    held_out_loss: float
    tokens_per_s: float
    elapsed_s: float


def _dimension_bytes(mesh: plait.Mesh) -> dict[str, dict[str, int]]:
    """Bytes this rank sent per mesh dimension (and per collective), from group_stats."""
    names = {mesh.group(d).name: d for d in mesh.names if mesh.size(d) > 1}
    out: dict[str, dict[str, int]] = {}
    for (group, collective, algorithm), s in comm.group_stats().items():
        # a group over several dimensions is named like 'mesh0.dp+ep0[0, 1]'
        several = re.match(r"^mesh\d+\.([a-z]+(?:\+[a-z]+)+)\d*\[", group)
        dim = names.get(group, several.group(1) if several else group)
        row = out.setdefault(dim, {})
        # plait's algorithms count what they send; a "native" collective only its payload
        # (what the backend sends is not visible), and its key says so
        key = f"{collective}/{algorithm}" + (" (payload)" if algorithm == "native" else "")
        row[key] = row.get(key, 0) + (s.payload_bytes if algorithm == "native" else s.bytes_sent)
    return out


def train_rank(config: GPTDemoConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Runs on every rank: build the mesh, split the GPT, train, report (rank 0 writes
    ``metrics.jsonl`` into ``run_dir`` when given: :class:`plait.metrics.Metrics`)."""
    validate(config)
    world = plait.world()
    if config.tp_mode != "1d":  # the tp ranks as a 2D / 2.5D / 3D grid, dp outside it
        depth = config.tp_depth if config.tp_mode == "2.5d" else None
        mesh = grid_mesh(config.tp_mode, config.tp, depth=depth, dp=config.dp)
    else:
        mesh = plait.Mesh(**config.mesh_shape())  # type: ignore[arg-type]
    train_tokens, held_tokens = corpus()
    tracer = Tracer(rank=world.rank)
    composed = config.pp > 1 and (config.tp > 1 or config.dp > 1)
    build = (
        layouts.context
        if config.cp > 1
        else layouts.composed
        if composed
        else layouts.pipeline
        if config.pp > 1
        else layouts.experts
        if config.moe
        else layouts.tensor_parallel
    )
    t = build(config, mesh, tracer)
    a, b = t.rows
    lead = world.rank == 0
    x_held, y_held = held_out_windows(config, held_tokens)
    evals = config.eval_points
    marks = {round(config.steps * (k + 1) / evals) for k in range(evals)}
    history: list[Point] = []
    losses: list[float] = []  # this rank's loss at every step
    ends: list[float] = []  # seconds since the start at the end of every step
    loads: list[dict[str, Any]] = []
    comm.reset_stats()
    meter = Metrics(
        mesh=mesh, model=config.model_config(), seq_len=config.seq_len, progress=False,
        log_dir=run_dir, jsonl=run_dir is not None,
    )  # fmt: skip
    start = last = time.perf_counter()
    last_step_ns = last_step_end_ns = 0  # the last training step (the held-out pass after it
    # is a whole pipeline step too: kept out of the bubble and the timeline)
    since, loss_sum = 0, 0.0
    bar = _progress(config, show=lead)
    for step in range(config.steps):
        with meter.data():
            x, y = global_batch(config, train_tokens, step)
        t.optimizer.zero_grad()
        last_step_ns = time.perf_counter_ns()
        loss = t.step(x[a:b], y[a:b])
        with tracer.span("optimizer step", stream="compute"):
            t.optimizer.step()
        last_step_end_ns = time.perf_counter_ns()
        meter.step(loss, tokens=config.batch_size * config.seq_len)
        if config.moe:
            loads.append(moe.collect(t.model))
        losses.append(loss.item())
        loss_sum += losses[-1]
        since += 1
        bar.update(1)
        if step + 1 in marks:
            # every replica's mean loss; the replicas' average is the global batch's
            mean = torch.tensor([loss_sum / since], dtype=torch.float64)
            if t.loss_group is not None:  # None: the step's loss is the global batch's
                comm.all_reduce(mean, "avg", group=t.loss_group, algorithm="auto")
            held = t.held_out(x_held, y_held)
            now = time.perf_counter()
            point = Point(
                step=step + 1,
                loss=float(mean),
                held_out_loss=held,
                tokens_per_s=since * config.batch_size * config.seq_len / (now - last),
                elapsed_s=now - start,
            )
            history.append(point)
            if lead and not bar.disable:
                bar.set_postfix(loss=f"{point.loss:.3f}", held_out=f"{held:.3f}")
            elif lead:
                print(
                    f"step {point.step}/{config.steps}  loss {point.loss:.4f}  held-out "
                    f"{held:.4f}  {point.tokens_per_s:,.0f} tokens/s",
                    flush=True,
                )
            since, loss_sum, last = 0, 0.0, time.perf_counter()
            meter.start()  # the held-out pass is no training step's time
        ends.append(time.perf_counter() - start)
    bar.close()
    meter.close()
    train_s = time.perf_counter() - start
    sent = _dimension_bytes(mesh)  # training only: full_state_dict below gathers over tp
    return {
        "history": [asdict(p) for p in history],
        "losses": losses,
        "ends": ends,
        "spans": tracer.spans(),
        "last_step_ns": last_step_ns,
        "last_step_end_ns": last_step_end_ns,
        "state": t.state(),
        "bytes_by_dim": sent,
        "param_bytes": sum(p.numel() * p.element_size() for p in t.model.parameters()),
        "train_s": train_s,
        "layout": str(mesh) if lead else "",
        "moe": [{k: v.as_dict() for k, v in step.items()} for step in loads],
        "metrics": {"info": meter.info, "summary": meter.summary()},
    }


def _progress(config: GPTDemoConfig, show: bool) -> Any:
    tqdm = require("tqdm", why="plait demo's progress bar").tqdm
    return tqdm(
        total=config.steps,
        desc="training",
        unit="step",
        leave=False,
        file=sys.stdout,
        disable=not (show and sys.stdout.isatty()),
        dynamic_ncols=True,
    )


def _oracle_key(config: GPTDemoConfig) -> tuple[Any, ...]:
    """What the one-process run depends on (the layout does not enter)."""
    c = config
    return (c.model_config(), c.steps, c.batch_size, c.lr, c.seed, c.init, c.first_step)


_ORACLES: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
_ORACLE_LOSSES: dict[tuple[Any, ...], list[float]] = {}


def oracle(
    config: GPTDemoConfig, *, pieces: int = 1, dtype: str | None = None
) -> dict[str, torch.Tensor]:
    """The dense GPT trained in one process on every step's whole global batch, from the
    layouts' start (:func:`~plait.demo.layouts.start_model`) converted to ``dtype``
    (default ``config.dtype``); with ``pieces`` > 1 the batch's gradient is accumulated over
    that many equal row blocks (the same mean, summed in another order). Kept per
    configuration for this process (a tour checks four dense layouts against the same run)."""
    dtype = dtype or config.dtype
    key = (*_oracle_key(config), pieces, dtype)
    if key in _ORACLES:
        return _ORACLES[key]
    train_tokens, _ = corpus()
    model = layouts.start_model(config).to(getattr(torch, dtype))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    with one_thread():
        for step in range(config.steps):
            x, y = global_batch(config, train_tokens, step)
            opt.zero_grad()
            losses.append(0.0)
            for xs, ys in zip(x.chunk(pieces), y.chunk(pieces), strict=True):
                piece = loss(model(xs), ys) * (len(xs) / len(x))
                piece.backward()
                losses[-1] += float(piece.detach())
            opt.step()
    _ORACLES[key] = model.state_dict()
    _ORACLE_LOSSES[key] = losses
    return _ORACLES[key]


def oracle_losses(
    config: GPTDemoConfig, *, pieces: int = 1, dtype: str | None = None
) -> list[float]:
    """Every step's global-batch loss of :func:`oracle` (trained first if it was not)."""
    oracle(config, pieces=pieces, dtype=dtype)
    return _ORACLE_LOSSES[(*_oracle_key(config), pieces, dtype or config.dtype)]


def max_loss_diff(a: list[float], b: list[float]) -> float:
    """The largest difference of two runs' losses at the same step."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def summation_orders(config: GPTDemoConfig) -> tuple[int, ...]:
    """The pieces each batch is summed in by the float32 one-process runs that measure
    rounding: whole, and in two halves. Not for a MoE GPT: its experts' capacity is counted
    over the tokens of one forward, so pieces would change the function, not the order."""
    if config.moe:
        return (1,)
    return (1, 2 if config.batch_size % 2 == 0 else config.batch_size)


@dataclass
class Float32Noise:
    """How far float32 in one process lands from float64 in one process (the same start,
    the same batches), over :func:`summation_orders`: the rounding training amplifies, for
    this configuration on this CPU."""

    distance: float  # the parameters' (closeness.distance), the largest over the orders
    loss: float  # every step's loss, the largest difference over the steps and orders
    orders: tuple[int, ...]


def float32_noise(config: GPTDemoConfig) -> Float32Noise:
    """Measure :class:`Float32Noise` (trains the float64 one-process run and the float32
    ones, kept for this process)."""
    exact = oracle(config, dtype="float64")
    exact_losses = oracle_losses(config, dtype="float64")
    start = layouts.start_model(config).state_dict()
    orders = summation_orders(config)
    return Float32Noise(
        distance=max(distance(oracle(config, pieces=p), exact, start) for p in orders),
        loss=max(max_loss_diff(oracle_losses(config, pieces=p), exact_losses) for p in orders),
        orders=orders,
    )


def loss_floor(losses: list[float]) -> float:
    """:data:`LOSS_ULPS` float32 steps of the largest loss: its own float32 resolution."""
    return LOSS_ULPS * torch.finfo(torch.float32).eps * max(abs(x) for x in losses)


def judge(report: GPTDemoReport, state: dict[str, torch.Tensor]) -> None:
    """Fill ``report``'s ``--check`` fields: the run (``state``, ``report.losses``) against
    the dense GPT trained in one process in float64 from the same start on the same batches.
    float64: the largest parameter difference, within :data:`FLOAT64_BOUND`. float32: the
    parameters' :func:`~plait.demo.closeness.distance` and the largest per-step loss
    difference, each within :data:`NOISE_FACTOR` times what float32 in one process shows
    (:func:`float32_noise`; the loss's bound also :func:`loss_floor`)."""
    config = report.config
    exact = oracle(config, dtype="float64")
    exact_losses = oracle_losses(config, dtype="float64")
    report.max_param_diff = max_diff(state, exact)
    report.max_loss_diff = max_loss_diff(report.losses, exact_losses)
    if config.dtype == "float64":
        report.check_bound = FLOAT64_BOUND
        return
    noise = float32_noise(config)
    report.float32_noise = asdict(noise)
    report.param_distance = distance(state, exact, layouts.start_model(config).state_dict())
    report.check_bound = NOISE_FACTOR * noise.distance
    report.loss_bound = NOISE_FACTOR * noise.loss + loss_floor(exact_losses)


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


#: --check in float64: the largest parameter difference rounding explains on any CPU
FLOAT64_BOUND = 1e-8
#: --check in float32: how many times farther from one process in float64 than float32 in
#: one process lands the run may land, in its parameters and in every step's loss (the
#: measurements that justify it: docs/index.md)
NOISE_FACTOR = 10.0
#: --check in float32: the loss's bound also allows this many float32 steps of the loss
LOSS_ULPS = 4


def check_passed(report: GPTDemoReport) -> bool:
    """False when ``--check`` found the run farther from one process than rounding explains
    (:func:`judge`), or when cp's counted attention bytes differ from the formula
    (``report.cp_bytes``)."""
    if report.cp_bytes and not report.cp_bytes["agree"]:
        return False
    if report.param_distance is not None:  # float32: both statistics within their bounds
        return _within(report.param_distance, report.check_bound) and _within(
            report.max_loss_diff, report.loss_bound
        )
    if report.max_param_diff is None:
        return True
    bound = report.check_bound if report.check_bound is not None else FLOAT64_BOUND
    return report.max_param_diff <= bound


def judged_value(report: GPTDemoReport) -> float | None:
    """The parameters' statistic ``--check`` judged against ``report.check_bound``: the
    distance in float32, the largest difference in float64 (None: not checked)."""
    return report.param_distance if report.param_distance is not None else report.max_param_diff


def _within(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value <= bound


def check_lines(report: GPTDemoReport) -> list[str]:
    """What ``--check`` prints: each statistic against its bound, and what the bounds are."""
    if report.param_distance is None:  # float64
        return [
            f"--check: largest parameter difference to one process on the global batch: "
            f"{report.max_param_diff:.2e} {_verdict(report.max_param_diff, report.check_bound)}",
            f"  largest per-step loss difference to one process: {report.max_loss_diff:.2e}",
        ]
    noise = report.float32_noise
    orders = " and in ".join("whole" if p == 1 else f"{p} pieces" for p in noise["orders"])
    return [
        "--check: against one process in float64, from the same start on the same batches",
        f"  parameter distance, relative to how far training moved them: "
        f"{report.param_distance:.2e} {_verdict(report.param_distance, report.check_bound)}",
        f"  largest per-step loss difference: {report.max_loss_diff:.2e} "
        f"{_verdict(report.max_loss_diff, report.loss_bound)}",
        f"  bounds: {NOISE_FACTOR:g} x how far float32 in one process lands from float64 "
        f"(parameters {noise['distance']:.2e}, loss {noise['loss']:.2e}; each batch summed "
        f"{orders}), the rounding training amplifies, measured here for this run; the "
        f"loss's + {LOSS_ULPS} float32 steps of it. --dtype float64 checks to {FLOAT64_BOUND:g}",
    ]


def _verdict(value: float | None, bound: float | None) -> str:
    said = "ok" if _within(value, bound) else "LARGER THAN EXPECTED"
    return f"({said}: bound {bound if bound is not None else math.nan:.1e})"


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
