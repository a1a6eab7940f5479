"""The fused query/key/value projection of multi-query attention, split by query heads.

Multi-query attention (GPT-BigCode, Falcon's default) computes every query head and one
shared key and value head with one linear: ``y = [x Wq^T ; x Wk^T ; x Wv^T]``, the key and
value being the last ``tail`` outputs. With one key/value head and ``t > 1`` ranks the key
and value cannot be split, so, as Megatron does for key/value heads fewer than the ranks,
they stay whole on every rank while the query rows are split:
``y_r = [x Wq_r^T ; x Wkv^T]``, rank ``r`` computing query heads ``r h/t .. (r+1) h/t - 1``
and the shared key and value that all of them read.

Communication per call on ``group``: forward none (``input="replicate"``: "f") or one
all-gather of the input along the sequence (``"sequence"``); backward one all-reduce (or
reduce-scatter) of ``dX``, and one all-reduce of the key/value rows' weight (and bias)
gradient: each rank's covers its query heads only, the dense gradient is their sum. The
query rows shard over ``G``, the key/value rows replicate over it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.comm.group import Group
from plait.strategies.tensor import mappings as M

INPUTS = ("replicate", "sequence")


class MultiQueryLinear(nn.Module):
    """``weight``/``bias``: this rank's query rows; ``tail_weight``/``tail_bias``: the key
    and value rows, whole (module doc)."""

    # parameters that are this layer's own, not the dense model's (full_state folds them in),
    # and the dense parameter each is part of (for the optimizer's groups)
    local_only = ("tail_weight", "tail_bias")
    dense_names = {"tail_weight": "weight", "tail_bias": "bias"}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tail: int,
        group: Group,
        bias: bool = True,
        input: str = "replicate",
        algorithm: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        query = out_features - tail
        if tail <= 0 or query <= 0 or query % group.size:
            raise ValueError(
                f"MultiQueryLinear: {out_features} outputs with a whole tail of {tail}: the "
                f"{query} query outputs must split over the group of {group.size} ranks"
            )
        if input not in INPUTS:
            raise ValueError(f"MultiQueryLinear: input={input!r}; use one of {list(INPUTS)}")
        self.in_features, self.out_features, self.tail = in_features, out_features, tail
        self.group, self.algorithm, self.input = group, algorithm, input
        rows = query // group.size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(rows, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(rows, **kw)) if bias else None
        self.tail_weight = nn.Parameter(torch.empty(tail, in_features, **kw))
        self.tail_bias = nn.Parameter(torch.zeros(tail, **kw)) if bias else None
        for p in (self.tail_weight, self.tail_bias):
            if p is not None:
                M.sum_gradient_across(p, group=group, algorithm=algorithm)

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, *, group: Group, tail: int, **options: Any
    ) -> MultiQueryLinear:
        layer = cls(
            dense.in_features,
            dense.out_features,
            tail=tail,
            group=group,
            bias=dense.bias is not None,
            dtype=dense.weight.dtype,
            device=dense.weight.device,
            **options,
        )
        query = dense.out_features - tail
        rows = slice(group.rank * query // group.size, (group.rank + 1) * query // group.size)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[rows])
            layer.tail_weight.copy_(dense.weight[query:])
            if dense.bias is not None:
                assert layer.bias is not None and layer.tail_bias is not None
                layer.bias.copy_(dense.bias[rows])
                layer.tail_bias.copy_(dense.bias[query:])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, a = self.group, self.algorithm
        if self.input == "sequence":
            x = M.gather_from_sequence(x, group=g, algorithm=a)
        else:
            x = M.copy_to_tp(x, group=g, algorithm=a)
        return torch.cat(
            [F.linear(x, self.weight, self.bias), F.linear(x, self.tail_weight, self.tail_bias)],
            dim=-1,
        )

    def full_state(self) -> dict[str, torch.Tensor]:
        """The dense ``weight`` (and ``bias``): the query rows all-gathered over the group in
        rank order, then the whole key/value rows. Collective."""
        g, a = self.group, self.algorithm
        rows = M.all_gather_dim(self.weight.detach(), 0, g, a)
        out = {"weight": torch.cat([rows, self.tail_weight.detach()])}
        if self.bias is not None and self.tail_bias is not None:
            part = M.all_gather_dim(self.bias.detach(), 0, g, a)
            out["bias"] = torch.cat([part, self.tail_bias.detach()])
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(query rows {self.weight.shape[0]} of this rank, whole tail {self.tail}), "
            f"group={self.group.name!r}"
        )
