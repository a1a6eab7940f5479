"""Models, data and rank functions for the reproducible-mode tests (tests/test_reproducible.py).

Every case trains the same float32 MLP on the same global batches (B=16, micro-batches of
m=2, so M=8 and world sizes 1, 2, 4 and 8 all split the tree) for a few Adam steps and
returns its full parameters; the test compares them with ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.fsdp import full_state_dict

FEATURES, HIDDEN, OUT = 8, 32, 4
GLOBAL_BATCH, MICROBATCH, STEPS = 16, 2, 5


def make_model(seed: int = 0, depth: int = 8) -> nn.Sequential:
    """``depth`` linears with tanh between: enough layers for 8 pipeline stages."""
    torch.manual_seed(seed)
    widths = [FEATURES] + [HIDDEN] * (depth - 1) + [OUT]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def batch(step: int, n: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, OUT, generator=g)


def _state(model: nn.Module, runner: Any, strategy: str) -> dict[str, torch.Tensor]:
    if strategy in ("fsdp", "zero3"):
        return {k: v.clone() for k, v in full_state_dict(runner.module).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    strategy: str,
    options: dict[str, Any] | None = None,
    steps: int = STEPS,
    world: bool = True,
) -> dict[str, torch.Tensor]:
    """``steps`` Adam steps in reproducible mode; the full parameters afterwards.
    ``world=False``: one process without a group (the oracle)."""
    threads = torch.get_num_threads()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = dict(options or {})
    if world and strategy != "none":
        extra.setdefault("mesh", plait.world())
    runner, optimizer = plait.prepare(
        model,
        optimizer,
        strategy=strategy,
        reproducible=True,
        microbatch_size=MICROBATCH,
        loss_fn=nn.functional.mse_loss,
        **extra,
    )
    try:
        for step in range(steps):
            x, y = batch(step)
            runner.step(runner.block(x), runner.block(y))
            assert optimizer is not None
            optimizer.step()
        return _state(model, runner, strategy)
    finally:
        torch.set_num_threads(threads)


def cases(specs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, torch.Tensor]]:
    """Several cases in one visit of the ranks: ``[(strategy, options), ...]``."""
    return [train(strategy, options) for strategy, options in specs]


def train_pipeline(schedule: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Every rank one pipeline rank; M=8 micro-batches of m=2 in reproducible mode."""
    threads = torch.get_num_threads()
    model = make_model()
    pipe, optimizer = plait.prepare(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        strategy="pipeline",
        mesh=plait.Mesh(pp=plait.world().size),
        schedule=schedule,
        microbatches=GLOBAL_BATCH // MICROBATCH,
        loss_fn=nn.functional.mse_loss,
        reproducible=True,
    )
    assert optimizer is not None
    try:
        for step in range(steps):
            x, y = batch(step)
            optimizer.zero_grad()
            pipe.step(x, y)
            optimizer.step()
        return {k: v.clone() for k, v in pipe.dense_state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def pipeline_cases(schedules: list[str]) -> list[dict[str, torch.Tensor]]:
    return [train_pipeline(s) for s in schedules]
