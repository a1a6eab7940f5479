"""3D tensor parallelism on a q x q x q grid: the linear layer ``Y = X W^T`` and its backward.

Three axes meet in every rank: the *depth* axis ``D`` (coordinate ``d``: which block of the
batch), the axis of the input features ``A`` (coordinate ``a``) and that of the output
features ``O`` (coordinate ``o``). Rank ``(d, a, o)`` holds

- ``x``: rows ``[(d q + o) b/q^2, ...)`` of the batch, input-feature block ``a`` —
  ``[b/q^2, ..., in/q]``;
- ``w``: piece ``d`` (along the output rows) of the weight block ``W[o, a]`` —
  ``[out/q^2, in/q]`` (``W`` is ``nn.Linear``'s ``[out, in]``);
- ``y``: rows ``[(d q + a) b/q^2, ...)``, output block ``o`` — ``[b/q^2, ..., out/q]``.

So the output has the input's layout with the roles of ``A`` and ``O`` swapped: the next
layer takes ``O`` as its input axis (Bian et al. 2021; Colossal-AI swaps its input and output
groups the same way). A transformer's residual stream keeps one layout, its first linear
maps ``A -> O`` and its second ``O -> A``.

=========  =======================================================  =====================
           collective (group)                                       elements per rank
=========  =======================================================  =====================
forward    all-gather ``x`` over ``O`` -> ``X[d, a]`` ``[b/q, in/q]``  ``(q-1)|X|/q^3``
           all-gather ``w`` over ``D`` -> ``W[o, a]``                ``(q-1)|W|/q^3``
           local ``P = X[d, a] W[o, a]^T``; reduce-scatter ``P``     ``(q-1)|Y|/q^3``
           over ``A`` (the sum over input blocks) -> ``y``
backward   all-gather ``dy`` over ``A`` -> ``dY[d, o]``              ``(q-1)|Y|/q^3``
           ``dX = dY W``; reduce-scatter over ``O`` -> ``dx``        ``(q-1)|X|/q^3``
           ``dW = dY^T X``; reduce-scatter over ``D`` -> ``dw``      ``(q-1)|W|/q^3``
=========  =======================================================  =====================

In all ``2 (q-1)(|X| + |W| + |Y|) / q^3`` per rank per layer on the ring, which with
``|X| = |W| = |Y|`` is the papers' ``6 (q-1)/q^3`` of the activation. The gathered ``X[d, a]``
and ``W[o, a]`` are kept from forward to backward (memory ``|X|/q^2 + |W|/q^2``) instead of
gathered again. Collective over the three axes' groups; blocks up to their timeouts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from plait.strategies.tensor.grid import Axis, gather_blocks, reduce_scatter_blocks


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        axes: tuple[Axis, Axis, Axis],
        algorithm: str,
    ) -> torch.Tensor:
        depth, a_axis, o_axis = axes
        xg = gather_blocks(x.detach(), 0, o_axis, algorithm)
        wg = gather_blocks(w.detach(), 0, depth, algorithm)
        ctx.save_for_backward(xg, wg)
        ctx.axes, ctx.algorithm = axes, algorithm
        return reduce_scatter_blocks(F.linear(xg, wg), 0, a_axis, algorithm)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xg, wg = ctx.saved_tensors
        depth, a_axis, o_axis = ctx.axes
        a = ctx.algorithm
        dyg = gather_blocks(dy.contiguous(), 0, a_axis, a)
        dx = reduce_scatter_blocks(dyg @ wg, 0, o_axis, a)
        dw_full = dyg.reshape(-1, dyg.shape[-1]).t() @ xg.reshape(-1, xg.shape[-1])
        dw = reduce_scatter_blocks(dw_full, 0, depth, a)
        return dx, dw, None, None


def linear_3d(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    depth: Axis,
    input_axis: Axis,
    output_axis: Axis,
    algorithm: str = "auto",
) -> torch.Tensor:
    """``Y = X W^T`` on the 3D grid (module doc: layouts, collectives, bytes).

    ``x`` is ``[b/q^2, ..., in/q]`` (batch first), ``w`` ``[out/q^2, in/q]``. Collective over
    ``depth``, ``input_axis`` and ``output_axis``.
    """
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear_3d: x's last dimension {x.shape[-1]} must equal the weight piece's input "
            f"width {w.shape[1]} (weight piece {tuple(w.shape)} = [out/q^2, in/q])"
        )
    return _Linear3D.apply(x, w, (depth, input_axis, output_axis), algorithm)  # type: ignore[no-any-return]


__all__ = ["linear_3d"]
