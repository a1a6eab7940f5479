"""The loss of a 2D / 2.5D / 3D classifier: cross-entropy on batch shards, mean over the batch.

The head's logits on a rank are ``[rows, ..., Vp/q]``: one block of the batch (``rows`` of
the global ``b``) and vocabulary columns ``[c Vp/q, (c+1) Vp/q)``, ``c`` the coordinate
along the *vocabulary axis*. :func:`cross_entropy_nd` takes the global target (the same
on every rank), keeps this rank's batch block of it, and returns the **mean loss over the
whole global batch**, the same value on every rank, which the user calls ``backward()`` on
as on one process (Colossal-AI's 2D layers return a ``1/q^2`` shard users cannot form the
loss on: hpcaitech/ColossalAI#3664).

Per token, with ``m`` the row maximum and ``s = z - m``: ``loss = log sum_c exp(s_c) - s_t``.
Communication, forward, on the vocabulary axis: an all-reduce (MAX) of ``m`` and one
all-reduce (SUM) of two stacked per-token sums (``sum exp(s)`` and ``s_t``, the latter
non-zero only on the rank that holds the target's column). Then, on each *batch axis* (the
axes whose coordinates pick the batch block), one all-reduce of the summed loss and one of
the token count (two scalars each). Backward: no communication (``dz = softmax - onehot``
on this rank's columns, times ``1 / tokens``; the batch all-reduce passes its replicated
gradient through). Padded columns (``Vp > V``) get probability and gradient zero.
Collective over the vocabulary and batch axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from plait import comm
from plait.strategies.tensor.grid import Axis, all_reduce, block
from plait.strategies.tensor.mappings_nd import reduce_value


class _VocabCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        axis: Axis,
        vocab_size: int,
        ignore_index: int,
        algorithm: str,
    ) -> torch.Tensor:
        n, local = logits.shape
        start = axis.coord * local
        real = (torch.arange(local, device=logits.device) + start) < vocab_size
        z = logits.detach().masked_fill(~real, float("-inf"))
        m = z.max(dim=-1).values.clone()
        if axis.size > 1:
            comm.all_reduce(m, "max", group=axis.group, algorithm=algorithm)
        s = z - m.unsqueeze(-1)
        e = s.exp()
        kept = target != ignore_index
        t_local = target - start
        mine = kept & (t_local >= 0) & (t_local < local)
        idx = t_local.clamp(0, local - 1).unsqueeze(-1)
        s_t = torch.where(mine, s.gather(-1, idx).squeeze(-1), torch.zeros_like(m))
        sums = all_reduce(torch.stack([e.sum(-1), s_t]), axis, algorithm)
        loss = (sums[0].log() - sums[1]).masked_fill(~kept, 0.0)
        ctx.save_for_backward(e / sums[0].unsqueeze(-1), idx, mine, kept)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, idx, mine, kept = ctx.saved_tensors
        d = softmax.clone()
        d.scatter_add_(-1, idx, -mine.to(d.dtype).unsqueeze(-1))
        d = d * (grad * kept.to(grad.dtype)).unsqueeze(-1)
        return d, None, None, None, None, None


def cross_entropy_nd(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_axis: Axis,
    batch_axes: Sequence[Axis],
    batch_index: int,
    batch_parts: int,
    vocab_size: int,
    ignore_index: int = -100,
    algorithm: str = "auto",
) -> torch.Tensor:
    """The mean cross-entropy over the global batch (module doc).

    ``logits [b/batch_parts, ..., Vp/q]`` is this rank's block; ``target [b, ...]`` is the
    global target, of which block ``batch_index`` of ``batch_parts`` is used. Collective
    over ``vocab_axis`` and every axis of ``batch_axes``.
    """
    rows = block(target, 0, batch_index, batch_parts, "cross_entropy_nd: the target's batch")
    if logits.shape[:-1] != rows.shape:
        raise ValueError(
            f"cross_entropy_nd: this rank's logits {tuple(logits.shape)} do not match its "
            f"block of the target {tuple(rows.shape)} (block {batch_index} of {batch_parts} "
            f"of {tuple(target.shape)}); pass the global target, the same on every rank"
        )
    local = logits.shape[-1]
    if not (local * (vocab_axis.size - 1) < vocab_size <= local * vocab_axis.size):
        raise ValueError(
            f"cross_entropy_nd: vocab_size {vocab_size} does not fit {vocab_axis.size} blocks of "
            f"{local} columns; pass the head's real vocabulary size"
        )
    flat = logits.reshape(-1, local)
    per_token = _VocabCE.apply(
        flat, rows.reshape(-1), vocab_axis, vocab_size, ignore_index, algorithm
    )
    total = per_token.sum().reshape(1)
    count = (rows != ignore_index).sum().to(logits.dtype).reshape(1)
    for axis in batch_axes:
        total = reduce_value(total, axis=axis, algorithm=algorithm)
        count = all_reduce(count, axis, algorithm)
    return (total / count).squeeze(0)


__all__ = ["cross_entropy_nd"]
