"""A model shaped like torchtitan's Llama 3 (what users hand to plait whole): a complex64
rotary table as a non-persistent buffer, ``nn.Linear`` / ``nn.Embedding`` subclasses, RMSNorm,
grouped-query attention. Small, seeded, float64 compute (the rotary product in complex128)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    """A subclass, as torchtitan's float8 and tensor-parallel code paths create."""


class Embedding(nn.Embedding):
    pass


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))  # complex64


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    f = freqs_cis[: x.shape[1]].to(xc.dtype).view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * f).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = Linear(dim, heads * self.head_dim, bias=False)
        self.wk = Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            Linear(dim, hidden, False),
            Linear(hidden, dim, False),
            Linear(dim, hidden, False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(
        self, *, vocab: int = 50, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, 64), persistent=False)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def build(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer().double()
