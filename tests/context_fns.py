"""Rank functions for tests/test_context.py: ring and Ulysses attention, and models under
context parallelism, against one process on the whole sequence (float64)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait import comm
from plait.strategies.context import (
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from plait.strategies.context.ring_attention import WORK

B, H, D = 2, 4, 5


def qkv(seq: int, kv_heads: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global q, k, v and an upstream gradient, the same on every rank."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, seq, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, seq, D, generator=g, dtype=torch.float64)
    dy = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    return q, k, v, dy


def attention_vs_oracle(
    kernel: str, seq: int, causal: bool, balanced: bool, kv_heads: int = H
) -> dict[str, Any]:
    """This rank's output and q/k/v gradients against its rows of one-process attention."""
    mesh = plait.Mesh(cp=plait.world().size)
    q, k, v, dy = qkv(seq, kv_heads)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(
        *leaves, is_causal=causal, enable_gqa=kv_heads != H
    )
    want.backward(dy)
    mine = [shard_sequence(t, mesh, balanced=balanced, dim=2)[0] for t in (q, k, v, dy)]
    local = [t.clone().requires_grad_(True) for t in mine[:3]]
    fn = ring_attention if kernel == "ring" else ulysses_attention
    comm.reset_stats()
    got = fn(*local, group=mesh.group("cp"), causal=causal, balanced=balanced)
    got.backward(mine[3])
    sent = {k[1]: v.bytes_sent for k, v in comm.group_stats().items()}
    calls = {k[1]: v.calls for k, v in comm.group_stats().items()}

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach() - b).abs().max())

    shard = lambda t: shard_sequence(t, mesh, balanced=balanced, dim=2)[0]  # noqa: E731
    return {
        "out": err(got, shard(want.detach())),
        "grads": [err(a.grad, shard(b.grad)) for a, b in zip(local, leaves, strict=True)],
        "work": WORK.get((mesh.size("cp"), mesh.group("cp").rank)),
        "sent": sent,
        "calls": calls,
        "kv_bytes": 2 * local[1].numel() * local[1].element_size(),
        "q_bytes": local[0].numel() * local[0].element_size(),
    }
