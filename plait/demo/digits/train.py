"""What every rank of the digits demo runs: :func:`train_rank`, the training loop a user
would write under :func:`plait.prepare`, with its evaluation points (:class:`EpochStats`),
progress bar and the parameter server's statistics."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint, comm
from plait.data import split_batch
from plait.demo.digits.config import (
    DemoConfig,
    judged_after_epoch_1,
    push_lr,
    reproducible_options,
    validate,
)
from plait.demo.digits.data import build_model, global_batches, load_digits
from plait.extras import require
from plait.strategies.ps import ps_of
from plait.strategies.reproducible import ReproducibleRunner
from plait.trace import Tracer


@dataclass
class EpochStats:
    epoch: int
    loss: float
    test_accuracy: float
    samples_per_s: float
    seconds: float
    elapsed_s: float
    updates: int = 0  # parameter versions so far (steps, or server updates under ps)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _progress(config: DemoConfig, epoch: int, steps: int, show: bool) -> Any:
    """A tqdm bar over an epoch's steps; disabled (writes nothing) unless ``show`` and
    stdout is a terminal, so piped output and log files hold no carriage returns."""
    tqdm = require("tqdm", why="plait demo's progress bar").tqdm
    return tqdm(
        total=steps,
        desc=f"epoch {epoch + 1}/{config.epochs}",
        unit="step",
        leave=False,
        file=sys.stdout,
        disable=not (show and sys.stdout.isatty()),
        dynamic_ncols=True,
    )


def _options(config: DemoConfig, tracer: Tracer) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if config.strategy == "ps":
        slow = dict([config.slow_worker]) if config.slow_worker else None
        return {
            "mode": config.ps_mode,
            "servers": config.servers,
            "staleness": config.staleness,
            "backup_workers": config.backup_workers,
            "slow_workers": slow,
            "max_staleness": config.max_staleness,
            "staleness_aware": config.staleness_aware,
        }
    if config.strategy != "none":
        options["algorithm"] = config.algorithm
    if config.strategy in ("ddp", "zero1", "zero2"):
        options["bucket_mb"] = config.bucket_mb
    return options


def train_rank(config: DemoConfig, check: bool = False) -> dict[str, Any]:
    """Runs on every rank: the training loop a user would write, under ``plait.prepare``.
    ``check`` in float32: keep the parameters after the first epoch too (:func:`judge`; on
    a sharded strategy one gather more, counted in the bytes)."""
    world = plait.world()
    n, rank = config.trainers, world.rank
    validate(config)
    x_train, y_train, x_test, y_test = load_digits(config.seed)
    dtype = getattr(torch, config.dtype)
    x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    model = build_model(config.seed, config.dtype)
    optimizer: torch.optim.Optimizer | None
    optimizer = torch.optim.SGD(model.parameters(), lr=push_lr(config), momentum=0.9)
    tracer = Tracer(rank=rank)
    model_w, optimizer = plait.prepare(
        model,
        optimizer,
        strategy=config.strategy,
        tracer=tracer,
        **_options(config, tracer),
        **reproducible_options(config),
    )
    runner: ReproducibleRunner | None = None
    if isinstance(model_w, ReproducibleRunner):  # --reproducible: it drives the micro-batches
        runner, model_w = model_w, model_w.module
    ps = config.strategy == "ps"
    if optimizer is None:  # a parameter server: prepare served until the workers finished
        return {
            "role": "server",
            "ps": _stats_dict(ps_of(model_w).stats()),
            "spans": tracer.spans(),
            "state": checkpoint.full_state_dict(model_w),
            "history": [],
        }
    trainer = rank - config.lead
    history: list[EpochStats] = []
    first_epoch: dict[str, torch.Tensor] = {}  # the parameters after the first epoch
    start = time.perf_counter()
    comm.reset_stats()
    evals = config.evals_per_epoch
    steps = 0
    for epoch in range(config.epochs):
        batches = global_batches(config, epoch)
        steps = len(batches)
        marks = {round(steps * (k + 1) / evals) for k in range(evals)}
        t0 = time.perf_counter()
        loss_sum = torch.zeros(1, dtype=torch.float64)
        done, done_loss = 0, 0.0
        model_w.train()
        bar = _progress(config, epoch, steps, show=rank == config.lead)
        for step in range(steps):
            batch = torch.tensor(batches[step])
            if runner is not None:  # the global mean loss, the same on every rank
                xs, ys = x_train[batch], y_train[batch]
                loss, weight = runner.step(runner.block(xs), runner.block(ys)), 1.0
            else:
                (x, y), weight = split_batch(
                    (x_train[batch], y_train[batch]), num_replicas=n, rank=trainer
                )
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model_w(x), y)
                # weight = rows * n / batch: the ranks' average of weighted means is the
                # mean over the global batch, however unevenly it divides
                (loss * weight).backward()
            optimizer.step()
            loss_sum += loss.item() * weight
            bar.update(1)
            if step + 1 in marks and step + 1 < steps:  # a mid-epoch evaluation point
                point = _evaluate(
                    model_w,
                    x_test,
                    y_test,
                    epoch=epoch + 1,
                    loss=(float(loss_sum) - done_loss) / (step + 1 - done),
                    samples=(step + 1) * config.batch_size,
                    t0=t0,
                    start=start,
                    updates=_updates(optimizer, epoch * steps + step + 1),
                )
                history.append(point)
                done, done_loss = step + 1, float(loss_sum)
        seconds = time.perf_counter() - t0
        bar.close()
        if not ps:  # workers under a parameter server report their own loss
            comm.all_reduce(loss_sum, "sum", group=world, algorithm="auto")
        ranks_in_loss = 1 if ps else n
        stats = _evaluate(
            model_w,
            x_test,
            y_test,
            epoch=epoch + 1,
            loss=float(loss_sum) / (steps * ranks_in_loss),
            samples=steps * config.batch_size,
            t0=t0,
            start=start,
            updates=_updates(optimizer, (epoch + 1) * steps),
        )
        history.append(stats)
        if epoch == 0 and check and judged_after_epoch_1(config):
            first_epoch = {k: v.clone() for k, v in checkpoint.full_state_dict(model_w).items()}
        if rank == config.lead:
            print(
                f"epoch {stats.epoch}/{config.epochs}  loss {stats.loss:.4f}  "
                f"test accuracy {stats.test_accuracy:.2%}  "
                f"{stats.samples_per_s:,.0f} samples/s  ({seconds:.1f} s)",
                flush=True,
            )
    result: dict[str, Any] = {"role": "trainer"}
    if ps:
        optimizer.finish()  # type: ignore[attr-defined]
        result = {"role": "worker", "ps": _stats_dict(ps_of(model_w).stats())}
    stats_bytes = {f"{c}/{a}": vars(s) for (c, a), s in comm.stats().items()}
    return {
        **result,
        "history": [asdict(h) for h in history],
        "spans": tracer.spans(),
        "state": checkpoint.full_state_dict(model_w),
        "first_epoch_state": first_epoch,
        "comm": stats_bytes,
        "steps_per_epoch": steps,
    }


def _updates(optimizer: torch.optim.Optimizer, steps: int) -> int:
    version = getattr(optimizer, "version", None)
    return steps if version is None else int(version)


def _evaluate(
    model: nn.Module,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    *,
    epoch: int,
    loss: float,
    samples: int,
    t0: float,
    start: float,
    updates: int,
) -> EpochStats:
    """An evaluation point: test accuracy now, and the loss and throughput since ``t0``."""
    now = time.perf_counter()
    return EpochStats(
        epoch=epoch,
        loss=loss,
        test_accuracy=_accuracy(model, x_test, y_test),
        samples_per_s=samples / max(now - t0, 1e-9),
        seconds=now - t0,
        elapsed_s=now - start,
        updates=updates,
    )


def _stats_dict(stats: Any) -> dict[str, Any]:
    out = asdict(stats)
    out.pop("clock_gaps", None)
    out.pop("versions", None)
    for name in ("mean_staleness", "steps_per_s"):
        if hasattr(stats, name):
            out[name] = getattr(stats, name)
    return out
