"""Models, data and rank functions for the data-parallel tests.

The oracle (DESIGN decision 5): the same model, seed and data trained in one process on
the global batch. Ranks train on contiguous, equal shards of each global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait

FEATURES, OUT, GLOBAL_BATCH = 8, 4, 24


class Net(nn.Module):
    """A small MLP with a buffer, and an optional branch the forward never uses."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, OUT)
        self.register_buffer("calls", torch.zeros(1))
        self.extra = nn.Linear(3, 3) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = float(self.calls.item())  # what the forward started from
        self.calls += 1 + plait.world().rank if plait.is_initialized() else 1
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0, unused_branch: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(unused_branch)


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    raise ValueError(name)


def batch(step: int, n: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, OUT, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def train_one_process(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """The oracle's loop: one process, the whole global batch at every step."""
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def oracle(steps: int, opt: str, seed: int = 0) -> list[torch.Tensor]:
    """One process, the global batch."""
    model = make_model(seed)
    train_one_process(model, make_optimizer(model, opt), steps)
    return [p.detach().clone() for p in model.parameters()]


def train(
    strategy: str,
    steps: int,
    opt: str,
    options: dict[str, Any] | None = None,
    hook: str | None = None,
    perturb: bool = True,
) -> list[torch.Tensor]:
    """Runs on every rank: train under ``strategy``; return the parameters."""
    world = plait.world()
    model = make_model()
    if perturb:  # replicas start different: wrapping must broadcast rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(world.rank)
    optimizer = make_optimizer(model, opt)
    wrapped, optimizer = plait.prepare(model, optimizer, strategy=strategy, **(options or {}))
    if hook is not None:
        wrapped.register_comm_hook(None, getattr(plait.strategies, hook))
    assert optimizer is not None
    return run_steps(wrapped, model, optimizer, steps)


def run_steps(
    wrapped: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int
) -> list[torch.Tensor]:
    """The training loop every strategy test shares: this rank's shard of each global batch."""
    world = plait.world()
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        out = wrapped(shard(x, world.rank, world.size))
        nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_torch_ddp(steps: int, opt: str) -> list[torch.Tensor]:
    """Runs on every rank: the same training under torch.nn.parallel.DistributedDataParallel."""
    model = make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    return run_steps(wrapped, model, make_optimizer(model, opt), steps)


def no_sync_vs_one_batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two micro-batches, the first under no_sync, against both in one backward."""
    world = plait.world()
    results = []
    for accumulate in (True, False):
        model = make_model()
        optimizer = make_optimizer(model, "sgd")
        ddp = plait.DistributedDataParallel(model, bucket_mb=0.0005)
        (xa, ya), (xb, yb) = batch(0), batch(1)
        xa, ya, xb, yb = (shard(t, world.rank, world.size) for t in (xa, ya, xb, yb))
        if accumulate:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(xa), ya).backward()
            nn.functional.mse_loss(ddp(xb), yb).backward()
        else:
            loss = nn.functional.mse_loss(ddp(xa), ya) + nn.functional.mse_loss(ddp(xb), yb)
            loss.backward()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results[0], results[1]


def unused_parameter(find_unused: bool) -> str | list[torch.Tensor]:
    world = plait.world()
    model = make_model(unused_branch=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = plait.DistributedDataParallel(model, find_unused_parameters=find_unused)
    for step in range(2):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(
            ddp(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
        )
        try:
            loss.backward()
        except RuntimeError as exc:
            if "find_unused_parameters" not in str(exc):
                raise
            return str(exc)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def buffers_after(broadcast_buffers: bool) -> float:
    """The buffer value the third forward started from."""
    model = make_model()
    ddp = plait.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    for step in range(3):
        ddp(batch(step)[0])
    return model.seen


def train_full(strategy: str, steps: int, opt: str) -> dict[str, torch.Tensor]:
    """Train under a sharding strategy through plait.prepare; the full state dict after."""
    from plait import checkpoint

    model = make_model()
    wrapped, optimizer = plait.prepare(model, make_optimizer(model, opt), strategy=strategy)
    assert optimizer is not None
    run_steps(wrapped, wrapped, optimizer, steps)
    return checkpoint.full_state_dict(wrapped)
