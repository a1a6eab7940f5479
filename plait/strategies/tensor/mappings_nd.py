"""Autograd mappings over one :class:`~plait.strategies.tensor.grid.Axis` of a 2D/2.5D/3D grid.

=========================  =====================================  ============================
mapping                    forward                                backward
=========================  =====================================  ============================
``gather_param``           all-gather blocks along ``dim``        reduce-scatter the gradient
``all_reduce_sum``         all-reduce (sum) over the axis         all-reduce (sum) over it
``reduce_value``           all-reduce (sum) over the axis         identity
``sum_grad_over``          (a hook) -                             all-reduce of the fresh grad
=========================  =====================================  ============================

``gather_param`` is how a parameter stored as one block of a block (bias, LayerNorm scale,
embedding table) is used: every member of the axis needs the whole, and the gradient each
computes is partial (its batch shard), so the dual of the all-gather is a reduce-scatter,
which also sums the gradients over the axis. ``all_reduce_sum`` is for statistics that every
member uses differently (LayerNorm's mean and variance over features split across the
axis): the gradient of a replicated sum is the sum of the members' gradients.
``reduce_value`` ("g") is for values whose gradient is already replicated (the loss).
Blocks are in coordinate order (see ``grid``). Every function is collective on the axis's
group in the direction that communicates, and blocks on the other members up to the group
timeout.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.strategies.tensor.grid import Axis, all_reduce, gather_blocks, reduce_scatter_blocks


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, axis: Axis, algorithm: str) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.algorithm = dim, axis, algorithm
        return gather_blocks(x, dim, axis, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return reduce_scatter_blocks(grad, ctx.dim, ctx.axis, ctx.algorithm), None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, algorithm: str) -> torch.Tensor:
        ctx.axis, ctx.algorithm = axis, algorithm
        return all_reduce(x, axis, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce(grad, ctx.axis, ctx.algorithm), None, None


class _ReduceValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, algorithm: str) -> torch.Tensor:
        return all_reduce(x, axis, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def gather_param(x: torch.Tensor, *, dim: int, axis: Axis, algorithm: str = "auto") -> torch.Tensor:
    """Forward: the members' blocks concatenated along ``dim`` (all-gather, ``(n-1)/n`` of
    the result sent per rank); backward: reduce-scatter of the gradient (the same bytes)."""
    return _GatherParam.apply(x, dim, axis, algorithm)  # type: ignore[no-any-return]


def all_reduce_sum(x: torch.Tensor, *, axis: Axis, algorithm: str = "auto") -> torch.Tensor:
    """Forward and backward: all-reduce (sum) over the axis (``2(n-1)/n`` of ``x`` each on
    the ring)."""
    return _AllReduceSum.apply(x, axis, algorithm)  # type: ignore[no-any-return]


def reduce_value(x: torch.Tensor, *, axis: Axis, algorithm: str = "auto") -> torch.Tensor:
    """Forward: all-reduce (sum) over the axis; backward: identity (the incoming gradient
    is the same on every member, e.g. the seed of a loss every rank holds)."""
    return _ReduceValue.apply(x, axis, algorithm)  # type: ignore[no-any-return]


def sum_grad_over(
    param: torch.Tensor, *, axis: Axis, algorithm: str = "auto"
) -> torch.utils.hooks.RemovableHandle:
    """Every backward's gradient of ``param`` becomes its sum over the axis (one all-reduce
    of ``param.numel()`` elements inside the backward, before accumulation into ``.grad``).
    For a parameter replicated over the axis whose members see different batch shards."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return all_reduce(grad, axis, algorithm)

    return param.register_hook(hook)


__all__ = ["all_reduce_sum", "gather_param", "reduce_value", "sum_grad_over"]
