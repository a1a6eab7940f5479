"""SUMMA on a q x q grid: the 2D matmul ``Y = X W^T`` and its two backward products.

Rank ``(i, j)`` (row ``i``, column ``j``; see ``grid``) holds

- ``x_ij``: batch block ``i`` and input-feature block ``j`` of the activation ``X`` —
  ``[b/q, ..., in/q]``;
- ``w_ij``: output block ``j`` and input block ``i`` of the ``nn.Linear`` weight
  ``W [out, in]`` — ``[out/q, in/q]``;
- ``y_ij``: batch block ``i``, output block ``j`` of ``Y = X W^T`` — the same layout as ``X``.

The three products, each ``q`` steps (van de Geijn & Watts' SUMMA; Optimus, Xu et al. 2021):

====================  ==================================  ==================================
product               step ``k`` communicates              then
====================  ==================================  ==================================
``Y = X W^T``  (AB)   broadcast ``x_ik`` along the row     ``y_ij += x_ik w_kj^T``
                      (root: column ``k``); broadcast
                      ``w_kj`` along the column (root:
                      row ``k``)
``dX = dY W``  (ABT)  broadcast ``w_kj`` along the column  ``p = dy_ij w_kj``; reduce ``p``
                                                           along the row to column ``k``
``dW = dY^T X`` (ATB) broadcast ``x_ik`` along the row     ``p = dy_ij^T x_ik``; reduce ``p``
                                                           along the column to row ``k``
====================  ==================================  ==================================

Bytes. Over one step every row broadcasts one ``x`` block and every column one ``w`` block;
a broadcast or reduce of ``S`` bytes over ``q`` ranks sends ``(q-1) S`` in all under the
paper's count (a root sending to each, or a chain). Over the ``q^2`` ranks and ``q`` steps of
the three products that is ``3 (q-1) (|X| + |W|) / q^2`` bytes per rank per layer, forward
plus backward, ``|X|`` and ``|W|`` the whole activation and weight. With ``|W| = |X|`` this
is ``6 (q-1)/q^2 |X|``: Colossal-AI's table states ``6 (q-1)/q`` in units of ``|X|/q`` (one
rank's block row). plait's ring ``reduce`` sends a little more than ``(q-1) S`` (a
reduce-scatter, then each block to the root: ``(q-1)(q+1) S / q``);
:mod:`plait.plan.tensor_costs` gives the exact count per algorithm, and the tests check it.

The broadcasts of the backward repeat the forward's (the operands are not kept between
forward and backward, as in the paper): memory ``O(|X| / q^2)`` per rank. Every function
here is collective over the grid's row and column groups and blocks on them up to their
timeout. No dtype is changed (Colossal-AI casts inputs to fp16 under autocast).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from plait import comm
from plait.strategies.tensor.grid import Axis, Grid


def _bcast(t: torch.Tensor, axis: Axis, k: int, algorithm: str) -> torch.Tensor:
    """The block of the member at coordinate ``k`` (mine when I am it). Collective."""
    if axis.size == 1:
        return t
    buf = (
        t.contiguous()
        if axis.coord == k
        else torch.empty_like(t, memory_format=torch.contiguous_format)
    )
    comm.broadcast(buf, axis.root(k), group=axis.group, algorithm=algorithm)
    return buf


def _reduce(t: torch.Tensor, axis: Axis, k: int, algorithm: str) -> torch.Tensor | None:
    """The sum over the axis, on the member at coordinate ``k`` only. Collective."""
    if axis.size == 1:
        return t
    buf = t.contiguous()
    comm.reduce(buf, axis.root(k), group=axis.group, algorithm=algorithm)
    return buf if axis.coord == k else None


def matmul_ab(
    x: torch.Tensor, w: torch.Tensor, grid: Grid, algorithm: str = "auto"
) -> torch.Tensor:
    """``y_ij = sum_k x_ik w_kj^T`` (no autograd; see the module doc)."""
    y: torch.Tensor | None = None
    for k in range(grid.q):
        a = _bcast(x, grid.row, k, algorithm)
        b = _bcast(w, grid.col, k, algorithm)
        part = F.linear(a, b)
        y = part if y is None else y.add_(part)
    assert y is not None
    return y


def matmul_abt(
    dy: torch.Tensor, w: torch.Tensor, grid: Grid, algorithm: str = "auto"
) -> torch.Tensor:
    """``dx_ij = sum_l dy_il w_jl`` (``dX = dY W``; no autograd)."""
    mine: torch.Tensor | None = None
    for k in range(grid.q):
        b = _bcast(w, grid.col, k, algorithm)
        got = _reduce(dy @ b, grid.row, k, algorithm)
        if got is not None:
            mine = got
    assert mine is not None
    return mine


def matmul_atb(
    dy: torch.Tensor, x: torch.Tensor, grid: Grid, algorithm: str = "auto"
) -> torch.Tensor:
    """``dw_ij = sum_l dy_lj^T x_li`` over every leading (batch, sequence) dimension
    (``dW = dY^T X``; no autograd)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    mine: torch.Tensor | None = None
    for k in range(grid.q):
        a = _bcast(x, grid.row, k, algorithm).reshape(-1, x.shape[-1])
        got = _reduce(dy2.t() @ a, grid.col, k, algorithm)
        if got is not None:
            mine = got
    assert mine is not None
    return mine


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, grid: Grid, algorithm: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.grid, ctx.algorithm = grid, algorithm
        return matmul_ab(x.detach(), w.detach(), grid, algorithm)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        # both products are collective: run them even if one gradient is not needed, so
        # every rank of the grid issues the same sequence of broadcasts and reduces
        dx = matmul_abt(dy, w, ctx.grid, ctx.algorithm)
        dw = matmul_atb(dy, x, ctx.grid, ctx.algorithm)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            None,
            None,
        )


def summa_linear(
    x: torch.Tensor, w: torch.Tensor, *, grid: Grid, algorithm: str = "auto"
) -> torch.Tensor:
    """``Y = X W^T`` on the grid, differentiable in ``x`` and ``w`` (module doc: layouts,
    collectives, bytes). Collective over ``grid.row`` and ``grid.col``."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"summa_linear: x's last dimension {x.shape[-1]} must equal the weight block's "
            f"input width {w.shape[1]} (weight block {tuple(w.shape)} = [out/q, in/q])"
        )
    return _Summa.apply(x, w, grid, algorithm)  # type: ignore[no-any-return]


__all__ = ["matmul_ab", "matmul_abt", "matmul_atb", "summa_linear"]
