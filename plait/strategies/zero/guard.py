"""What a parameter's ``.grad`` is under ZeRO-1/2 after backward: a guard, not a gradient.

DDP leaves the averaged gradient in ``param.grad``. ZeRO-1 leaves this rank's *local*
gradient there (it is averaged by a reduce-scatter inside ``optimizer.step()``), and
ZeRO-2 frees it during backward (only this rank's shard of the averaged gradient is
kept). Code written for DDP that reads ``param.grad`` (``torch.nn.utils.clip_grad_norm_``,
gradient-norm logging, a hand-written unscale) would silently compute with the wrong
numbers, or see no gradient at all and clip nothing. So after backward every trainable
parameter's ``.grad`` is a :class:`GuardedGrad`:

- metadata works: ``.shape``, ``.dtype``, ``.device``, ``is None`` checks;
- ``zero_()``, ``requires_grad_()``, ``detach_()`` work (``model.zero_grad(set_to_none=
  False)`` zeroes what the optimizer accumulates);
- ``torch.amp.GradScaler``'s unscale-and-check is routed to the optimizer, which unscales
  its averaged shard and agrees on found-inf with the other ranks (a collective);
- every other operation (arithmetic, ``norm``, ``print``, ``.data``, ``.clone()``) raises
  :class:`ShardedGradientError` naming the parameter and what to call instead.

Under ZeRO-1 the guard holds the local gradient itself (autograd accumulates into it, so
gradient accumulation over several backwards works); under ZeRO-2 it holds one shared
element (a stride-0 view), and is replaced by the real gradient at the start of the next
backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from plait.strategies.zero.optimizer import ZeroOptimizer

CLIP_HINT = "optimizer.clip_grad_norm_(max_norm, norm_type)"


class ShardedGradientError(RuntimeError):
    """Code used a parameter's ``.grad`` under ZeRO-1/2, where it is not the averaged
    gradient (ZeRO-1: this rank's local gradient; ZeRO-2: freed after its reduce-scatter)."""


_ALLOWED_METHODS = ("zero_", "requires_grad_", "detach_", "__hash__")
# methods that read metadata only (never values)
_METADATA_METHODS = frozenset(
    (
        "size",
        "stride",
        "dim",
        "numel",
        "nelement",
        "ndimension",
        "element_size",
        "is_contiguous",
        "storage_offset",
        "get_device",
        "is_floating_point",
        "is_complex",
        "data_ptr",
        "untyped_storage",
        "__len__",
    )
)


def real(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor aliasing ``t``'s data (no guard): for the optimizer's own use."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


class GuardedGrad(torch.Tensor):
    """A parameter's ``.grad`` under ZeRO-1/2; see the module docstring."""

    owner: ZeroOptimizer | None = None  # set per instance by the optimizer
    param_name = "?"
    param_index = -1  # among the owner's trainable parameters

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        guards = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, GuardedGrad)]
        name = getattr(func, "__name__", str(func))
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            owner = guards[0].owner if guards else None
            if owner is None or any(g.owner is not owner for g in guards):
                raise ShardedGradientError(_message(guards, name))
            found_inf, inv_scale = args[1], args[2]
            owner._amp_unscale_(found_inf, inv_scale)
            return None
        if name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "__get__":  # attribute reads: metadata passes, tensor views do not
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
            raise ShardedGradientError(_message(guards, "." + _attribute(func)))
        if name in _ALLOWED_METHODS or func is torch._foreach_zero_:
            if name in ("zero_", "_foreach_zero_"):
                for g in guards:
                    if g.owner is not None:
                        g.owner._user_zeroed_(g)
                if all(g.owner is not None and g.owner.stage == 2 for g in guards):
                    return args[0]  # stride-0 placeholders: the shard gradient was zeroed
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)
            return args[0]
        raise ShardedGradientError(_message(guards, name))


def _attribute(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    return str(getattr(owner, "__name__", func))


def _message(guards: list[GuardedGrad], what: str) -> str:
    first = guards[0] if guards else None
    owner = first.owner if first is not None else None
    stage = owner.stage if owner is not None else "1/2"
    name = first.param_name if first is not None else "?"
    more = f" (and {len(guards) - 1} more)" if len(guards) > 1 else ""
    held = (
        "this rank's local, un-averaged gradient (ZeRO-1 averages it with a reduce-scatter "
        "inside optimizer.step())"
        if stage == 1
        else "nothing: ZeRO-2 reduce-scattered it during backward and freed it, keeping only "
        "this rank's shard of the averaged gradient"
    )
    return (
        f"{what} on the .grad of parameter {name!r}{more}: under ZeRO stage {stage} that "
        f".grad holds {held}, so the result would be wrong. To clip gradients call "
        f"{CLIP_HINT} on the ZeroOptimizer instead of torch.nn.utils.clip_grad_norm_ (it "
        f"returns the global norm, for logging too); for loss scaling torch.amp.GradScaler "
        f"and plait.amp.DynamicLossScaler work as they are; optimizer.zero_grad() and "
        f"model.zero_grad() work. Anything else that needs the full averaged gradient needs "
        f"strategy 'ddp'."
    )


def local_guard(grad: torch.Tensor, owner: ZeroOptimizer, index: int) -> GuardedGrad:
    """ZeRO-1: the guard over this rank's local gradient ``grad`` (same data)."""
    with torch._C.DisableTorchFunctionSubclass():
        guard = grad.as_subclass(GuardedGrad)
    assert isinstance(guard, GuardedGrad)
    guard.owner, guard.param_index = owner, index
    guard.param_name = owner._names[index]
    return guard


def placeholder_guard(param: torch.Tensor, owner: ZeroOptimizer, index: int) -> GuardedGrad:
    """ZeRO-2: a guard of ``param``'s shape holding one element (a stride-0 view)."""
    one = torch.zeros((), dtype=param.dtype, device=param.device)
    guard = one.expand(param.shape).as_subclass(GuardedGrad)
    assert isinstance(guard, GuardedGrad)
    guard.owner, guard.param_index = owner, index
    guard.param_name = owner._names[index]
    return guard
