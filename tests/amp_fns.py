"""Rank functions for the loss-scaling tests."""

from __future__ import annotations

import torch

import plait
from plait.amp import DynamicLossScaler
from tests import ddp_fns


def overflow_on_one_rank(bad_rank: int) -> tuple[bool, float, bool]:
    """One rank's gradient overflows: every rank must skip and back off."""
    world = plait.world()
    model = ddp_fns.make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0)
    x, y = ddp_fns.batch(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if world.rank == bad_rank:
        model.fc1.weight.grad[0, 0] = float("inf")
    stepped = scaler.step(optimizer)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return stepped, scaler.scale_value, unchanged
