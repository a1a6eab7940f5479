"""The tour's first part: the dense GPT trained in one process until it writes words.

Five layouts on 4 ranks cannot each learn English in a few minutes on 2 cores, so the tour
trains the reference once, here, with every core (``threads``), and saves it as a plait
checkpoint (:func:`plait.checkpoint.save`); each layout then continues from that checkpoint
for a few steps and is checked against one process (:mod:`plait.demo.tour`).

The learning rate warms up linearly for ``warmup`` steps, then follows a cosine from
``peak_lr`` down to ``final_lr`` at the last step (:func:`lr_at`); the layouts continue at
``final_lr``. Progress is one line per evaluation point (the mean training loss since the
last one, the held-out loss per character) and a line the model writes at that point.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait import checkpoint
from plait.demo.gpt import PROMPT, corpus, global_batch, held_out_windows
from plait.demo.options import GPTDemoConfig
from plait.metrics import Metrics
from plait.models import GPT, CharTokenizer
from plait.models.gpt import loss


@dataclass(frozen=True)
class Schedule:
    """How long and how fast the reference trains."""

    steps: int = 1000
    warmup: int = 30
    peak_lr: float = 3e-3
    final_lr: float = 3e-4
    evals: int = 10  # progress lines (each with a held-out loss and a line of text)
    threads: int = 0  # torch threads; 0: one or every core, whichever measures faster


def lr_at(step: int, s: Schedule) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up, then cosine decay."""
    if step < s.warmup:
        return s.peak_lr * (step + 1) / s.warmup
    span = max(1, s.steps - 1 - s.warmup)
    done = min(1.0, (step - s.warmup) / span)
    return s.final_lr + (s.peak_lr - s.final_lr) * 0.5 * (1 + math.cos(math.pi * done))


def held_out_loss(model: GPT, config: GPTDemoConfig, tokens: torch.Tensor) -> float:
    """Mean cross-entropy in nats per character over the held-out windows every layout
    measures too (:func:`plait.demo.gpt.held_out_windows`: never trained on)."""
    x, y = held_out_windows(config, tokens)
    model.eval()
    with torch.no_grad():
        value = float(loss(model(x), y))
    model.train()
    return value


def write(model: GPT, config: GPTDemoConfig, *, chars: int, seed: int = 0) -> str:
    """``chars`` characters the model writes after :data:`~plait.demo.gpt.PROMPT`
    (temperature 0.8)."""
    tok = CharTokenizer()
    ids = tok.encode(PROMPT).unsqueeze(0)
    g = torch.Generator().manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for _ in range(chars):
            logits = model(ids[:, -config.seq_len :])[0, -1] / 0.8
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train()
    return tok.decode(ids[0])


@dataclass
class Reference:
    """What the reference run left: its checkpoint and how it got there."""

    root: str  # the plait checkpoint root (load with checkpoint.load, or GPTDemoConfig.init)
    step: int
    held_out_nats: float  # per character, at the end
    train_seconds: float
    losses: list[float] = field(default_factory=list)  # every step's training loss
    step_ends: list[float] = field(default_factory=list)  # seconds since the start
    history: list[dict[str, Any]] = field(default_factory=list)  # the progress points

    @property
    def held_out_bits(self) -> float:
        return self.held_out_nats / math.log(2)


def train(
    config: GPTDemoConfig, schedule: Schedule, *, root: Path, metrics_dir: Path | None = None
) -> Reference:
    """Train the dense GPT of ``config`` (its model, batch and seed) in this process on the
    same global batches the layouts use, and save it under ``root`` at its last step
    (``metrics_dir``: where :class:`plait.metrics.Metrics` writes every step's line)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(schedule.threads or fastest_threads(config))
        return _train(config, schedule, root, metrics_dir)
    finally:
        torch.set_num_threads(threads)


def fastest_threads(config: GPTDemoConfig, *, repeats: int = 3) -> int:
    """1 or every core, whichever runs ``repeats`` forwards and backwards of one batch
    faster here and now: on a busy machine threads that wait for each other cost far more
    than they give (measured: 7x the CPU time of one thread at a load of 8 on 2 cores)."""
    counts = sorted({1, os.cpu_count() or 1})
    if len(counts) == 1:
        return 1
    x, y = global_batch(config, corpus()[0], 0)
    model = GPT(config.model_config())
    seconds = {}
    for n in counts:
        torch.set_num_threads(n)
        loss(model(x), y).backward()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            loss(model(x), y).backward()
        seconds[n] = time.perf_counter() - start
    best = min(counts, key=lambda n: seconds[n])
    said = ", ".join(f"{n}: {1e3 * seconds[n] / repeats:.0f} ms" for n in counts)
    print(f"torch threads: {best} (forward and backward of one batch with {said})", flush=True)
    return best


def _train(
    config: GPTDemoConfig, schedule: Schedule, root: Path, metrics_dir: Path | None
) -> Reference:
    train_tokens, held_tokens = corpus()
    model = GPT(config.model_config())
    opt = torch.optim.Adam(model.parameters(), lr=schedule.peak_lr)
    marks = {round(schedule.steps * (k + 1) / schedule.evals) for k in range(schedule.evals)}
    losses: list[float] = []
    ends: list[float] = []
    history: list[dict[str, Any]] = []
    meter = Metrics(
        model=config.model_config(), progress=False, log_dir=metrics_dir,
        jsonl=metrics_dir is not None,
    )  # fmt: skip
    start = time.perf_counter()
    for step in range(schedule.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        with meter.data():
            x, y = global_batch(config, train_tokens, step)
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.item())
        ends.append(time.perf_counter() - start)
        meter.step(losses[-1], tokens=x.numel(), lr=lr_at(step, schedule))
        if step + 1 in marks:
            since = len(losses) - (history[-1]["step"] if history else 0)
            point = {
                "step": step + 1,
                "lr": lr_at(step, schedule),
                "loss": sum(losses[-since:]) / since,
                "held_out_loss": held_out_loss(model, config, held_tokens),
                "elapsed_s": time.perf_counter() - start,
            }
            history.append(point)
            line = write(model, config, chars=60).replace("\n", " ")
            print(
                f"step {point['step']:>4}/{schedule.steps}  lr {point['lr']:.1e}  loss "
                f"{point['loss']:.3f}  held-out {point['held_out_loss']:.3f} nats/char  "
                f"{point['elapsed_s']:5.1f} s  | {line}",
                flush=True,
            )
            meter.start()  # the held-out pass and the line it writes are no step's time
    meter.close()
    train_s = time.perf_counter() - start
    checkpoint.save(root, step=schedule.steps, model=model, rng=False, keep_last=1)
    return Reference(
        root=str(root),
        step=schedule.steps,
        held_out_nats=history[-1]["held_out_loss"],
        train_seconds=train_s,
        losses=losses,
        step_ends=ends,
        history=history,
    )
