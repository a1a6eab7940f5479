"""One gradient-clipping call for every strategy:
``plait.clip_grad_norm_(model.parameters(), max_norm)`` (or the older
``plait.clip_grad_norm_(model, optimizer, max_norm)``).

Where the gradient lives differs by strategy, so the right clipping call does too:

- DDP, naive DP, single-process ``DataParallel`` and plain models: every rank holds the
  whole averaged gradient; ``model.clip_grad_norm_`` (equal to
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``), no communication.
- ZeRO-1/2 (:class:`~plait.strategies.zero.ZeroOptimizer`): each rank holds a shard of the
  averaged gradient, in the optimizer; ``optimizer.clip_grad_norm_`` (collective: one
  reduce-scatter in stage 1, reused by ``step()``, and one all-reduce of one element).
- FSDP / ZeRO-3 (``fully_shard``): each rank holds a shard, in the model;
  ``model.clip_grad_norm_`` (collective: one all-reduce of one element).
- several optimizers from ``plait.prepare(model, [muon, adamw], strategy="zero1"|"zero2")``:
  ``clip_grad_norm_(model, [muon, adamw], max_norm)`` clips by the norm over all of them
  (:mod:`plait.clip_several`).
- Tensor, pipeline and expert parallelism and their compositions: each parameter carries
  its :class:`~plait.strategies.placement.Placement` (split over which groups, copied over
  which); :func:`~plait.strategies.placement.grad_norm` counts every element once
  (collective: one all-reduce of one element over the world).

:func:`clip_grad_norm_` picks the right one, so a training loop written once clips
correctly under any strategy. ``torch.nn.utils.clip_grad_norm_`` on a sharded strategy's
parameters raises, naming the right call, instead of returning a per-rank norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from plait import clip_several as several
from plait.runtime import world
from plait.strategies import placement as placement_mod


def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    *args: Any,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """Clip the gradients by their global norm under any strategy; return that norm.

    ``clip_grad_norm_(model.parameters(), max_norm[, norm_type])`` as in PyTorch, or
    ``clip_grad_norm_(model, optimizer, max_norm[, norm_type])`` (the optimizer is asked
    first: ZeRO keeps the gradient shards there). Collective under ZeRO, FSDP and
    model-parallel strategies (every rank of the model must call it, after backward and
    after ``GradScaler.unscale_`` if one is used); local otherwise. The returned norm is
    the norm of the gradient the single-process model would have, the same on every rank.
    ``group``: the group holding every rank of a model-parallel model (default: the world).
    """
    optimizer: Any = None
    if (
        isinstance(parameters, nn.Module)
        and args
        and (
            args[0] is None
            or isinstance(args[0], torch.optim.Optimizer)
            or (isinstance(args[0], (list, tuple)) and args[0])
        )
    ):
        optimizer, args = args[0], args[1:]
    if not args:
        raise TypeError("clip_grad_norm_: max_norm is missing")
    max_norm = float(args[0])
    if len(args) > 1:
        norm_type = float(args[1])
    if len(args) > 2:
        raise TypeError(f"clip_grad_norm_: too many positional arguments ({len(args) + 1})")
    model = parameters if isinstance(parameters, nn.Module) else None
    if isinstance(optimizer, (list, tuple)):
        return several.clip_grad_norm_(
            list(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    if optimizer is not None and hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(  # type: ignore[no-any-return]
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    method = getattr(model, "clip_grad_norm_", None)
    if callable(method):
        return method(  # type: ignore[no-any-return]
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    named: list[tuple[str, torch.Tensor]]
    if model is not None:
        named = list(model.named_parameters())
    elif isinstance(parameters, torch.Tensor):
        named = [("0", parameters)]
    else:
        named = [(str(i), p) for i, p in enumerate(parameters)]  # type: ignore[arg-type]
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for n, p in named:
        unique.setdefault(id(p), (n, p))  # a tied parameter counts once
    named = list(unique.values())
    params = [p for _, p in named]
    if not placement_mod.is_placed(params):
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    if group is None:
        group = world()
    total = placement_mod.grad_norm(named, norm_type, group=group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({total.item()})"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = placement_mod.plain(p.grad).detach()
            grad.mul_(coef.to(grad.dtype))
    return total
