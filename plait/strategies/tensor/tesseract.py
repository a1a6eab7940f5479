"""2.5D tensor parallelism (Tesseract, Wang et al. 2021) on a d x q x q grid.

The batch is split over ``d * q`` blocks: the depth layer ``k`` (coordinate along the
``depth`` axis) holds blocks ``k q .. k q + q - 1``, and inside it the ``q x q`` layer runs 2D
SUMMA (:mod:`plait.strategies.tensor.summa`) on its own rows exactly as 2D does: rank
``(k, i, j)`` holds ``x`` = batch block ``k q + i``, input block ``j``; ``w`` = the same
``[out/q, in/q]`` block as 2D rank ``(i, j)``, replicated over depth; ``y`` like ``x``.
Because every depth layer computes its weight gradient from its own batch blocks, the
backward all-reduces ``dw`` over the depth group: that is the only difference from 2D.

Communication per layer, forward + backward, elements per rank (paper count, see ``summa``):
``3 (q-1) (|X|/d + |W|) / q^2`` on the row and column groups (each layer works on ``|X|/d``)
plus ``2 (d-1)/d |W|/q^2`` for the depth all-reduce on the ring. With ``|W| = |X|`` the first
term is ``3 (q-1)(d+1)/(d q^2) |X|``: Colossal-AI's ``3 (q-1)(d+1)/(d q)``, again in units of
``|X|/q``; the table leaves out the depth all-reduce. Collective over the row, column and
depth groups; blocks up to their timeouts.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.strategies.tensor.grid import Grid, all_reduce
from plait.strategies.tensor.summa import matmul_ab, matmul_abt, matmul_atb


class _Tesseract(torch.autograd.Function):
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
        grid, a = ctx.grid, ctx.algorithm
        dy = dy.contiguous()
        dx = matmul_abt(dy, w, grid, a)
        dw = matmul_atb(dy, x, grid, a)
        assert grid.depth is not None
        dw = all_reduce(dw, grid.depth, a)  # the weight is replicated over depth
        return dx, dw, None, None


def tesseract_linear(
    x: torch.Tensor, w: torch.Tensor, *, grid: Grid, algorithm: str = "auto"
) -> torch.Tensor:
    """``Y = X W^T`` on the 2.5D grid (module doc). Collective over ``grid.row``,
    ``grid.col`` and (backward) ``grid.depth``."""
    if grid.depth is None:
        raise ValueError("tesseract_linear needs a 2.5d grid (with a depth axis)")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"tesseract_linear: x's last dimension {x.shape[-1]} must equal the weight block's "
            f"input width {w.shape[1]} (weight block {tuple(w.shape)} = [out/q, in/q])"
        )
    return _Tesseract.apply(x, w, grid, algorithm)  # type: ignore[no-any-return]


def batch_block(grid: Grid) -> tuple[int, int]:
    """``(index, parts)``: this rank's block of the batch, ``k q + i`` of ``d q``."""
    return grid.k * grid.q + grid.i, grid.d * grid.q


__all__ = ["batch_block", "tesseract_linear"]
