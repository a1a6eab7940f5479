"""One global gradient clip over several optimizers under ZeRO-1/2:
``plait.clip_grad_norm_(model, [muon, adamw], max_norm)`` after
``plait.prepare(model, [muon, adamw], strategy="zero1"|"zero2")``.

Each optimizer holds part of the averaged gradient: a
:class:`~plait.strategies.zero.ZeroOptimizer` its flat shard (after its reduce-scatter), a
whole-matrix optimizer stepped by parameter ownership the whole averaged gradients of the
parameters this rank owns (after its collect, run here ahead of ``step()``, which then
skips it). The norm is that of every parameter's averaged gradient, as
``torch.nn.utils.clip_grad_norm_`` computes it on the one-process model; every part is
scaled by ``max_norm / (norm + 1e-6)`` when the norm exceeds ``max_norm``.

Communication (each optimizer's group, every rank in the same order): per ZeroOptimizer
its reduce-scatter (stage 1; ``step()`` reuses it), one scalar all-reduce for its norm and
one for the found-inf flag of the scaling; per owned optimizer its collect (a ``reduce``
per parameter to the owner; ``step()`` reuses it) and one scalar all-reduce. Refused by
name: an optimizer of another kind (a plain one: clip its parameters with
``torch.nn.utils.clip_grad_norm_``; under fsdp the model's ``clip_grad_norm_`` covers every
optimizer) and an owned optimizer over sharded pieces (fsdp, tp).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from plait import comm
from plait.strategies.whole_matrix.owners import ReplicatedSlot
from plait.strategies.zero import ZeroOptimizer


def _refuse(optimizer: torch.optim.Optimizer, why: str) -> None:
    raise ValueError(
        f"plait.clip_grad_norm_(model, [optimizers], ...): the {type(optimizer).__name__} "
        f"{why}. The list form clips the optimizers of plait.prepare(model, [...], "
        f"strategy='zero1'|'zero2'); under fsdp call plait.clip_grad_norm_(model, max_norm)"
    )


@torch.no_grad()
def clip_grad_norm_(
    optimizers: Sequence[torch.optim.Optimizer],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the averaged gradients of every optimizer in ``optimizers`` by their global
    norm; return it, the same on every rank (module docstring). Collective."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"plait.clip_grad_norm_: norm_type must be positive, got {norm_type}")
    infinite = math.isinf(norm_type)
    for o in optimizers:
        slots = getattr(o, "plait_slots", None)
        if isinstance(o, ZeroOptimizer):
            continue
        if slots is None:
            _refuse(o, "is neither a ZeroOptimizer nor stepped by parameter ownership")
        if not all(type(s) is ReplicatedSlot for s, _, _ in slots):  # type: ignore[union-attr]
            _refuse(o, "is stepped by ownership over sharded pieces (fsdp or tp)")
    parts: list[torch.Tensor] = []
    for o in optimizers:
        if isinstance(o, ZeroOptimizer):  # its norm, unclipped (max_norm inf: scale 1)
            parts.append(o.clip_grad_norm_(math.inf, norm_type).to(torch.float64))
            continue
        o.plait_collect()  # type: ignore[attr-defined]
        group: Any = o.plait_group  # type: ignore[attr-defined]
        grads = [m.grad for _, _, m in o.plait_slots if m is not None and m.grad is not None]  # type: ignore[attr-defined]
        local = torch.zeros((), dtype=torch.float64, device=group.device)
        for g in grads:
            n = torch.linalg.vector_norm(g.to(torch.float64), norm_type)
            local = torch.maximum(local, n) if infinite else local + n.pow(norm_type)
        if group.size > 1:
            comm.all_reduce(local, "max" if infinite else "sum", group=group)
        parts.append(local if infinite else local.pow(1.0 / norm_type))
    stacked = torch.stack([p.cpu() for p in parts])
    total = stacked.max() if infinite else torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"plait.clip_grad_norm_: the total norm of order {norm_type} over "
            f"{len(optimizers)} optimizers is non-finite ({float(total)})"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for o in optimizers:
        if isinstance(o, ZeroOptimizer):
            o.unscale_grads_(float(coef))
            continue
        for _, _, m in o.plait_slots:  # type: ignore[attr-defined]
            if m is not None and m.grad is not None:
                m.grad.mul_(coef.to(m.grad.dtype))
    return total
