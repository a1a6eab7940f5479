"""Rank functions for tests/test_titan_like.py: a torchtitan-shaped model (complex64 RoPE
buffer, subclassed layers) under DDP and FSDP against one process, float64."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from tests import titan_like

STEPS, BATCH, SEQ, CLIP = 3, 4, 8, 0.05


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 3e-3},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 50, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def oracle() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = titan_like.build()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(strategy: str) -> tuple[dict[str, torch.Tensor], list[float], bool]:
    world = plait.runtime.world()
    model = titan_like.build()
    if world.rank == 1:  # a stale table on one rank: the wrap makes every rank hold rank 0's
        model.freqs_cis.mul_(0.5)
    options: dict[str, Any] = {}
    if strategy == "fsdp":
        options["wrap"] = {titan_like.Block}
    wrapped, opt = plait.prepare(
        model, torch.optim.AdamW(_groups(model), lr=1e-2), strategy=strategy, **options
    )
    assert opt is not None
    same_table = torch.equal(model.freqs_cis, titan_like.build().freqs_cis)
    rows = BATCH // world.size
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        part = slice(world.rank * rows, (world.rank + 1) * rows)
        _loss(wrapped(x[part]), y[part]).backward()
        # the PyTorch spelling: DDP holds whole averaged gradients, FSDP its placed shards
        norms.append(float(plait.clip_grad_norm_(wrapped.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    state = plait.checkpoint.full_state_dict(wrapped)
    return {k: v.detach().clone() for k, v in state.items()}, norms, same_table
