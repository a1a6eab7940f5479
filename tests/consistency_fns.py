"""Rank functions for tests/test_consistency.py."""

from __future__ import annotations

from torch import nn

from plait import comm
from plait.strategies.consistency import verify_same_parameters


def check(swap_on: int, widen_on: int = -1) -> str:
    """Build a small model (rank ``swap_on`` registers two layers the other way round,
    rank ``widen_on`` builds a wider last layer), verify it; return "ok" or the error."""
    g = comm.world()
    width = 6 if g.rank == widen_on else 5
    layers = [("a", nn.Linear(4, 5)), ("b", nn.Linear(5, 5)), ("c", nn.Linear(5, width))]
    if g.rank == swap_on:
        layers[0], layers[1] = layers[1], layers[0]
    model = nn.Sequential()
    for name, layer in layers:
        model.add_module(name, layer)
    try:
        verify_same_parameters(model.named_parameters(), g, who="TestWrapper")
    except ValueError as exc:
        return str(exc)
    return "ok"
