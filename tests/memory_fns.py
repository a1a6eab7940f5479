"""Rank function for measured-vs-estimated memory on real runs."""

from __future__ import annotations

import torch
from torch import nn

import plait
from plait.plan import memory


def measured_after_one_step(strategy: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    options = {"wrap": {nn.Linear}} if strategy == "fsdp" else {}
    model, optimizer = plait.prepare(model, optimizer, strategy=strategy, **options)
    assert optimizer is not None
    world = plait.world()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(world.rank))
    model(x).square().mean().backward()
    optimizer.step()
    m = memory.measure(model, optimizer)
    return {
        "params": m.params_bytes,
        "grads": m.grads_bytes,
        "optimizer": m.optimizer_bytes,
        "total": m.total_bytes,
    }
