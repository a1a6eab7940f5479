"""``--check`` for the digits demo: one process on the global batches (:func:`oracle`, or the
same micro-batches and tree under ``--reproducible``), how far float32 in one process lands
from float64 (:func:`float32_noise`), and :func:`judge`, which fills a report's check fields
(the package docstring gives the bounds and why they hold)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import plait
from plait.data import split_batch
from plait.demo.closeness import distance, max_diff, one_thread
from plait.demo.digits.config import (
    FLOAT64_BOUND,
    NOISE_FACTOR,
    DemoConfig,
    judged_after_epoch_1,
    reproducible_options,
)
from plait.demo.digits.data import build_model, global_batches, load_digits
from plait.strategies.reproducible import ReproducibleRunner

if TYPE_CHECKING:  # report.py imports this module to judge its runs
    from plait.demo.digits.report import DemoReport


def oracle(config: DemoConfig, *, pieces: int | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batch of every step (the union of the ranks' batches), in
    ``config.dtype`` from the ranks' start (initialised in float32).

    The mean loss over the global batch is written as ``pieces`` weighted shard means
    averaged (default: one per training rank, the ranks' own summation order); another
    ``pieces`` is the same computation summed in another order (:func:`float32_noise`)."""
    x_train, y_train, _, _ = load_digits(config.seed)
    x_train = x_train.to(getattr(torch, config.dtype))
    model = build_model(config.seed, config.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    if config.reproducible:
        return _reproducible_oracle(config, model, optimizer, x_train, y_train)
    n = pieces if pieces is not None else config.trainers
    with one_thread():
        for epoch in range(config.epochs):
            for indices in global_batches(config, epoch):
                batch = torch.tensor(indices)
                optimizer.zero_grad()
                loss = torch.zeros((), dtype=x_train.dtype)
                for r in range(n):
                    (x, y), weight = split_batch(
                        (x_train[batch], y_train[batch]), num_replicas=n, rank=r
                    )
                    if weight:
                        loss = loss + nn.functional.cross_entropy(model(x), y) * weight
                (loss / n).backward()
                optimizer.step()
    return model.state_dict()


def _reproducible_oracle(
    config: DemoConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``--reproducible``: one process on the same micro-batches and the same tree (it pins
    one intra-op thread, as every rank does, for its duration)."""
    threads = torch.get_num_threads()
    try:
        runner, _ = plait.prepare(model, optimizer, strategy="none", **reproducible_options(config))
        assert isinstance(runner, ReproducibleRunner)
        for epoch in range(config.epochs):
            for indices in global_batches(config, epoch):
                batch = torch.tensor(indices)
                runner.step(x_train[batch], y_train[batch])
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


def float32_noise(config: DemoConfig, exact: dict[str, torch.Tensor]) -> float:
    """How far float32 in one process lands from ``exact`` (:func:`oracle` of ``config`` in
    float64): the largest :func:`~plait.demo.closeness.distance` over the global batch
    summed in the ranks' pieces and whole (two pieces for one rank). The same arithmetic in
    float32 in another order: the rounding the training amplified, on this CPU."""
    start = build_model(config.seed).state_dict()
    orders = sorted({config.trainers, 1 if config.trainers > 1 else 2})
    return max(distance(oracle(config, pieces=m), exact, start) for m in orders)


def judge(config: DemoConfig, results: list[dict[str, Any]], report: DemoReport) -> None:
    """Fill ``report``'s ``--check`` fields from the ranks' ``results`` (see the module
    docstring). ``--reproducible``: the same micro-batches in the same dtype, bitwise, at
    the end; float64: the largest parameter difference at the end within
    :data:`FLOAT64_BOUND`; float32: after the first epoch, the
    :func:`~plait.demo.closeness.distance` to float64 within :data:`NOISE_FACTOR` times
    :func:`float32_noise`."""
    state = results[0]["state"]
    if config.reproducible:
        report.max_param_diff, report.check_bound = max_diff(state, oracle(config)), 0.0
        return
    if config.dtype == "float64":
        report.max_param_diff, report.check_bound = max_diff(state, oracle(config)), FLOAT64_BOUND
        return
    if judged_after_epoch_1(config):
        state = results[config.lead].get("first_epoch_state")
        if not state:
            raise ValueError("float32 --check compares epoch 1: run train_rank(config, check=True)")
    first = replace(config, epochs=1)
    exact = oracle(replace(first, dtype="float64"))
    report.max_param_diff = max_diff(state, exact)
    report.float32_noise = float32_noise(first, exact)
    report.param_distance = distance(state, exact, build_model(config.seed).state_dict())
    report.check_bound = NOISE_FACTOR * report.float32_noise
