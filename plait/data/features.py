"""Partitioning by dimension: each rank holds a slice of every sample's features.

Where ``split_batch`` cuts a batch by rows (data parallelism), :func:`split_features` cuts
it by columns: rank ``r`` of ``parts`` keeps features ``[r*F/parts, (r+1)*F/parts)`` of
every sample. A model whose first layer is a
:class:`~plait.strategies.tensor.RowParallelLinear` (``plait.parallelize(model, mesh,
{"<first layer>": "rowwise"})``) consumes such slices directly: each rank multiplies its
slice by the matching columns of the weight, and one all-reduce of the layer's output
(``b x out`` elements) forms the exact dense result, so no rank ever holds whole rows.
No communication here.
"""

from __future__ import annotations

import torch


def feature_range(features: int, *, rank: int, parts: int) -> tuple[int, int]:
    """``(start, stop)`` of the features rank ``rank`` of ``parts`` holds."""
    if parts < 1 or not 0 <= rank < parts:
        raise ValueError(f"split_features: rank {rank} is not in 0..{parts - 1}")
    if features % parts:
        raise ValueError(
            f"split_features: {features} features do not split into {parts} equal slices; "
            f"use a number of ranks that divides {features}, or pad the features"
        )
    per = features // parts
    return rank * per, (rank + 1) * per


def split_features(x: torch.Tensor, *, rank: int, parts: int, dim: int = -1) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``x`` along the feature dimension ``dim``."""
    start, stop = feature_range(x.shape[dim], rank=rank, parts=parts)
    return x.narrow(dim, start, stop - start)
