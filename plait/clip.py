"""One gradient-clipping call for every strategy: ``plait.clip_grad_norm_(model, optimizer, ...)``.

Where the gradient lives differs by strategy, so the right clipping call does too:

- DDP, naive DP, single-process ``DataParallel`` and plain models: every rank holds the
  whole averaged gradient; ``model.clip_grad_norm_`` (equal to
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``), no communication.
- ZeRO-1/2 (:class:`~plait.strategies.zero.ZeroOptimizer`): each rank holds a shard of the
  averaged gradient, in the optimizer; ``optimizer.clip_grad_norm_`` (collective: one
  reduce-scatter in stage 1, reused by ``step()``, and one all-reduce of one element).
- FSDP / ZeRO-3 (``fully_shard``): each rank holds a shard, in the model;
  ``model.clip_grad_norm_`` (collective: one all-reduce of one element).

:func:`clip_grad_norm_` picks the right one, so a training loop written once clips
correctly under any strategy. ``torch.nn.utils.clip_grad_norm_`` on a sharded strategy's
parameters raises, naming the right call, instead of returning a per-rank norm.
"""

from __future__ import annotations

import torch
from torch import nn


def clip_grad_norm_(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients by their global norm under any strategy; return that norm.

    Collective under ZeRO and FSDP (every rank of the group must call it, after backward
    and after ``GradScaler.unscale_`` if one is used); local otherwise. The returned norm is
    the norm of the gradient the single-process model would have, the same on every rank.
    """
    if optimizer is not None and hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(  # type: ignore[no-any-return]
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    method = getattr(model, "clip_grad_norm_", None)
    if callable(method):
        return method(  # type: ignore[no-any-return]
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    return torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
    )
