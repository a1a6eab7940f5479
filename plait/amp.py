"""Dynamic loss scaling for float16 training, agreed on by every rank.

float16 gradients underflow to zero below ~6e-8, so the loss is multiplied by a large
``scale`` before backward and the gradients are divided by it before the step. If any
gradient on *any* rank is inf or NaN the scale was too large: every rank skips the step
and halves the scale; after ``growth_interval`` clean steps it doubles again.

Communication contract: one all-reduce (max) of a single float on ``group`` per
:meth:`DynamicLossScaler.step`, so all ranks take the same decision even when their
gradients differ (sharded strategies hold different gradient shards).
"""

from __future__ import annotations

import torch

from plait import comm
from plait.comm.device import control_device, read_verdict
from plait.comm.group import Group


class DynamicLossScaler:
    """``scaler.scale(loss).backward(); stepped = scaler.step(optimizer)``."""

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group: Group | None = None,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                "DynamicLossScaler needs init_scale > 0, growth_factor > 1 and "
                f"0 < backoff_factor < 1; got {init_scale}, {growth_factor}, {backoff_factor}"
            )
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def _grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients, agree across ranks, step or skip; True if it stepped.

        An optimizer that holds its gradients itself (ZeRO-1/2's ``ZeroOptimizer``, whose
        parameters' ``.grad`` are guards) unscales them through its ``unscale_grads_``.
        """
        # the flag lives on the group's device (NCCL: the GPU), else the gradients'
        where = control_device(self._grads(optimizer), self.group or comm.world_or_none())
        found = torch.zeros(1, device=where)
        unscale = getattr(optimizer, "unscale_grads_", None)
        if callable(unscale):
            found.copy_(unscale(1.0 / self.scale_value).reshape(1))  # agreed, on the device
        else:
            for g in self._grads(optimizer):
                g.div_(self.scale_value)
                # on the device: no host read per gradient (one per step, below)
                found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.dtype))
        group = self.group
        if group is not None or comm.world_or_none() is not None:
            comm.all_reduce(found, "max", group=group)
        if (
            read_verdict(
                found, who="DynamicLossScaler", setting="fp16 loss scaling", fix="Use bf16"
            )[0]
            > 0
        ):
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale_value *= self.backoff_factor
            optimizer.zero_grad()
            return False
        optimizer.step()
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale_value *= self.growth_factor
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale_value,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
