"""Naive data parallelism: after backward, all-reduce every gradient, one at a time.

No buckets and no overlap: the readable reference that :class:`DistributedDataParallel`
is tested against, and the "DP" of the seeds. Communication contract, on ``group``:
parameters and buffers broadcast from rank 0 when wrapped; at the end of every backward,
one blocking all-reduce (average) per parameter, in registration order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group
from plait.strategies.ddp import broadcast_tensors


class NaiveDataParallel(nn.Module):
    def __init__(
        self, module: nn.Module, *, group: Group | None = None, algorithm: str = "auto"
    ) -> None:
        super().__init__()
        self.module = module
        self.group = group if group is not None else comm.world()
        self.algorithm = algorithm
        self._queued = False
        if self.group.size > 1:
            broadcast_tensors([*module.parameters(), *module.buffers()], self.group, "auto")
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._queue)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _queue(self, _: Any) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        self._queued = False
        for p in self.module.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, "avg", group=self.group, algorithm=self.algorithm)
