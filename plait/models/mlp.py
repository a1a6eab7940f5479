"""A plain multi-layer perceptron: Linear, activation, ..., Linear."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """``sizes = (in, hidden..., out)``: Linear layers ``fc0 .. fc{n-1}`` with GELU between.

    Built from ``torch.manual_seed(seed)`` when ``seed`` is given, so every rank that
    builds it with the same seed holds the same weights.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        bias: bool = True,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"MLP sizes must be >= 2 positive widths (in, ..., out), got {sizes}")
        if seed is not None:
            torch.manual_seed(seed)
        self.sizes = tuple(int(s) for s in sizes)
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias, dtype=dtype)
            for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = nn.functional.gelu(x)
        return x
