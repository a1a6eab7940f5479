"""A model of one's own whose blocks are of two kinds: blocks 0-2 plain attention, block 3
mixing its heads (each head's output less the mean over every head), which a split by heads
cannot reproduce. Used by tests/test_zoo_proof.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, *, mix_heads: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.mix_heads = heads, width // heads, mix_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(width, width, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        if self.mix_heads:
            out = out - out.mean(1, keepdim=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, *, mix_heads: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attn = Attention(width, heads, mix_heads=mix_heads)
        self.mlp = nn.Sequential()
        self.mlp.up_proj = nn.Linear(width, 2 * width)
        self.mlp.act = nn.GELU()
        self.mlp.down_proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Planted(nn.Module):
    """Four blocks; block ``mixed`` mixes its heads."""

    def __init__(self, *, vocab: int = 64, width: int = 32, heads: int = 4, mixed: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, mix_heads=i == mixed) for i in range(4))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def planted(mixed: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return Planted(mixed=mixed).to(torch.float64)
