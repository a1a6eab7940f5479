"""This member's share of a healing step: the micro-batches of the blocks it owns, and
the exchange that adds every block's sum.

Each micro-batch loss (the mean over ``m`` samples) is scaled by ``1/M`` before backward.
Reproducible mode: each block's gradients are summed along the fixed in-block tree
(:class:`~plait.strategies.reproducible.tree.TreeSum`, one per parameter); the blocks
before the last become flat partials; during the last micro-batch's backward of the last
block the exchange starts bucket by bucket (:mod:`.buckets`) and is waited for before
the caller steps. ``reproducible=False``: each block's gradients accumulate in ``.grad``,
the member adds its blocks in order and all-reduces with plait's default algorithm
after backward. Either way two extra elements end the vector: the blocks' loss sums and
the leader's mask of replacements asking to join.

Communication contract: the exchange's (:mod:`.buckets`, :mod:`.blocks`) on the group
passed to :meth:`BlockCompute.run`; one ``all_reduce`` after backward without the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import Group
from plait.heal.buckets import OverlappedExchange
from plait.strategies.reproducible.tree import TreeSum


class BlockCompute:
    """Runs this member's blocks of a step and exchanges their sums (module docstring).
    ``exchange``: the bucketed exchange (reproducible mode), or None (arrival order);
    ``fault``: the trainer's hook, called before every micro-batch with (step, index)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        microbatch_size: int,
        params: list[nn.Parameter],
        world: int,
        fault: Callable[[int, int], None] | None,
        exchange: OverlappedExchange | None,
    ) -> None:
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.microbatch_size, self.params, self.world = microbatch_size, params, world
        self.dtype = params[0].dtype
        self.fault, self.exchange = fault, exchange
        self.step = 0

    def run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        step: int,
        mine: list[int],
        per: int,
        scale: float,
        mask: int,
        owned: dict[int, list[int]],
        group: Group,
    ) -> torch.Tensor:
        """The summed flat vector of step ``step``: this member's blocks ``mine`` (of
        ``per`` micro-batches each, losses scaled by ``scale``) and every other member's,
        exchanged on ``group`` (``owned``: every member's blocks). Collective on ``group``."""
        self.step = step
        if self.exchange is None:
            return self._arrival_order(x, y, mine, per, scale, mask, group)
        exchange = self.exchange
        *before, (last_i, v) = enumerate(mine)
        earlier = {
            u: self._block(x, y, u, per, scale, mask * (i == 0), tree=True) for i, u in before
        }
        sums, losses, extra = [TreeSum() for _ in self.params], TreeSum(), mask * (last_i == 0)

        def arm() -> None:  # just before the last backward: the buckets start during it
            exchange.arm(
                earlier=earlier,
                block=v,
                sums=sums,
                extra=self._extra(losses, extra),
                owned=owned,
                world=self.world,
                group=group,
            )

        for j in range(per - 1):
            self._microbatch(x, y, v * per + j, scale, losses=losses)
            self._push(sums)
        try:
            self._microbatch(x, y, v * per + per - 1, scale, losses=losses, arm=arm)
        except BaseException:
            exchange.disarm()
            raise
        return exchange.finish()

    def partials(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        step: int,
        mine: list[int],
        per: int,
        scale: float,
        mask: int,
        reproducible: bool,
    ) -> dict[int, torch.Tensor]:
        """Each of this member's blocks ``mine`` as a flat vector (its gradient sum along
        the fixed in-block tree, or accumulated in ``.grad`` without ``reproducible``, then
        the two extra elements), for an exchange the caller runs after backward (zero=3's
        reduce-scatter to the chunks each member steps, :mod:`.fsdp`). Local."""
        self.step = step
        return {
            v: self._block(x, y, v, per, scale, mask * (i == 0), tree=reproducible)
            for i, v in enumerate(mine)
        }

    def _arrival_order(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        mine: list[int],
        per: int,
        scale: float,
        mask: int,
        group: Group,
    ) -> torch.Tensor:
        total: torch.Tensor | None = None
        for i, v in enumerate(mine):
            partial = self._block(x, y, v, per, scale, mask * (i == 0), tree=False)
            total = partial if total is None else total.add_(partial)
        assert total is not None
        if group.size > 1:
            ops.all_reduce(total, group=group)
        return total

    def _block(
        self, x: torch.Tensor, y: torch.Tensor, v: int, per: int, scale: float, mask: int,
        *, tree: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Block ``v`` as one flat vector: its gradients summed along the fixed in-block
        tree (``tree``), else accumulated in ``.grad``; then the two extra elements."""
        sums, losses = [TreeSum() for _ in self.params], TreeSum()
        for j in range(per):
            self._microbatch(x, y, v * per + j, scale, losses=losses, zero=tree or j == 0)
            if tree:
                self._push(sums)
        if tree:
            grads = [acc.result().reshape(-1) for acc in sums]
        else:
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.params
            ]
        return torch.cat(grads + [self._extra(losses, mask)])

    def _push(self, sums: list[TreeSum]) -> None:
        for acc, p in zip(sums, self.params, strict=True):
            acc.push(p.grad if p.grad is not None else torch.zeros_like(p))

    def _microbatch(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        index: int,
        scale: float,
        *,
        losses: TreeSum,
        zero: bool = True,
        arm: Callable[[], None] | None = None,
    ) -> None:
        """Forward and backward of micro-batch ``index`` (its loss scaled by ``scale``, the
        unscaled loss pushed to ``losses``; ``arm`` called just before backward)."""
        if self.fault is not None:
            self.fault(self.step, index)
        if zero:
            self.optimizer.zero_grad(set_to_none=True)
        rows = slice(index * self.microbatch_size, (index + 1) * self.microbatch_size)
        loss = self.loss_fn(self.module(x[rows]), y[rows])
        losses.push(loss.detach().to(self.dtype).reshape(1))
        if arm is not None:
            arm()
        (loss * scale).backward()

    def _extra(self, losses: TreeSum, mask: int) -> torch.Tensor:
        extra = torch.tensor([0.0, float(mask)], dtype=self.dtype, device=self.params[0].device)
        extra[0] = losses.result().reshape(())
        return extra

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
