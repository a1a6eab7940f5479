"""Splitting a flat buffer into per-rank chunks."""

from __future__ import annotations

import torch


def even_counts(numel: int, parts: int) -> list[int]:
    """Element counts of ``parts`` chunks covering ``numel``; the first ``numel % parts``
    chunks hold one element more, so no two chunks differ by more than one."""
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split(flat: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Views of ``flat`` (1-D, contiguous) with the given element counts."""
    return list(torch.split(flat, counts)) if counts else []
