"""What the examples share: a tiny corpus of Python's own documentation as byte tokens (no
download), batches of it, and AdamW with decay / no-decay parameter groups."""

from __future__ import annotations

import torch
from torch import nn

from plait.models import python_docs


def tokens() -> torch.Tensor:
    """Python's documentation as bytes (vocabulary 256)."""
    return torch.tensor(list(python_docs().encode("utf-8")[:200_000]), dtype=torch.long)


def batch(data: torch.Tensor, step: int, *, batch: int, seq: int) -> torch.Tensor:
    """The global batch of ``step``: the same on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def adamw(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (two parameter groups, kept by plait)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )
