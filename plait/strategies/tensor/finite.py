"""The non-finite gradient check of tensor parallelism (``check_finite="raise"|"skip"|None``).

Under tensor parallelism a rank's gradient is its own: a NaN in one rank's slice of a split
weight stays on that rank, and the ranks would step apart (one rank's weights NaN, the
others' fine) until an activation carries it everywhere. Before every ``optimizer.step()``
each rank looks at its gradients on their device (one fused max-abs per tensor, no host
read) and the group agrees through one all-reduce of ``t`` int64 values (each rank's
first bad parameter in its slot), read on the host once per step: ``"raise"`` raises
:class:`~plait.strategies.data_parallel.grad_sync.NonFiniteGradientError` on every rank,
naming each rank and parameter; ``"skip"`` sets every gradient to None on every rank (the
step leaves the parameters unchanged, ``skipped_steps`` counts it) and warns; ``None``
checks nothing (a loss scaler handles overflows itself).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from plait.comm.device import control_device
from plait.comm.group import Group
from plait.strategies.data_parallel.grad_sync import (
    NonFiniteGradientError,
    agree_nonfinite,
    check_policy,
    first_nonfinite_flag,
)


class FiniteCheck:
    """An optimizer step pre-hook running the check (module doc); ``skipped_steps`` counts
    the steps ``"skip"`` dropped. Collective over ``group`` at every step."""

    def __init__(self, model: nn.Module, group: Group, policy: str) -> None:
        self.named = list(model.named_parameters())
        self.group, self.policy = group, policy
        self.steps = 0
        self.skipped_steps = 0

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        who = f"tensor parallelism (group {self.group.name!r})"
        place = control_device((p for _, p in self.named), self.group)
        local = first_nonfinite_flag([p.grad for _, p in self.named], device=place)
        culprits = agree_nonfinite(local, self.group, who=who)
        if not culprits:
            return
        where = "; ".join(f"rank {r} in parameter {self.named[i][0]!r}" for r, i in culprits)
        found = f"{who}: step {self.steps}: non-finite gradient (inf or NaN): {where}"
        if self.policy == "skip":
            for _, p in self.named:
                p.grad = None
            self.skipped_steps += 1
            warnings.warn(
                f"{found}; every rank skipped this step (gradients set to None)", stacklevel=2
            )
            return
        raise NonFiniteGradientError(
            f"{found}; every rank raises. Lower the learning rate, clip gradients or look at "
            f"the data; pass check_finite='skip' to skip such steps on every rank, or "
            f"check_finite=None when a loss scaler handles overflows itself",
            [(r, self.named[i][0]) for r, i in culprits],
        )


def watch_finite(
    optimizer: torch.optim.Optimizer, model: nn.Module, group: Group, check_finite: str | None
) -> FiniteCheck | None:
    """Run the check before every ``optimizer.step()`` (None: no check). The check is kept
    on the optimizer as ``optimizer.plait_finite_check``."""
    policy = check_policy(check_finite)
    if policy is None or group.size == 1:
        return None
    check = FiniteCheck(model, group, policy)
    optimizer.register_step_pre_hook(check)
    object.__setattr__(optimizer, "plait_finite_check", check)
    return check
