"""A model in the shape of torchtitan's Llama 3 (``torchtitan/models/llama3/model/model.py``),
written for the tests: the class names and module paths it uses (``Transformer``,
``tok_embeddings``, ``layers.<i>.attention.{wq,wk,wv,wo,q_norm,k_norm}``,
``feed_forward.{w1,w2,w3}``, ``norm``, ``output``), its own subclasses of ``nn.Linear`` and
``nn.Embedding`` (initialisation only), a complex RoPE buffer, grouped-query attention that
infers its local heads from the widths. The rotary maths runs in the activations' dtype
(complex128 for float64) so a float64 comparison stays exact."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    """An nn.Linear with its own initialisation (forward unchanged)."""

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """An nn.Embedding with its own initialisation (forward unchanged)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.5)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # local heads: -1
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        rot = freqs_cis[:seqlen].view(1, seqlen, 1, -1)
        q = torch.view_as_real(torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2)) * rot)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(*k.shape[:-1], -1, 2)) * rot)
        q, k = q.flatten(3), k.flatten(3)
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 2 * dim)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(
        self, *, vocab: int, dim: int, layers: int, n_heads: int, n_kv_heads: int, seq: int
    ) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, n_heads, n_kv_heads) for i in range(layers)}
        )
        self.norm = nn.RMSNorm(dim)
        self.output = Linear(dim, vocab, bias=False)
        half = dim // n_heads // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))
