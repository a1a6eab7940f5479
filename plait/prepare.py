"""One entry point for every strategy: ``model, optimizer = plait.prepare(...)``.

The returned model and optimizer are used by a plain PyTorch training loop as they are
(``loss = loss_fn(model(x), y); loss.backward(); optimizer.step()``). The optimizer is the
caller's own object (learning-rate schedulers keep working); with a ``tracer``, its steps
are recorded as ``optimizer`` spans through step hooks.

Strategies: ``"ddp"`` (:class:`~plait.strategies.DistributedDataParallel`), ``"naive"``
(:class:`~plait.strategies.NaiveDataParallel`), ``"none"`` (single process, unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.strategies import DistributedDataParallel, NaiveDataParallel
from plait.trace import Tracer

_NAIVE_OPTIONS = {"group", "algorithm"}


def _none(model: nn.Module, **options: Any) -> nn.Module:
    if options:
        raise TypeError(f"strategy 'none' takes no options, got {sorted(options)}")
    return model


def _naive(model: nn.Module, **options: Any) -> nn.Module:
    unknown = set(options) - _NAIVE_OPTIONS
    if unknown:
        raise TypeError(
            f"strategy 'naive' does not take {sorted(unknown)}; its options are "
            f"{sorted(_NAIVE_OPTIONS)}"
        )
    return NaiveDataParallel(model, **options)


STRATEGIES: dict[str, Callable[..., nn.Module]] = {
    "none": _none,
    "naive": _naive,
    "ddp": DistributedDataParallel,
}


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strategy: str = "ddp",
    tracer: Tracer | None = None,
    **options: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wrap ``model`` (and hook ``optimizer``) for ``strategy``; return both.

    ``options`` go to the strategy (for ``"ddp"``: ``group``, ``bucket_mb``,
    ``algorithm``, ``broadcast_buffers``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``). Create the optimizer on ``model.parameters()`` before
    calling; data-parallel strategies keep the parameters in place, so it stays valid.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(STRATEGIES)}")
    if strategy == "ddp" and tracer is not None:
        options["tracer"] = tracer
    try:
        wrapped = STRATEGIES[strategy](model, **options)
    except TypeError as exc:
        if (
            "unexpected keyword" in str(exc)
            or "takes no" in str(exc)
            or "does not take" in str(exc)
        ):
            raise TypeError(f"plait.prepare(strategy={strategy!r}): {exc}") from exc
        raise
    if optimizer is not None and tracer is not None:
        _trace_steps(optimizer, tracer)
    return wrapped, optimizer


def _trace_steps(optimizer: torch.optim.Optimizer, tracer: Tracer) -> None:
    tokens: list[int] = []

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        tokens.append(tracer.begin("optimizer", stream="compute"))

    def after(opt: Any, args: Any, kwargs: Any) -> None:
        tracer.end(tokens.pop())

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
