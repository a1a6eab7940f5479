"""``prepare_zero``: a torch optimizer rebuilt as a :class:`ZeroOptimizer`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.zero.groups import constructor_kwargs, groups_of
from plait.strategies.zero.optimizer import ZeroOptimizer
from plait.trace import Tracer

ZERO_OPTIONS = ("algorithm", "bucket_mb", "reproducible", "threads")


def prepare_zero(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    group: Group | None = None,
    tracer: Tracer | None = None,
    **options: Any,
) -> tuple[nn.Module, ZeroOptimizer]:
    """``model`` itself and a :class:`ZeroOptimizer` of ``optimizer``'s class, param groups
    and hyper-parameters (every group's, so decay / no-decay groups and per-group ``lr``
    carry over; any ``torch.optim`` optimizer: the constructor gets the defaults it takes
    as keywords, every group keeps all its entries).

    ``options``: ``algorithm``, ``bucket_mb``, ``reproducible``/``threads`` (the
    :class:`ZeroOptimizer`'s); ``tracer`` records the reduce-scatters and
    all-gathers. Use the returned optimizer from here on; if ``optimizer`` has state
    already, it is carried over.

    Collective: every rank of ``group`` must call it (the parameter lists are compared,
    then the parameters broadcast from group rank 0).
    """
    unknown = set(options) - set(ZERO_OPTIONS)
    if unknown:
        raise TypeError(
            f"strategy 'zero{stage}' does not take {sorted(unknown)}; its options are "
            f"{sorted(('group', 'tracer', *ZERO_OPTIONS))}"
        )
    optimizer_class = type(optimizer)
    zero = ZeroOptimizer(
        groups_of(optimizer),
        optimizer_class,
        stage=stage,
        group=group,
        tracer=tracer,
        module=model,
        **options,
        **constructor_kwargs(optimizer_class, optimizer.defaults),
    )
    if optimizer.state:
        zero.load_state_dict(optimizer.state_dict())
    return model, zero
