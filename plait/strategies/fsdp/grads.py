"""Shard gradients: what ``shard.grad`` is, and clipping by the global norm.

After backward each unit's ``_flat_shard.grad`` holds this rank's slice of the averaged
gradient. A norm of it is a *shard* norm: ``torch.nn.utils.clip_grad_norm_(
model.parameters(), ...)`` would clip every rank by its own piece and return a different
number on each. So the gradient is a :class:`ShardGrad`: a tensor that behaves as a plain
one for the optimizer and for loss scalers, but refuses norm operations
(:class:`ShardedGradNormError` names ``model.clip_grad_norm_``). Inside
``torch._amp_foreach_non_finite_check_and_unscale_`` (what ``torch.amp.GradScaler.unscale_``
runs) the found-inf flag is all-reduced (max) over the group, so every rank skips or takes
the step together.

:func:`clip_units_grad_norm_` (``FSDPModule.clip_grad_norm_``) is the global version.
Communication: one all-reduce of one float32 element (sum, or max for the inf-norm) on the
units' group; every rank of the group must call it (it blocks on the others).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from plait import comm
from plait.comm.device import control_device, moved

if TYPE_CHECKING:
    from plait.strategies.fsdp.unit import ShardedUnit

NORM_FUNCTIONS = {
    torch.linalg.vector_norm,
    torch.linalg.norm,
    torch.linalg.matrix_norm,
    torch.norm,
    torch.Tensor.norm,
    torch.nn.functional.normalize,
    torch.frobenius_norm if hasattr(torch, "frobenius_norm") else torch.norm,
}
if hasattr(torch, "_foreach_norm"):
    NORM_FUNCTIONS.add(torch._foreach_norm)


class ShardedGradNormError(RuntimeError):
    """A norm was taken of a fully_shard shard gradient (a per-rank piece)."""


class ShardGrad(torch.Tensor):
    """A shard's gradient: a plain tensor except that norms of it raise (they would be
    per-rank) and the GradScaler's inf check agrees across the group."""

    unit: ShardedUnit | None = None

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in NORM_FUNCTIONS:
            raise ShardedGradNormError(_norm_message(args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            _agree_on_inf(args, kwargs)
        return out


def _guards(args: Any, kwargs: Any) -> list[ShardGrad]:

    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ShardGrad)]


def _norm_message(args: Any, kwargs: Any) -> str:
    guards = _guards(args, kwargs)
    unit = next((g.unit for g in guards if g.unit is not None), None)
    where = f" (unit {unit.path!r})" if unit is not None else ""
    return (
        f"fully_shard: a norm of a shard gradient{where} was requested: after backward each "
        f"rank holds only its slice of every gradient, so torch.nn.utils.clip_grad_norm_("
        f"model.parameters(), ...) or p.grad.norm() would give each rank a different, partial "
        f"norm. Use model.clip_grad_norm_(max_norm, norm_type) on the fully_shard root "
        f"(collective: every rank calls it; it returns the global norm, the same on every rank)"
    )


def _agree_on_inf(args: Any, kwargs: Any) -> None:
    """After GradScaler's fused unscale: all-reduce (max) its found-inf flag over the
    units' group, so a non-finite gradient on any rank skips the step on every rank."""
    found = kwargs.get("found_inf", args[1] if len(args) > 1 else None)
    guards = _guards(args, kwargs)
    unit = next((g.unit for g in guards if g.unit is not None), None)
    if unit is None or unit.config.group is None or not isinstance(found, torch.Tensor):
        return
    group = unit.config.group
    # on the flag's device (NCCL moves CUDA tensors only), read by no one on the host here
    flag = found.detach().float().reshape(1).to(control_device((found,), group), copy=True)
    comm.all_reduce(flag, "max", group=group)
    found.copy_(moved(flag.reshape(found.shape), found.device, found.dtype))


def guard_grad(grad: torch.Tensor, unit: ShardedUnit) -> torch.Tensor:
    """``grad`` (same data) as a :class:`ShardGrad` of ``unit``."""
    guarded = grad.as_subclass(ShardGrad)
    assert isinstance(guarded, ShardGrad)
    guarded.unit = unit
    return guarded


def clip_units_grad_norm_(
    units: list[ShardedUnit],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the shard gradients of ``units`` by their global norm; return that norm.

    The norm is taken over every element of the unsharded gradients (each counted once:
    padding is zero, a tied parameter has one slot): local sums of ``|g|^p`` are
    all-reduced (sum; max for ``inf``) over the units' group. Every gradient is scaled by
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does on one
    process, in the gradients' precision (float64 when they are float64, else float32).
    Collective: every rank of the group must call it. Returns a scalar equal on every rank.
    """
    norm_type = float(norm_type)
    grads = [u.shard.grad for u in units if u.numel and u.shard.grad is not None]
    group = next((u.config.group for u in units), None)
    with torch._C.DisableTorchFunctionSubclass():
        plain = [g.as_subclass(torch.Tensor) for g in grads if g is not None]
        # the gradients' own precision (float64 stays float64), never below float32
        wide = torch.float64 if any(g.dtype == torch.float64 for g in plain) else torch.float32
        # on the group's device (NCCL), else the gradients' (offloaded: the CPU)
        local = torch.zeros(1, dtype=wide, device=control_device(plain, group))
        for g in plain:
            g32 = g.detach().to(local.device, wide)
            if math.isinf(norm_type):
                local = torch.maximum(local, g32.abs().max().reshape(1)) if g32.numel() else local
            elif norm_type == 0:
                local += (g32 != 0).sum()
            else:
                local += g32.abs().pow(norm_type).sum()
        if group is not None and group.size > 1:
            comm.all_reduce(local, "max" if math.isinf(norm_type) else "sum", group=group)
        if math.isinf(norm_type) or norm_type == 0:
            total = local[0].clone()
        else:
            total = local[0].pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"fully_shard clip_grad_norm_: the total norm of order {norm_type} of the "
                f"gradients is non-finite ({total.item()}), so it cannot be clipped; pass "
                f"error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in plain:
            g.mul_(moved(coef, g.device, g.dtype))
    return total
