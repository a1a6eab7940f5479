"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

Rank ``r`` holds the logits of vocabulary columns ``[r*Vl, (r+1)*Vl)`` (the output of a
vocab-parallel head); the full ``[tokens, V]`` logits are never materialised. With ``z``
the logits, ``m`` their row maximum, ``s = z - m``, ``t`` the target and ``eps`` the label
smoothing, the loss of one token is::

    log(sum_c exp(s_c)) - (1 - eps) * s_t - (eps / V) * sum_c s_c

Forward communication on the group: one all-reduce (MAX) of ``m`` (``N`` elements for ``N``
tokens), then one all-reduce (SUM) of three stacked partial sums per token: ``sum exp(s)``,
``s_t`` (non-zero on the rank that owns the target) and ``sum s`` (``3 N`` elements).
(Megatron-LM issues the three sums as three all-reduces; stacking them costs the same
bytes in one call.) Backward: no communication, ``dz = softmax(z) - (1-eps) onehot(t) -
eps/V`` on this rank's columns, scaled by the incoming gradient. Columns past the real
vocabulary ``V`` (padding) are excluded: they get zero probability and zero gradient.
Collective: every rank of the group must call it with the same number of tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from plait import comm
from plait.comm.group import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Group,
        vocab_size: int,
        ignore_index: int,
        smoothing: float,
        algorithm: str,
    ) -> torch.Tensor:
        n, local = logits.shape
        start = group.rank * local
        real = (torch.arange(local, device=logits.device) + start) < vocab_size  # [Vl]
        z = logits.detach().masked_fill(~real, float("-inf"))
        m = z.max(dim=-1).values.clone()
        comm.all_reduce(m, "max", group=group, algorithm=algorithm)
        s = z - m.unsqueeze(-1)
        e = s.exp()  # padded columns: exp(-inf) = 0
        kept = target != ignore_index
        t_local = target - start
        mine = kept & (t_local >= 0) & (t_local < local)
        idx = t_local.clamp(0, local - 1).unsqueeze(-1)
        s_target = torch.where(mine, s.gather(-1, idx).squeeze(-1), torch.zeros_like(m))
        sums = torch.stack([e.sum(-1), s_target, s.masked_fill(~real, 0.0).sum(-1)])
        comm.all_reduce(sums, group=group, algorithm=algorithm)
        sum_e, s_t, sum_s = sums
        loss = sum_e.log() - (1.0 - smoothing) * s_t - (smoothing / vocab_size) * sum_s
        loss = loss.masked_fill(~kept, 0.0)
        ctx.save_for_backward(e / sum_e.unsqueeze(-1), idx, mine, kept, real)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, idx, mine, kept, real = ctx.saved_tensors
        eps = ctx.smoothing
        d = softmax - (eps / ctx.vocab_size) * real.to(softmax.dtype)
        d.scatter_add_(-1, idx, -(1.0 - eps) * mine.to(d.dtype).unsqueeze(-1))
        d = d * (grad * kept.to(grad.dtype)).unsqueeze(-1)
        return d, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: Group,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    algorithm: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` from this rank's vocabulary slice.

    ``logits [..., Vl]`` holds columns ``[rank*Vl, (rank+1)*Vl)``; ``target [...]`` holds
    global class ids (the same on every rank). ``vocab_size`` is the real vocabulary
    (default ``Vl * t``; smaller when the head was padded). ``reduction`` is ``"mean"``
    (over targets not equal to ``ignore_index``), ``"sum"`` or ``"none"``. Collective over
    ``group``: two all-reduces forward, none backward (see the module doc).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} must agree on every dimension but the last"
        )
    local = logits.shape[-1]
    vocab = local * group.size if vocab_size is None else vocab_size
    if not (local * (group.size - 1) < vocab <= local * group.size):
        raise ValueError(
            f"vocab_parallel_cross_entropy: vocab_size {vocab} does not fit {group.size} "
            f"slices of {local} columns (group {group.name!r}); pass the head's real "
            f"vocabulary size"
        )
    flat = logits.reshape(-1, local)
    per_token = _VocabParallelCrossEntropy.apply(
        flat, target.reshape(-1), group, vocab, ignore_index, label_smoothing, algorithm
    )
    if reduction == "none":
        return per_token.reshape(target.shape)  # type: ignore[no-any-return]
    total = per_token.sum()
    if reduction == "sum":
        return total  # type: ignore[no-any-return]
    return total / (target != ignore_index).sum()  # type: ignore[no-any-return]
