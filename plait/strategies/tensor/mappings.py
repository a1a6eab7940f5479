"""The conjugate communication mappings of 1D tensor parallelism, as autograd functions.

Each mapping moves an activation between two layouts over the tensor-parallel group ``G`` of
``t`` ranks, and its backward does the dual collective on the gradient:

==============================  =================================  ===========================
mapping                         forward                            backward
==============================  =================================  ===========================
``copy_to_tp`` ("f")            identity                           all-reduce (sum) over G
``reduce_from_tp`` ("g")        all-reduce (sum) over G            identity
``scatter_to_tp``               keep my slice of the last dim      all-gather the last dim
``gather_from_tp``              all-gather the last dim            keep my slice
``scatter_to_sequence``         keep my slice of the sequence dim  all-gather the sequence
``gather_from_sequence``        all-gather the sequence dim        reduce-scatter the sequence
``reduce_scatter_to_sequence``  reduce-scatter the sequence dim    all-gather the sequence
==============================  =================================  ===========================

Bytes per rank for a tensor of ``n`` elements on the ring: all-reduce sends
``2 n (t-1)/t``; all-gather and reduce-scatter of the full ``n`` each send ``n (t-1)/t``.
Every function here is collective in the direction that communicates: every rank of ``G``
must call it, in the same order, with the same shapes (it blocks on the others up to the
group's timeout). Activations are batch-first, so the sequence dimension is ``dim=1``.

:func:`sum_gradient_across` is the parameter-side mapping of sequence parallelism: a
replicated parameter (LayerNorm weight, a bias added after a reduce-scatter) that sees only
this rank's slice of the sequence has a partial gradient, and its hook all-reduces each
backward's fresh gradient over ``G`` before it is accumulated into ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm import traceable
from plait.comm.group import Group


def _all_reduce(x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    # traceable: under torch.compile one graph node (plait/comm/traceable.py), no break
    return traceable.all_reduce(x, group=group, algorithm=algorithm)


def _check_divisible(x: torch.Tensor, dim: int, group: Group, what: str) -> int:
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has {n} entries, "
            f"not a multiple of the tensor-parallel size {group.size} (group {group.name!r}); "
            f"pad it or choose a tensor-parallel size that divides {n}"
        )
    return n // group.size


def split_dim(x: torch.Tensor, dim: int, group: Group, what: str = "split") -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    part = _check_divisible(x, dim, group, what)
    return x.narrow(dim, group.rank * part, part).contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, group: Group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). Collective."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    out = traceable.all_gather(x, group=group, algorithm=algorithm)
    # [t, ..., n, ...] -> [..., t, n, ...] -> [..., t*n, ...]
    moved = out.movedim(0, dim)
    shape = list(x.shape)
    shape[dim] *= group.size
    return moved.reshape(shape)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: Group, algorithm: str) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``. Collective."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    part = _check_divisible(x, dim, group, "reduce-scatter")
    shape = list(x.shape)
    blocks = x.unflatten(dim, (group.size, part)).movedim(dim, 0).contiguous()
    shape[dim] = part
    return traceable.reduce_scatter(blocks, group=group, algorithm=algorithm).view(shape)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.algorithm), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return split_dim(x, -1, group, "scatter_to_tp")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, -1, ctx.group, ctx.algorithm), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim(x, -1, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split_dim(grad, -1, ctx.group, "gather_from_tp backward"), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str, dim: int) -> torch.Tensor:
        ctx.group, ctx.algorithm, ctx.dim = group, algorithm, dim
        return split_dim(x, dim, group, "scatter_to_sequence")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str, dim: int) -> torch.Tensor:
        ctx.group, ctx.algorithm, ctx.dim = group, algorithm, dim
        return all_gather_dim(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return reduce_scatter_dim(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str, dim: int) -> torch.Tensor:
        ctx.group, ctx.algorithm, ctx.dim = group, algorithm, dim
        return reduce_scatter_dim(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


def copy_to_tp(x: torch.Tensor, *, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """ "f": forward ``y = x`` (no communication); backward ``dx = sum_r dy_r`` (all-reduce
    of ``x.numel()`` elements over ``group``). Placed before a column-parallel layer whose
    replicated input feeds ``t`` different weight shards."""
    return _CopyToTP.apply(x, group, algorithm)  # type: ignore[no-any-return]


def reduce_from_tp(x: torch.Tensor, *, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """ "g": forward ``y = sum_r x_r`` (all-reduce over ``group``); backward ``dx = dy`` (no
    communication). Closes a row-parallel layer, whose ranks hold partial sums."""
    return _ReduceFromTP.apply(x, group, algorithm)  # type: ignore[no-any-return]


def scatter_to_tp(x: torch.Tensor, *, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """Forward: keep slice ``rank`` of the last dim (no communication); backward:
    all-gather the gradient's last dim over ``group``."""
    return _ScatterToTP.apply(x, group, algorithm)  # type: ignore[no-any-return]


def gather_from_tp(x: torch.Tensor, *, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """Forward: all-gather the last dim over ``group`` (rank order); backward: keep this
    rank's slice of the gradient (no communication)."""
    return _GatherFromTP.apply(x, group, algorithm)  # type: ignore[no-any-return]


def scatter_to_sequence(
    x: torch.Tensor, *, group: Group, algorithm: str = "auto", dim: int = 1
) -> torch.Tensor:
    """Forward: keep slice ``rank`` of the sequence dim (no communication); backward:
    all-gather the gradient along it. Enters a sequence-parallel region from a replicated
    tensor."""
    return _ScatterToSequence.apply(x, group, algorithm, dim)  # type: ignore[no-any-return]


def gather_from_sequence(
    x: torch.Tensor, *, group: Group, algorithm: str = "auto", dim: int = 1
) -> torch.Tensor:
    """Forward: all-gather the sequence dim over ``group``; backward: reduce-scatter the
    gradient along it (the consumers are tensor-parallel, so each rank's gradient is a
    partial sum). Replaces "f" before a column-parallel layer under sequence parallelism."""
    return _GatherFromSequence.apply(x, group, algorithm, dim)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence(
    x: torch.Tensor, *, group: Group, algorithm: str = "auto", dim: int = 1
) -> torch.Tensor:
    """Forward: sum over ``group`` and keep this rank's slice of the sequence dim
    (reduce-scatter); backward: all-gather the gradient along it. Replaces "g" after a
    row-parallel layer under sequence parallelism."""
    return _ReduceScatterToSequence.apply(x, group, algorithm, dim)  # type: ignore[no-any-return]


def sum_gradient_across(
    param: torch.Tensor, *, group: Group, algorithm: str = "auto"
) -> torch.utils.hooks.RemovableHandle:
    """Make every backward's gradient of ``param`` the sum over ``group`` of the ranks'
    gradients (one all-reduce of ``param.numel()`` elements per backward, inside it).

    For replicated parameters applied to a sequence slice (sequence parallelism): each rank's
    gradient covers its tokens only, and the dense gradient is their sum. The hook acts on
    the fresh gradient before accumulation, so gradient accumulation over several backward
    passes stays exact. Collective: every rank of ``group`` runs it in the same backward.
    """
    if group.size == 1:
        return param.register_hook(lambda g: g)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group, algorithm)

    return param.register_hook(hook)
