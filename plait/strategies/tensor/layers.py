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
  to the sequence slice. ``padding_idx`` is kept by the rank that holds that row (its
  gradient stays zero, as in ``nn.Embedding``).
- :class:`HeadSelectLinear`: a key/value projection of grouped-query attention with fewer
  key/value heads than ranks: the weight stays whole on every rank, rank ``r`` computes the
  head its query heads read (head ``r // (t / kv)``), input through "f"; each backward's
  weight gradient (non-zero on that head's rows only) is summed over ``G``.

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

# "gathered": the input is whole already, gathered from the sequence by an enclosing
# module (whose reduce-scatter sums the partial dX in backward): no mapping here
INPUTS_COL = ("replicate", "sequence", "gathered")
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
    output if ``gather_output`` (the whole ``out_features``, padding cut off); backward one
    all-reduce (or reduce-scatter) of ``dX``.
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
        blocks: int = 1,
        transposed: bool = False,
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.input = _choice("ColumnParallelLinear", "input", input, INPUTS_COL)
        self.gather_output = gather_output
        self.blocks, self.transposed = blocks, transposed
        if out_features % blocks or (blocks > 1 and (pad or gather_output)):
            raise ValueError(
                f"ColumnParallelLinear: {out_features} outputs in {blocks} fused parts: the "
                f"parts must be equal, and a fused projection is neither padded nor gathered"
            )
        what = "out_features" if blocks == 1 else "out_features per part"
        self.part = blocks * _part(
            "ColumnParallelLinear", what, out_features // blocks, group, pad=pad
        )
        self.weight = nn.Parameter(torch.empty(self.part, in_features, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(self.part, dtype=dtype, device=device)) if bias else None
        )

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
        k = layer.blocks
        with torch.no_grad():
            for mine, full in ((layer.weight, dense.weight), (layer.bias, dense.bias)):
                if mine is None or full is None:
                    continue
                parts = full.chunk(k)  # each fused part split on its own
                mine.copy_(torch.cat([_rows(p, layer.part // k, group.rank) for p in parts]))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, a = self.group, self.algorithm
        if self.input == "sequence":
            x = M.gather_from_sequence(x, group=g, algorithm=a)
        elif self.input == "replicate":
            x = M.copy_to_tp(x, group=g, algorithm=a)
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        y = M.gather_from_tp(y, group=g, algorithm=a)
        # padded rows (a vocabulary t does not divide) are cut off: their gradient is zero
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``), padding dropped, fused parts put back in
        order, a transposed weight in its own ``[in, out]`` layout. Collective."""
        out = {}
        for key, local in (("weight", self.weight), ("bias", self.bias)):
            if local is None:
                continue
            k, t = self.blocks, self.group.size
            every = _gather_rows(local, t * self.part, self.group)  # [t * k * p, ...]
            if k > 1:  # [t, k, p, ...] -> [k, t, p, ...]
                every = every.unflatten(0, (t, k, -1)).transpose(0, 1).flatten(0, 2)
            full = every[: self.out_features].clone()
            out[key] = full.t().contiguous() if key == "weight" and self.transposed else full
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
        transposed: bool = False,
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.transposed = transposed
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
        out = {"weight": w if self.transposed else w.t().contiguous()}
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
        padding_idx: int | None = None,
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
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx

    @property
    def start(self) -> int:
        return self.group.rank * self.part

    @classmethod
    def from_dense(
        cls, dense: nn.Embedding, *, group: Group, **options: Any
    ) -> VocabParallelEmbedding:
        unsupported = {
            "max_norm": dense.max_norm is not None,
            "sparse": dense.sparse,
            "scale_grad_by_freq": dense.scale_grad_by_freq,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"VocabParallelEmbedding: nn.Embedding options {bad} are not supported (they "
                f"need the whole table or the whole batch's counts); build the embedding "
                f"without them or keep it whole (style 'replicate')"
            )
        layer = cls(
            dense.num_embeddings,
            dense.embedding_dim,
            group=group,
            padding_idx=dense.padding_idx,
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
        pad = self.padding_idx
        local_pad = None
        if pad is not None and self.start <= pad < self.start + self.part:
            local_pad = pad - self.start
        # the padding row gets no gradient; masked ids read local row 0, zeroed after
        y = F.embedding(local, self.weight, padding_idx=local_pad)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
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


class HeadSelectLinear(nn.Module):
    """A key or value projection kept whole on every rank, of which each rank computes the
    one head its query heads read (grouped-query attention with ``kv`` heads over ``t > kv``
    ranks, ``t`` a multiple of ``kv``): rank ``r`` computes head ``r // replicas``,
    ``replicas = t / kv``.

    Communication per call on ``group``: forward none (``input="replicate"``: "f") or one
    all-gather of the input along the sequence (``"sequence"``); backward one all-reduce
    (or reduce-scatter) of ``dX``, and one all-reduce of the weight's (and bias's) gradient,
    whose rows are non-zero only for this rank's head: their sum over ``G`` is the dense
    gradient. The weight is replicated over ``G``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        head_dim: int,
        replicas: int,
        bias: bool = True,
        input: str = "replicate",
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.input = _choice("HeadSelectLinear", "input", input, INPUTS_COL)
        self.head_dim, self.replicas = head_dim, replicas
        if out_features % head_dim or (out_features // head_dim) * replicas != group.size:
            raise ValueError(
                f"HeadSelectLinear: {out_features} outputs of {head_dim}-wide heads over "
                f"{replicas} ranks per head do not fill the group of {group.size} ranks"
            )
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        for p in self.parameters():
            M.sum_gradient_across(p, group=group, algorithm=algorithm)

    @property
    def start(self) -> int:
        """The first output feature this rank computes."""
        return (self.group.rank // self.replicas) * self.head_dim

    @classmethod
    def from_dense(cls, dense: nn.Linear, *, group: Group, **options: Any) -> HeadSelectLinear:
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
            layer.weight.copy_(dense.weight)
            if dense.bias is not None and layer.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, a = self.group, self.algorithm
        if self.input == "sequence":
            x = M.gather_from_sequence(x, group=g, algorithm=a)
        elif self.input == "replicate":
            x = M.copy_to_tp(x, group=g, algorithm=a)
        rows = slice(self.start, self.start + self.head_dim)
        return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``): this rank's copy. No communication."""
        out = {"weight": self.weight.detach().clone()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (head {self.start // self.head_dim}"
            f" on rank {self.group.rank} of {self.group.size}), input={self.input}"
        )
