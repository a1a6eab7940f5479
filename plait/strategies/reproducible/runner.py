"""The reproducible training step: micro-batches of a fixed size, summed along a fixed tree.

``runner, optimizer = plait.prepare(model, optimizer, strategy=..., reproducible=True,
microbatch_size=m, loss_fn=f)``, then per step ``loss = runner.step(x, y);
optimizer.step()``, where ``x, y`` are this rank's contiguous block of the global batch
(``runner.block(global_x)``). The parameters after any number of steps are bitwise the
same for every data-parallel world size W, all-reduce algorithm and transport, and equal to
one process (``strategy="none"``) on the same global batches.

How (the promise rests on each line):

1. The global batch of B samples is M = B/m micro-batches; rank r runs micro-batches
   ``r*M/W ... (r+1)*M/W - 1`` one at a time, each with exactly the shapes one process
   uses, so each micro-batch gradient has the same bits on every layout.
2. Each micro-batch loss (the mean over its m samples from ``loss_fn``) is multiplied by
   ``1/M`` before backward: a power of two, the same constant everywhere, so the sum of
   the M gradients is the gradient of the global mean and no collective averages.
3. The M gradients are added along one balanced binary tree over micro-batch index
   (:mod:`.tree`): locally by a binary-counter accumulator (per gradient at most
   ``log2(M/W) + 1`` partial sums alive, :attr:`ReproducibleRunner.partial_sum_bytes`),
   across ranks by :mod:`.collectives` (all-to-all, tree sum in rank order, all-gather).
4. Intra-op threads are pinned (``threads=``, default 1, set with
   ``torch.set_num_threads``): a CPU reduction may split differently with a different
   number of threads (on the development machine, ``x.sum()`` of 4M float32 elements
   differs between 1 and 2 threads; its matmuls did not). Use the same ``threads`` in
   every layout compared.

Communication (on the strategy's data-parallel group, once per step, after the last
micro-batch's gradients are in): DDP all-reduces each bucket with
:func:`~.collectives.tree_all_reduce` as soon as it is complete (overlapping the rest of
the last backward); ZeRO-1/2 and FSDP reduce-scatter with
:func:`~.collectives.tree_reduce_scatter`; bytes as ring all-reduce / reduce-scatter.
Micro-batches before the last communicate nothing (DDP still broadcasts buffers at each
forward if ``broadcast_buffers``). One all-gather of M/W float32 losses per step gives
every rank the same global mean loss, summed along the same tree.

Limits: buffers written in forward (BatchNorm running statistics) see micro-batches, not
the global batch, and DDP keeps rank 0's; randomness inside forward (dropout) draws from
each rank's generator, so it is reproducible only with dropout off or a generator seeded
per micro-batch by the caller; tensor and expert parallelism change matmul summation
order, so they are refused here; mixed precision is reproducible as long as the policy
is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group
from plait.strategies.reproducible.tree import LayoutError, Microbatches, microbatch_count, tree_sum

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
# which strategies the mode supports, and how each reduces gradients
SUPPORTED = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "pipeline")
REFUSED = {
    "tp": "tensor parallelism splits each matmul's reduction over ranks, so its bits change "
    "with the tp size",
    "ep": "expert parallelism changes which tokens share an expert's matmul with the ep size",
    "cp": "context parallelism splits attention's softmax sums over ranks",
    "ptdp": "it composes tensor parallelism (see tp)",
    "ps": "the parameter server applies updates as they arrive",
    "naive": "use strategy 'ddp' (the same all-reduce, bucketed)",
}


class ReproducibleRunner:
    """One training step of a data-parallel strategy in reproducible mode (module
    docstring). ``module``: what forward calls (the strategy's wrapper); ``optimizer``:
    the strategy's optimizer (``zero_grad`` is called before each micro-batch);
    ``group``: the data-parallel group (None: one process); ``target``: the strategy
    object whose reductions follow the tree (DDP, a ZeroOptimizer; None for FSDP, whose
    units are found in ``module``, and for one process)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        group: Group | None,
        loss_fn: LossFn,
        microbatch_size: int,
        target: Any = None,
        threads: int | None = 1,
    ) -> None:
        if microbatch_size <= 0:
            raise LayoutError(
                f"reproducible mode: microbatch_size must be positive, got {microbatch_size}"
            )
        self.module = module
        self.optimizer = optimizer
        self.group = group
        self.loss_fn = loss_fn
        self.microbatch_size = microbatch_size
        self.microbatches = Microbatches()
        self.threads = threads
        if threads is not None:
            torch.set_num_threads(threads)
        self._ddp = target if hasattr(target, "require_backward_grad_sync") else None
        self._active = False
        self._hooks: list[Any] = []
        if target is not None:
            target.microbatches = self.microbatches
        units = [u for m in module.modules() for u in getattr(m, "_plait_fsdp_units", ())]
        for unit in units:  # FSDP: each unit sums its flat gradient (fsdp/unit.py)
            unit.config.microbatches = self.microbatches
        if not units:  # DDP, ZeRO, one process: sum each parameter's micro-batch gradients
            params = {id(p): p for p in module.parameters() if p.requires_grad}
            self._hooks = [p.register_hook(self._make_hook(p)) for p in params.values()]

    @property
    def world(self) -> int:
        return self.group.size if self.group is not None else 1

    @property
    def rank(self) -> int:
        return self.group.rank if self.group is not None else 0

    @property
    def partial_sum_bytes(self) -> int:
        """The most bytes of partial sums held at once in a step so far (an upper bound:
        each gradient's peak, added)."""
        return self.microbatches.peak_bytes

    def block(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous block of a global-batch tensor (dimension 0)."""
        per, left = divmod(t.shape[0], self.world)
        if left:
            raise LayoutError(
                f"reproducible mode: a global batch of {t.shape[0]} does not split over "
                f"{self.world} ranks"
            )
        return t[self.rank * per : (self.rank + 1) * per]

    def _make_hook(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._active:
                return None
            # the last micro-batch: the strategy sees this rank's subtree sum as the grad
            return self.microbatches.add(p, grad)

        return hook

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over this rank's block ``x, y`` of the global batch, one
        micro-batch at a time; afterwards the gradients are the global batch's (as
        ``optimizer.step()`` expects them: reduced, or, for ZeRO-1, reduced in ``step``).
        Returns the global mean of the micro-batch losses, bitwise the same on every rank.
        Collective: every rank of the group calls it with a block of the same size."""
        m = self.microbatch_size
        if x.shape[0] % m or y.shape[0] != x.shape[0]:
            raise LayoutError(
                f"reproducible mode: rank {self.rank} got a block of {x.shape[0]} inputs and "
                f"{y.shape[0]} targets; both must be the same multiple of microbatch_size "
                f"m={m}"
            )
        local = x.shape[0] // m
        total = microbatch_count(local * self.world * m, m, self.world)
        tree = self.microbatches
        tree.count, tree.sums = local, {}
        scale = 1.0 / total  # a power of two: exact, and the same in every layout
        losses = []
        self._active = True
        try:
            for j in range(local):
                tree.index = j
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                if self._ddp is not None:
                    self._ddp.require_backward_grad_sync = tree.final
                loss = self.loss_fn(self.module(x[j * m : (j + 1) * m]), y[j * m : (j + 1) * m])
                (loss * scale).backward()
                losses.append(loss.detach().float().reshape(1))
        finally:
            self._active = False
            if self._ddp is not None:
                self._ddp.require_backward_grad_sync = True
        return self._mean(torch.cat(losses), total)

    def _mean(self, local: torch.Tensor, total: int) -> torch.Tensor:
        everyone = local
        if self.world > 1:
            assert self.group is not None
            everyone = torch.empty(total, dtype=local.dtype)
            comm.all_gather(everyone, local, group=self.group)
        return tree_sum(list(everyone.split(1))).reshape(()) * (1.0 / total)
