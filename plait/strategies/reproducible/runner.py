"""The reproducible training step: micro-batches of a fixed size, summed along a fixed tree.

``runner, optimizer = plait.prepare(model, optimizer, strategy=..., reproducible=True,
microbatch_size=m, loss_fn=f)``, then per step ``loss = runner.step(x, y);
optimizer.step()``, where ``x, y`` are this rank's micro-batches of the global batch
(``runner.block(global_x)``). By hand: build the strategy with ``reproducible=True``
(``DistributedDataParallel``, ``ZeroOptimizer``/``prepare_zero``, ``fully_shard``) and
wrap it in ``ReproducibleRunner(module, optimizer, loss_fn=f, microbatch_size=m)``; the
strategy refuses a forward or backward that no runner drives. The parameters after any
number of steps are bitwise the same for every data-parallel world size W, all-reduce
algorithm and transport, and equal to one process (``strategy="none"``) on the same global
batches.

How (the promise rests on each line):

1. The global batch of B samples is M = B/m micro-batches; rank r runs micro-batches
   ``r*M/W ... (r+1)*M/W - 1`` (FSDP: ``r, r+W, r+2W, ...``) one at a time, each with
   exactly the shapes one process uses, so each micro-batch gradient has the same bits on
   every layout.
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
the last backward); ZeRO-1/2 reduce-scatter with :func:`~.collectives.tree_reduce_scatter`;
bytes as ring all-reduce / reduce-scatter. FSDP reduce-scatters each unit's gradient at
every micro-batch step (as FSDP does when accumulating): its ``W`` ranks hold the ``W``
consecutive micro-batches ``jW ... jW+W-1``, one subtree of the tree, and the shards keep
the tree over ``j`` (partial sums the size of a shard, not of the unit). DDP and ZeRO
micro-batches before the last communicate nothing (DDP still broadcasts buffers at each
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
SUPPORTED = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "pipeline", "ptdp")
REFUSED = {
    "tp": "tensor parallelism splits each matmul's reduction over ranks, so its bits change "
    "with the tp size",
    "ep": "expert parallelism changes which tokens share an expert's matmul with the ep size",
    "cp": "context parallelism splits attention's softmax sums over ranks",
    "ps": "the parameter server applies updates as they arrive",
    "naive": "use strategy 'ddp' (the same all-reduce, bucketed)",
}


class ReproducibleRunner:
    """One training step of a data-parallel strategy in reproducible mode (module
    docstring). ``module``: what forward calls: a
    :class:`~plait.strategies.DistributedDataParallel`, a model sharded by
    :func:`~plait.strategies.fsdp.fully_shard`, or a plain model (one process, or
    ZeRO-1/2); ``optimizer``: the training's optimizer (a
    :class:`~plait.strategies.zero.ZeroOptimizer` for ZeRO; ``zero_grad`` is called
    before each micro-batch). The strategy must have been built with
    ``reproducible=True``; its group is the data-parallel group (none: one process)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        loss_fn: LossFn,
        microbatch_size: int,
        threads: int | None = 1,
    ) -> None:
        if microbatch_size <= 0:
            raise LayoutError(
                f"reproducible mode: microbatch_size must be positive, got {microbatch_size}"
            )
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.microbatch_size = microbatch_size
        self.threads = threads
        if threads is not None:
            torch.set_num_threads(threads)
        self._active = False
        self._hooks: list[Any] = []
        units = [u for m in module.modules() for u in getattr(m, "_plait_fsdp_units", ())]
        found: list[tuple[str, Any, Group | None]] = [
            (who, owner, group)
            for who, owner, group in (
                ("DistributedDataParallel", module, getattr(module, "group", None)),
                ("ZeroOptimizer", optimizer, getattr(optimizer, "group", None)),
            )
            if hasattr(owner, "microbatches")
        ]
        found += [("fully_shard", u.config, u.config.group) for u in units]
        unbuilt = sorted({who for who, owner, _ in found if owner.microbatches is None})
        if unbuilt:
            raise ValueError(
                f"ReproducibleRunner: {' and '.join(unbuilt)} was built without "
                f"reproducible=True, so its reductions average in the algorithm's order; "
                f"build it with reproducible=True (every fully_shard call of the model)"
            )
        if len({who for who, _, _ in found}) > 1:
            raise ValueError(
                f"ReproducibleRunner: one data-parallel strategy per model; found "
                f"{sorted({who for who, _, _ in found})}"
            )
        self.group: Group | None = found[0][2] if found else None
        # FSDP continues the tree on its shards, so rank r runs micro-batches r, r+W, ...
        self.microbatches = Microbatches(driven=True, interleaved=bool(units))
        for _, owner, _ in found:
            owner.microbatches = self.microbatches
        self._ddp: Any = module if found and found[0][0] == "DistributedDataParallel" else None
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
        """This rank's micro-batches of a global-batch tensor (dimension 0), in the order
        its :meth:`step` runs them: a contiguous block of ``M/W`` micro-batches (one
        subtree), or under FSDP micro-batches ``r, r+W, r+2W, ...`` (each step of ``W``
        consecutive micro-batches is one subtree, reduce-scattered at once)."""
        m, world = self.microbatch_size, self.world
        total = microbatch_count(t.shape[0], m, world)
        if self.microbatches.interleaved:
            steps = t.reshape(total // world, world, m, *t.shape[1:])
            return steps[:, self.rank].reshape(-1, *t.shape[1:])
        per = t.shape[0] // world
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
            everyone = torch.empty(total, dtype=local.dtype, device=local.device)
            comm.all_gather(everyone, local, group=self.group)
            if self.microbatches.interleaved:  # rank-major to micro-batch index order
                everyone = everyone.reshape(self.world, -1).t().reshape(-1)
        return tree_sum(list(everyone.split(1))).reshape(()) * (1.0 / total)
