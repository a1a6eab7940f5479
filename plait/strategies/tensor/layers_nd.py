"""2D / 2.5D / 3D tensor-parallel layers: Linear (+ bias), LayerNorm, Embedding.

A :class:`Placement` says where the *stream* (the activations between layers, ``[b, s, h]``)
lives on the grid:

=======  ====================================  ===========================  ==================
mode     batch block held                      feature block held           params stored as
=======  ====================================  ===========================  ==================
2d       ``i`` of ``q`` (row coordinate)       ``j`` (column coordinate)    1/q^2 pieces
2.5d     ``k q + i`` of ``d q`` (depth ``k``)   ``j``                        1/q^2, replicated
                                                                            over depth
3d       ``k q + j`` of ``q^2``                ``i`` (row coordinate)       weights 1/q^3;
                                                                            vectors, tables
                                                                            1/q^2
=======  ====================================  ===========================  ==================

Vectors and tables (bias, LayerNorm scale and shift, embedding tables) are stored as one
*piece* of the feature block they act on and gathered on use (``gather_param``: all-gather
forward, reduce-scatter of the gradient backward) over the *piece axis* (2D/2.5D: the
column group; 3D: the depth group); where the layer is replicated over ranks that see other
batch blocks, a hook sums the gradient over them (2.5D: depth; 3D: the axis of the batch
piece). :class:`LinearND` runs :func:`~plait.strategies.tensor.summa.summa_linear` (2D),
:func:`~plait.strategies.tensor.tesseract.tesseract_linear` (2.5D) or
:func:`~plait.strategies.tensor.three_d.linear_3d` (3D; ``input="stream"`` maps the stream's
feature axis to the other one, ``input="swapped"`` maps back). :class:`LayerNormND`
all-reduces its two statistics over the feature axis (forward and backward: two all-reduces
of ``rows * s`` elements each way). :class:`EmbeddingND` looks up ids of this rank's batch
block in its feature block of the table (no communication but the table's gather).

Each layer is built from its dense counterpart with ``from_dense`` (the dense tensors are
sliced) and gives them back with ``full_state()`` (all-gathers; collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.tensor.grid import Axis, Grid, block, gather_blocks, padded
from plait.strategies.tensor.mappings_nd import all_reduce_sum, gather_param, sum_grad_over
from plait.strategies.tensor.summa import summa_linear
from plait.strategies.tensor.tesseract import tesseract_linear
from plait.strategies.tensor.three_d import linear_3d

INPUTS_3D = ("stream", "swapped")


@dataclass(frozen=True)
class Placement:
    """Where the stream of a ``grid`` lives (module doc); built by :func:`placement`."""

    grid: Grid
    features: Axis  # its coordinate is the stream's feature block
    other: Axis  # 3D: the axis a "stream" linear maps the features to; 2D: the column group
    batch_index: int
    batch_parts: int
    piece: Axis  # vectors and tables are stored one piece per coordinate of this axis
    replicas: tuple[Axis, ...]  # stream-side vectors are replicated over these axes


def placement(grid: Grid) -> Placement:
    if grid.mode == "3d":
        assert grid.depth is not None
        # features on the row coordinate (grid.col varies it), batch piece on the column one
        return Placement(
            grid,
            grid.col,
            grid.row,
            grid.k * grid.q + grid.j,
            grid.q * grid.q,
            grid.depth,
            (grid.row,),
        )
    replicas = (grid.depth,) if grid.depth is not None else ()
    return Placement(
        grid, grid.row, grid.col, grid.k * grid.q + grid.i, grid.d * grid.q, grid.col, replicas
    )


class _Vector:
    """A vector or table stored as piece ``piece.coord`` (along ``dim``) of feature block
    ``features.coord``; ``replicas``: axes over which the gradient is summed."""

    def __init__(self, features: Axis, piece: Axis, replicas: tuple[Axis, ...], dim: int) -> None:
        self.features, self.piece, self.replicas, self.dim = features, piece, replicas, dim

    def parts(self) -> int:
        return self.features.size * self.piece.size

    def local(self, dense: torch.Tensor, what: str) -> torch.Tensor:
        feat = block(dense, self.dim, self.features.coord, self.features.size, what)
        return block(feat, self.dim, self.piece.coord, self.piece.size, what).clone()

    def register(self, p: nn.Parameter, algorithm: str) -> None:
        for axis in self.replicas:
            if axis.size > 1:
                sum_grad_over(p, axis=axis, algorithm=algorithm)

    def use(self, p: torch.Tensor, algorithm: str) -> torch.Tensor:
        return gather_param(p, dim=self.dim, axis=self.piece, algorithm=algorithm)

    def full(self, p: torch.Tensor, algorithm: str) -> torch.Tensor:
        feat = gather_blocks(p.detach(), self.dim, self.piece, algorithm)
        return gather_blocks(feat, self.dim, self.features, algorithm).clone()


class LinearND(nn.Module):
    """``y = x W^T + b`` on the grid of ``where`` (module doc; the communication of each
    mode is in ``summa``, ``tesseract``, ``three_d``, plus the bias's gather_param). The
    output features are padded to a multiple of ``q`` (2D/2.5D) or ``q^2`` (3D) with
    ``pad=True`` (a vocabulary head); otherwise they must divide."""

    def __init__(
        self,
        dense: nn.Linear,
        *,
        where: Placement,
        input: str = "stream",
        pad: bool = False,
        algorithm: str = "auto",
    ) -> None:
        super().__init__()
        grid = where.grid
        if input not in INPUTS_3D or (grid.mode != "3d" and input != "stream"):
            allowed = list(INPUTS_3D) if grid.mode == "3d" else ["stream"]
            raise ValueError(f"LinearND ({grid.mode}): input={input!r}; use one of {allowed}")
        self.where, self.input, self.algorithm = where, input, algorithm
        self.in_features, self.out_features = dense.in_features, dense.out_features
        q = grid.q
        multiple = q * q if grid.mode == "3d" else q
        out_p = padded(self.out_features, multiple) if pad else self.out_features
        if out_p % multiple or (grid.mode == "3d" and out_p % (q * q)):
            raise ValueError(
                f"out_features {self.out_features} is not divisible by {multiple} ({grid.mode}, "
                f"q={q}); choose a width it divides"
            )
        if self.in_features % q:
            raise ValueError(
                f"in_features {self.in_features} is not divisible by q={q} ({grid.mode})"
            )
        self.out_padded = out_p
        w = dense.weight.detach()
        if out_p > self.out_features:
            w = torch.cat([w, w.new_zeros(out_p - self.out_features, w.shape[1])])
        b = None if dense.bias is None else dense.bias.detach()
        if b is not None and out_p > self.out_features:
            b = torch.cat([b, b.new_zeros(out_p - self.out_features)])
        what = f"LinearND {tuple(dense.weight.shape)}"
        if grid.mode == "3d":
            assert grid.depth is not None
            a_axis, o_axis = (
                (where.features, where.other)
                if input == "stream"
                else (where.other, where.features)
            )
            self.axes = (grid.depth, a_axis, o_axis)
            wb = block(block(w, 0, o_axis.coord, q, what), 1, a_axis.coord, q, what)
            local = block(wb, 0, grid.depth.coord, q, what)
            # the bias acts on output block o; the output's batch piece follows the input axis
            self.vector = _Vector(o_axis, grid.depth, (a_axis,), 0)
        else:
            # rank (i, j): output block j, input block i
            local = block(block(w, 0, grid.j, q, what), 1, grid.i, q, what)
            self.vector = _Vector(grid.row, grid.col, where.replicas, 0)
        self.weight = nn.Parameter(local.clone())
        self.bias: nn.Parameter | None = None
        if b is not None:
            if out_p % (q * q):
                raise ValueError(
                    f"the bias of out_features {out_p} is stored in q^2 = {q * q} pieces; "
                    f"choose a width q^2 divides"
                )
            self.bias = nn.Parameter(self.vector.local(b, what + " bias"))
            self.vector.register(self.bias, algorithm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid, a = self.where.grid, self.algorithm
        if grid.mode == "3d":
            depth, a_axis, o_axis = self.axes
            y = linear_3d(
                x, self.weight, depth=depth, input_axis=a_axis, output_axis=o_axis, algorithm=a
            )
        elif grid.mode == "2.5d":
            y = tesseract_linear(x, self.weight, grid=grid, algorithm=a)
        else:
            y = summa_linear(x, self.weight, grid=grid, algorithm=a)
        if self.bias is not None:
            y = y + self.vector.use(self.bias, a)
        return y

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``), padding dropped. Collective."""
        grid, a = self.where.grid, self.algorithm
        w = self.weight.detach()
        if grid.mode == "3d":
            depth, a_axis, o_axis = self.axes
            w = gather_blocks(gather_blocks(w, 0, depth, a), 1, a_axis, a)
            w = gather_blocks(w, 0, o_axis, a)
        else:
            w = gather_blocks(gather_blocks(w, 1, grid.col, a), 0, grid.row, a)
        out = {"weight": w[: self.out_features].clone()}
        if self.bias is not None:
            out["bias"] = self.vector.full(self.bias, a)[: self.out_features].clone()
        return out

    def extra_repr(self) -> str:
        g = self.where.grid
        return (
            f"in={self.in_features}, out={self.out_features}, {g.mode} q={g.q}, "
            f"local weight {tuple(self.weight.shape)}, input={self.input}"
        )


class LayerNormND(nn.Module):
    """``nn.LayerNorm`` over features split across ``where.features``. Forward and backward:
    two all-reduces (sum, then sum of squares about the mean) of one value per token on the
    feature group; scale and shift through ``gather_param`` on the piece group."""

    def __init__(self, dense: nn.LayerNorm, *, where: Placement, algorithm: str = "auto") -> None:
        super().__init__()
        if len(dense.normalized_shape) != 1:
            raise ValueError("LayerNormND normalizes over the last dimension only")
        self.where, self.algorithm = where, algorithm
        self.width, self.eps = dense.normalized_shape[0], dense.eps
        self.vector = _Vector(where.features, where.piece, where.replicas, 0)
        what = f"LayerNormND({self.width})"
        if self.width % self.vector.parts():
            raise ValueError(
                f"{what}: width {self.width} is not divisible into {self.vector.parts()} pieces "
                f"({where.grid.mode}, q={where.grid.q})"
            )
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if dense.weight is not None:
            self.weight = nn.Parameter(self.vector.local(dense.weight.detach(), what))
            self.vector.register(self.weight, algorithm)
        if dense.bias is not None:
            self.bias = nn.Parameter(self.vector.local(dense.bias.detach(), what))
            self.vector.register(self.bias, algorithm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axis, a = self.where.features, self.algorithm
        mean = all_reduce_sum(x.sum(-1, keepdim=True), axis=axis, algorithm=a) / self.width
        xc = x - mean
        var = all_reduce_sum((xc * xc).sum(-1, keepdim=True), axis=axis, algorithm=a) / self.width
        y = xc * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.vector.use(self.weight, a)
        if self.bias is not None:
            y = y + self.vector.use(self.bias, a)
        return y

    def full_state(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.weight is not None:
            out["weight"] = self.vector.full(self.weight, self.algorithm)
        if self.bias is not None:
            out["bias"] = self.vector.full(self.bias, self.algorithm)
        return out


class EmbeddingND(nn.Module):
    """``nn.Embedding`` whose output is this rank's feature block: the table is stored as a
    piece of its column block and gathered on use (``gather_param`` on the piece group;
    the gradient is reduce-scattered back). The ids are this rank's batch block (the model's
    input is cut at its entry), or positions broadcast over the batch."""

    def __init__(self, dense: nn.Embedding, *, where: Placement, algorithm: str = "auto") -> None:
        super().__init__()
        unsupported = [
            k
            for k, v in {
                "padding_idx": dense.padding_idx is not None,
                "max_norm": dense.max_norm is not None,
                "sparse": dense.sparse,
                "scale_grad_by_freq": dense.scale_grad_by_freq,
            }.items()
            if v
        ]
        if unsupported:
            raise ValueError(f"EmbeddingND: nn.Embedding options {unsupported} are not supported")
        self.where, self.algorithm = where, algorithm
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.vector = _Vector(where.features, where.piece, where.replicas, 1)
        what = f"EmbeddingND({self.num_embeddings}, {self.embedding_dim})"
        if self.embedding_dim % self.vector.parts():
            raise ValueError(
                f"{what}: width {self.embedding_dim} is not divisible into {self.vector.parts()} "
                f"pieces ({where.grid.mode}, q={where.grid.q})"
            )
        self.weight = nn.Parameter(self.vector.local(dense.weight.detach(), what))
        self.vector.register(self.weight, algorithm)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.vector.use(self.weight, self.algorithm))

    def full_state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.vector.full(self.weight, self.algorithm)}


ND_LAYERS = (LinearND, LayerNormND, EmbeddingND)

__all__ = ["ND_LAYERS", "EmbeddingND", "LayerNormND", "LinearND", "Placement", "placement"]
