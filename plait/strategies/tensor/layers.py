"""Tensor-parallel layers: each holds a 1/t shard of a dense layer's weight.

``t`` is the size of the tensor-parallel group ``G``, ``r`` this rank's place in it.
Shapes follow ``nn.Linear`` (``weight`` is ``[out, in]``) and ``nn.Embedding``.

- :class:`ColumnParallelLinear`: ``Y = X A^T + b`` with ``A`` split along its output rows,
  rank ``r`` holding rows ``[r*out/t, (r+1)*out/t)`` of ``A`` and of ``b``. Input replicated
  ("f": no communication forward, all-reduce of ``dX`` backward) or, under sequence
  parallelism, sliced along the sequence (all-gather forward, reduce-scatter of ``dX``
  backward). Output: this rank's slice of the last dim (or all-gathered, ``gather_output``).
- :class:`RowParallelLinear`: ``A`` split along its input columns, ``X`` along its last dim;
  each rank's ``X_r A_r^T`` is a partial sum, combined by "g" (all-reduce forward, nothing
  backward) or, under sequence parallelism, a reduce-scatter to the sequence slice
  (all-gather of ``dY`` backward). The bias is replicated and added after the reduction.
- :class:`VocabParallelEmbedding`: rank ``r`` holds rows ``[r*Vp/t, (r+1)*Vp/t)`` of the
  table, the vocabulary ``V`` padded to ``Vp``, a multiple of ``t``. Ids outside the range
  look up row 0 and are zeroed; the partial outputs are combined by "g" or reduce-scattered
  to the sequence slice.

Each layer is built from its dense counterpart with ``from_dense(...)`` (the dense weights
sliced, so a model built and seeded identically on every rank becomes its exact sharded
form), and gives the dense tensors back with ``full_state()`` (an all-gather; collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.comm.group import Group
from plait.strategies.tensor import mappings as M

INPUTS_COL = ("replicate", "sequence")
INPUTS_ROW = ("sharded", "replicate")
OUTPUTS = ("replicate", "sequence")


def _choice(layer: str, name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{layer}: {name}={value!r}; use one of {list(allowed)}")
    return value


def _part(layer: str, what: str, n: int, group: Group, *, pad: bool) -> int:
    """Rows per rank: ``n / t``; with ``pad``, ``ceil(n / t)`` (the tail padded)."""
    if pad:
        return -(-n // group.size)
    if n % group.size:
        raise ValueError(
            f"{layer}: {what} {n} is not divisible by the tensor-parallel size {group.size} "
            f"(group {group.name!r}); choose a size that divides {n}"
        )
    return n // group.size


def _rows(dense: torch.Tensor, part: int, rank: int) -> torch.Tensor:
    """Rows ``[rank*part, (rank+1)*part)`` of ``dense``, zero-padded past its end."""
    out = dense.new_zeros((part, *dense.shape[1:]))
    lo, hi = rank * part, min((rank + 1) * part, dense.shape[0])
    if hi > lo:
        out[: hi - lo] = dense[lo:hi]
    return out


def _gather_rows(local: torch.Tensor, rows: int, group: Group) -> torch.Tensor:
    full = M.all_gather_dim(local.detach(), 0, group, "auto")
    return full[:rows].clone()


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across the group (see module doc).

    Communication per call on ``group``: forward none (``input="replicate"``) or one
    all-gather of the input along the sequence (``"sequence"``), plus one all-gather of the
    output if ``gather_output``; backward one all-reduce (or reduce-scatter) of ``dX``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        input: str = "replicate",
        gather_output: bool = False,
        pad: bool = False,
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.input = _choice("ColumnParallelLinear", "input", input, INPUTS_COL)
        self.gather_output = gather_output
        self.part = _part("ColumnParallelLinear", "out_features", out_features, group, pad=pad)
        self.weight = nn.Parameter(torch.empty(self.part, in_features, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(self.part, dtype=dtype, device=device)) if bias else None
        )
        if gather_output and self.part * group.size != out_features:
            raise ValueError("ColumnParallelLinear: gather_output needs out_features % t == 0")

    @property
    def start(self) -> int:
        """The first output feature this rank computes."""
        return self.group.rank * self.part

    @classmethod
    def from_dense(cls, dense: nn.Linear, *, group: Group, **options: Any) -> ColumnParallelLinear:
        layer = cls(
            dense.in_features,
            dense.out_features,
            group=group,
            bias=dense.bias is not None,
            dtype=dense.weight.dtype,
            device=dense.weight.device,
            **options,
        )
        with torch.no_grad():
            layer.weight.copy_(_rows(dense.weight, layer.part, group.rank))
            if dense.bias is not None and layer.bias is not None:
                layer.bias.copy_(_rows(dense.bias, layer.part, group.rank))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, a = self.group, self.algorithm
        if self.input == "sequence":
            x = M.gather_from_sequence(x, group=g, algorithm=a)
        else:
            x = M.copy_to_tp(x, group=g, algorithm=a)
        y = F.linear(x, self.weight, self.bias)
        return M.gather_from_tp(y, group=g, algorithm=a) if self.gather_output else y

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``), padding dropped. Collective."""
        out = {"weight": _gather_rows(self.weight, self.out_features, self.group)}
        if self.bias is not None:
            out["bias"] = _gather_rows(self.bias, self.out_features, self.group)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} ({self.part} on rank "
            f"{self.group.rank} of {self.group.size}), input={self.input}"
        )


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across the group (see module doc).

    Communication per call on ``group``: forward one all-reduce of the output
    (``output="replicate"``) or one reduce-scatter along the sequence (``"sequence"``);
    backward nothing, or one all-gather of ``dY``. With ``input="replicate"`` the input is
    first sliced along its last dim (backward: all-gather of ``dX``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        input: str = "sharded",
        output: str = "replicate",
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.input = _choice("RowParallelLinear", "input", input, INPUTS_ROW)
        self.output = _choice("RowParallelLinear", "output", output, OUTPUTS)
        self.part = _part("RowParallelLinear", "in_features", in_features, group, pad=False)
        self.weight = nn.Parameter(torch.empty(out_features, self.part, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        if self.bias is not None and self.output == "sequence":
            # added to this rank's sequence slice only: the dense gradient is the sum
            M.sum_gradient_across(self.bias, group=group, algorithm=algorithm)

    @classmethod
    def from_dense(cls, dense: nn.Linear, *, group: Group, **options: Any) -> RowParallelLinear:
        layer = cls(
            dense.in_features,
            dense.out_features,
            group=group,
            bias=dense.bias is not None,
            dtype=dense.weight.dtype,
            device=dense.weight.device,
            **options,
        )
        with torch.no_grad():
            layer.weight.copy_(_rows(dense.weight.t(), layer.part, group.rank).t())
            if dense.bias is not None and layer.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, a = self.group, self.algorithm
        if self.input == "replicate":
            x = M.scatter_to_tp(x, group=g, algorithm=a)
        y = F.linear(x, self.weight)
        if self.output == "sequence":
            y = M.reduce_scatter_to_sequence(y, group=g, algorithm=a)
        else:
            y = M.reduce_from_tp(y, group=g, algorithm=a)
        return y if self.bias is None else y + self.bias

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``). Collective."""
        w = _gather_rows(self.weight.t().contiguous(), self.in_features, self.group)
        out = {"weight": w.t().contiguous()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} ({self.part} on rank {self.group.rank} of "
            f"{self.group.size}), out={self.out_features}, output={self.output}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows across the group (see module doc).

    Communication per call on ``group``: forward one all-reduce of the output
    (``output="replicate"``) or one reduce-scatter along the sequence (``"sequence"``);
    backward nothing, or one all-gather of the gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        output: str = "replicate",
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.algorithm = group, algorithm
        self.output = _choice("VocabParallelEmbedding", "output", output, OUTPUTS)
        self.part = _part("VocabParallelEmbedding", "vocabulary", num_embeddings, group, pad=True)
        self.weight = nn.Parameter(
            torch.empty(self.part, embedding_dim, dtype=dtype, device=device)
        )

    @property
    def start(self) -> int:
        return self.group.rank * self.part

    @classmethod
    def from_dense(
        cls, dense: nn.Embedding, *, group: Group, **options: Any
    ) -> VocabParallelEmbedding:
        unsupported = {
            "padding_idx": dense.padding_idx is not None,
            "max_norm": dense.max_norm is not None,
            "sparse": dense.sparse,
            "scale_grad_by_freq": dense.scale_grad_by_freq,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"VocabParallelEmbedding: nn.Embedding options {bad} are not supported"
            )
        layer = cls(
            dense.num_embeddings,
            dense.embedding_dim,
            group=group,
            dtype=dense.weight.dtype,
            device=dense.weight.device,
            **options,
        )
        with torch.no_grad():
            layer.weight.copy_(_rows(dense.weight, layer.part, group.rank))
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.part)
        local = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        g, a = self.group, self.algorithm
        if self.output == "sequence":
            return M.reduce_scatter_to_sequence(y, group=g, algorithm=a)
        return M.reduce_from_tp(y, group=g, algorithm=a)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight``, padding rows dropped. Collective."""
        return {"weight": _gather_rows(self.weight, self.num_embeddings, self.group)}

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (rows {self.start}..{self.start + self.part - 1} on "
            f"rank {self.group.rank} of {self.group.size}), dim={self.embedding_dim}"
        )
