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


def fsdp_fp16_overflow() -> tuple[bool, float, bool, bool]:
    """fully_shard computing in float16 with a loss scale whose gradients overflow: the
    step is skipped (shards unchanged) and the scale halved; a sane scale then steps."""
    from plait.strategies.fsdp import fully_shard
    from plait.strategies.fsdp.policies import MixedPrecisionPolicy

    model = fully_shard(
        ddp_fns.make_model(), mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float16)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = ddp_fns.batch(plait.world().rank)
    too_large = DynamicLossScaler(init_scale=2.0**40)  # float16 tops out at 65504
    too_large.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
    skipped = not too_large.step(optimizer)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.zero_grad()
    sane = DynamicLossScaler(init_scale=2.0**8)
    sane.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
    stepped = sane.step(optimizer)
    moved = stepped and not all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    return skipped, too_large.scale_value, unchanged, moved
