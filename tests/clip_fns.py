"""Rank functions for tests/test_clip.py: one clipped SGD step under each strategy."""

from __future__ import annotations

import torch
from torch import nn

import plait
from plait import comm
from plait.checkpoint import full_state_dict


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def oracle(max_norm: float, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    x, y = batch()
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        opt.step()
    return norms, net.state_dict()


def run(strategy: str, max_norm: float, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    g = comm.world()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    net, opt = plait.prepare(net, opt, strategy=strategy)
    x, y = batch()
    rows = x.shape[0] // g.size
    mine = slice(g.rank * rows, (g.rank + 1) * rows)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
        norms.append(float(plait.clip_grad_norm_(net, opt, max_norm)))
        opt.step()
    return norms, {k: v.clone() for k, v in full_state_dict(net).items()}
