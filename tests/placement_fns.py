"""Rank functions for tests/test_placement.py."""

from __future__ import annotations

import torch

import plait
from plait.comm.group import Group
from plait.strategies.placement import place


def _full_grads() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.float64),
    )


def clip_split_and_copied(norm_type: float, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """A weight split by rows over the world, a bias copied on every rank; clip them."""
    world: Group = plait.runtime.world()
    w, b = _full_grads()
    rows = w.shape[0] // world.size
    pw = torch.nn.Parameter(torch.zeros(rows, w.shape[1], dtype=torch.float64))
    pb = torch.nn.Parameter(torch.zeros_like(b))
    pw.grad = w[world.rank * rows : (world.rank + 1) * rows].clone()
    pb.grad = b.clone()
    place(pw, shard=(world,))
    place(pb, replicate=(world,))
    norm = plait.clip_grad_norm_([pw, pb], max_norm, norm_type)
    return float(norm), [pw.grad, pb.grad]


def unplaced_refused() -> str:
    world: Group = plait.runtime.world()
    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad, b.grad = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    place(a, shard=(world,))
    try:
        plait.clip_grad_norm_([a, b], 1.0)
    except ValueError as e:
        return str(e)
    return "not refused"
