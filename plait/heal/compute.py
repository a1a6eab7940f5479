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
        earlier: dict[int, torch.Tensor] = {}
        for i, v in enumerate(mine):
            sums, losses, extra = [TreeSum() for _ in self.params], TreeSum(), mask * (i == 0)
            for j in range(per):
                if i == len(mine) - 1 and j == per - 1:  # the last backward: buckets start

                    def arm(v: int = v, sums: list[TreeSum] = sums, mask: int = extra) -> None:
                        exchange.arm(
                            earlier=earlier,
                            block=v,
                            sums=sums,
                            extra=self._extra(losses, mask),  # noqa: B023 (called at once)
                            owned=owned,
                            world=self.world,
                            group=group,
                        )

                    try:
                        self._microbatch(x, y, v * per + j, scale, losses=losses, arm=arm)
                    except BaseException:
                        exchange.disarm()
                        raise
                    return exchange.finish()
                self._microbatch(x, y, v * per + j, scale, losses=losses)
                for acc, p in zip(sums, self.params, strict=True):
                    acc.push(p.grad if p.grad is not None else torch.zeros_like(p))
            grads = [acc.result().reshape(-1) for acc in sums]
            earlier[v] = torch.cat(grads + [self._extra(losses, extra)])
        raise AssertionError("healing: a member with no block")  # assign gives one each

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
        out: dict[int, torch.Tensor] = {}
        for i, v in enumerate(mine):
            sums, losses = [TreeSum() for _ in self.params], TreeSum()
            for j in range(per):
                first = reproducible or j == 0
                self._microbatch(x, y, v * per + j, scale, losses=losses, zero=first)
                if reproducible:
                    for acc, p in zip(sums, self.params, strict=True):
                        acc.push(p.grad if p.grad is not None else torch.zeros_like(p))
            if reproducible:
                grads = [acc.result().reshape(-1) for acc in sums]
            else:  # accumulated in .grad over the block's micro-batches
                grads = [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in self.params
                ]
            out[v] = torch.cat(grads + [self._extra(losses, mask * (i == 0))])
        return out

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
            losses = TreeSum()
            for j in range(per):
                self._microbatch(x, y, v * per + j, scale, losses=losses, zero=j == 0)
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.params
            ]
            partial = torch.cat(grads + [self._extra(losses, mask * (i == 0))])
            total = partial if total is None else total.add_(partial)
        assert total is not None
        if group.size > 1:
            ops.all_reduce(total, group=group)
        return total

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
        extra = torch.tensor([0.0, float(mask)], dtype=self.dtype)
        extra[0] = losses.result().reshape(())
        return extra

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
