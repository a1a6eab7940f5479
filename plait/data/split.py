"""Batch partitioning: cut one global batch into per-rank row blocks, with loss weights.

Every rank calls :func:`split_batch` on the same global batch of ``B`` rows and keeps its
own contiguous block; nothing is communicated. With ``W`` ranks, ``B = q * W + m``: ranks
``0 .. m-1`` get ``q + 1`` rows, the others ``q``::

    B = 10, W = 4    rank 0: rows 0-2   rank 1: rows 3-5   rank 2: rows 6-7   rank 3: rows 8-9
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

import torch

from plait.comm.group import Group
from plait.data.sampler import resolve_replicas


class BatchShard(NamedTuple):
    """This rank's rows of a batch (``data``) and the weight of its mean loss."""

    data: Any
    weight: float


def row_range(batch_rows: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s rows: contiguous, the first ``B % W`` ranks one more."""
    q, m = divmod(batch_rows, num_replicas)
    start = rank * q + min(rank, m)
    return start, start + q + (rank < m)


def _rows(batch: Any, path: str, found: dict[str, int]) -> None:
    """Record the first dimension of every tensor leaf, refusing mismatches and scalars."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError(
                f"split_batch: {path} is a 0-dim tensor with no batch dimension; give it a "
                f"first dimension of B rows, or pass it as a Python number (left unsplit)"
            )
        if found and batch.shape[0] != next(iter(found.values())):
            first, rows = next(iter(found.items()))
            raise ValueError(
                f"split_batch: {path} has {batch.shape[0]} rows (first dimension) but {first} "
                f"has {rows}; every tensor of a batch must share its first dimension"
            )
        found.setdefault(path, batch.shape[0])
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            _rows(value, f"{path}[{key!r}]", found)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            _rows(value, f"{path}[{i}]", found)


def _take(batch: Any, start: int, stop: int) -> Any:
    """The same structure with every tensor cut to rows ``[start, stop)``."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        out: Any = copy.copy(batch) if isinstance(batch, MutableMapping) else {}
        for key, value in batch.items():
            out[key] = _take(value, start, stop)
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple
        return type(batch)(*(_take(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop) for v in batch)
    return batch  # not a tensor: the same on every rank, passed through


def split_batch(
    batch: Any,
    *,
    group: Group | None = None,
    num_replicas: int | None = None,
    rank: int | None = None,
) -> BatchShard:
    """This rank's contiguous block of rows of ``batch``, and the weight of its loss.

    ``batch`` is a tensor or a nested tuple/list/dict of tensors that share their first
    (batch) dimension ``B``; the result has the same structure, every tensor cut to this
    rank's rows (views, no copies). Leaves that are not tensors (ints, strings, None) are
    passed through unchanged. ``group`` (default: the world) gives ``W`` and this rank ``r``;
    ``num_replicas`` and ``rank`` (both) replace it. Communicates nothing.

    ``weight = n_r * W / B``, with ``n_r`` this rank's rows, makes data-parallel gradients
    exact when shards differ in size. Let ``g_i`` be the gradient of sample ``i``'s loss. A
    rank's mean loss has gradient ``(1/n_r) sum_{i in r} g_i``; weighted, ``(1/B) W
    sum_{i in r} g_i``; averaged over the ``W`` ranks (what DDP's all-reduce does)::

        (1/W) sum_r weight_r * (1/n_r) sum_{i in r} g_i = (1/B) sum_i g_i

    the gradient of the mean loss over the whole batch. So back-propagate
    ``shard_loss * shard.weight``. A rank with no rows (``B < W``) gets empty tensors and
    weight 0: its mean loss is NaN (a mean of nothing) but the gradient of
    ``loss * 0`` is zero, so it still joins the all-reduce harmlessly.
    """
    w, r = resolve_replicas("split_batch", group, num_replicas, rank)
    found: dict[str, int] = {}
    _rows(batch, "batch", found)
    if not found:
        raise ValueError(
            f"split_batch: batch ({type(batch).__name__}) holds no tensor to split; pass a "
            f"tensor or a tuple/list/dict of tensors"
        )
    batch_rows = next(iter(found.values()))
    start, stop = row_range(batch_rows, w, r)
    weight = (stop - start) * w / batch_rows if stop > start else 0.0
    return BatchShard(_take(batch, start, stop), weight)
