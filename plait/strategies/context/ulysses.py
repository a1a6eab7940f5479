"""All-to-all sequence parallelism (DeepSpeed-Ulysses): attention on whole sequences of
a subset of the heads.

Each cp rank holds ``S / c`` tokens of every head (``[b, heads, S/c, d]``, chunks laid out
as :mod:`.layout` says). One all-to-all per tensor turns that into ``heads / c`` heads of
the whole sequence (``[b, heads/c, S, d]``): block ``i`` (heads ``i*heads/c ..``) goes to
cp rank ``i``. The tokens arrive rank by rank; they are put in sequence order (a local
permutation, the load-balanced layout included), attention runs locally
(``scaled_dot_product_attention``, so any kernel PyTorch has), and the output goes back the
same way. ``heads`` must divide by ``c`` (refused otherwise, naming both). Grouped-query
attention: keys and values are sent compact (``kv_heads / c`` per rank) when ``c`` divides
``kv_heads``; otherwise they are repeated to ``heads`` heads before the all-to-all (more
bytes, the same result).

Communication, on the cp group only (``plait.comm.all_to_all``, even blocks), per layer:

==========  ========================================  =================================
pass        all-to-alls                               elements sent per rank (each)
==========  ========================================  =================================
forward     q, k, v to head-split; output back        ``(c - 1) / c`` of the tensor
backward    d(output) to head-split; dq, dk, dv back  ``(c - 1) / c`` of the tensor
==========  ========================================  =================================

(the rank's own block stays local: 4 all-to-alls forward, 4 backward).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

from plait import comm
from plait.comm.group import Group
from plait.strategies.context.layout import chunks_of


def _seq_to_heads(x: torch.Tensor, group: Group, balanced: bool) -> torch.Tensor:
    """``[b, h, s, d]`` (my tokens, all heads) -> ``[b, h/c, c*s, d]`` (my heads, every
    rank's tokens put in sequence order: one all-to-all, one copy)."""
    c = group.size
    b, h, s, d = x.shape
    send = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)
    n = s // 2
    where = _where(c, balanced)  # global chunk -> (rank, slot)
    return torch.cat([recv[i, :, :, j * n : (j + 1) * n] for i, j in where], dim=2)


def _heads_to_seq(x: torch.Tensor, group: Group, balanced: bool) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    c = group.size
    b, hc, cs, d = x.shape
    n = cs // (2 * c)
    send = x.new_empty(c, b, hc, 2, n, d)
    for chunk, (i, j) in enumerate(_where(c, balanced)):
        send[i, :, :, j].copy_(x[:, :, chunk * n : (chunk + 1) * n])
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)
    # laid out [b, tokens, heads, d] in memory, as PyTorch's CPU flash kernel lays out its
    # output: a model's ``transpose(1, 2).reshape(b, s, -1)`` of it is then a view, not a copy
    out = x.new_empty(b, 2, n, c, hc, d)
    out.copy_(recv.permute(1, 3, 4, 0, 2, 5))
    return out.view(b, 2 * n, c * hc, d).transpose(1, 2)


def _where(c: int, balanced: bool) -> list[tuple[int, int]]:
    """For each global chunk in sequence order, the (cp rank, slot 0|1) that holds it."""
    where = {}
    for rank in range(c):
        for slot, chunk in enumerate(chunks_of(rank, c, balanced=balanced)):
            where[chunk] = (rank, slot)
    return [where[i] for i in range(2 * c)]


class _SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence-split -> head-split; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, balanced: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.balanced = group, balanced
        return _seq_to_heads(x.detach(), group, balanced)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _heads_to_seq(grad, ctx.group, ctx.balanced), None, None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all head-split -> sequence-split; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, balanced: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.balanced = group, balanced
        return _heads_to_seq(x.detach(), group, balanced)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.balanced), None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence held by ``group``, by
    all-to-all to head-split and back (module docstring: the contract and its bytes).

    ``q`` ``[b, heads, S/c, d]``, ``k``/``v`` ``[b, kv_heads, S/c, d]``; ``heads`` must be
    divisible by the cp size. Returns ``[b, heads, S/c, d]``. Collective over ``group``.
    """
    c = group.size
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.dim() != 4 or k.shape != v.shape or k.shape[2:] != q.shape[2:] or heads % kv_heads:
        raise ValueError(
            f"ulysses_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must "
            f"be [batch, heads, tokens, head_dim] with kv heads dividing the query heads"
        )
    if heads % c:
        raise ValueError(
            f"ulysses_attention: {heads} attention heads cannot be split over cp={c} ranks "
            f"(group {group.name!r}); use a cp size dividing {heads}, or context='ring'"
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"ulysses_attention: cp rank {group.rank} holds {q.shape[2]} tokens, not two equal "
            f"chunks; shard the sequence with shard_sequence (a length divisible by 2 * cp)"
        )
    if kv_heads % c:  # cannot split the kv heads: give every query head its own
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if c == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=s, enable_gqa=k.shape[1] != heads
        )
    qh, kh, vh = (_SeqToHeads.apply(t, group, balanced) for t in (q, k, v))
    y = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=s, enable_gqa=kh.shape[1] != qh.shape[1]
    )
    out: torch.Tensor = _HeadsToSeq.apply(y, group, balanced)
    return out
