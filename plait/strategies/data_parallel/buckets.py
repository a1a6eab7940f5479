"""Gradient buckets: parameters grouped into flat buffers that are all-reduced as one.

A bucket holds parameters of one dtype and device, about ``bucket_bytes`` in all, in the
order their gradients are expected to become ready. Each parameter owns a slice of the
bucket's flat buffer; its gradient is copied there (or lives there, with
``gradient_as_bucket_view``), so one all-reduce averages the whole bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    offsets: list[int]
    pending: int = 0
    ready: list[bool] = field(default_factory=list)

    def slot(self, i: int) -> torch.Tensor:
        """The slice of the buffer that holds parameter i's gradient, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


FIRST_BUCKET_BYTES = 1 << 20


def build_buckets(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    bucket_bytes: int,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """Group parameters, in the given order, into buckets of about ``bucket_bytes``.

    A bucket is closed once it holds at least its limit (so a layer's small bias stays
    with its weight instead of travelling alone), or when the dtype or device changes. The
    first bucket's limit is ``min(first_bucket_bytes, bucket_bytes)``: the gradients that
    are ready first start travelling early, as in PyTorch's DDP.
    """
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    size = 0
    for name, p in named_params:
        limit = min(first_bucket_bytes, bucket_bytes) if len(groups) <= 1 else bucket_bytes
        if (
            not groups
            or size >= limit
            or groups[-1][0][1].dtype != p.dtype
            or groups[-1][0][1].device != p.device
        ):
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += p.numel() * p.element_size()
    buckets = []
    for index, members in enumerate(groups):
        offsets, total = [], 0
        for _, p in members:
            offsets.append(total)
            total += p.numel()
        first = members[0][1]
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        bucket = Bucket(index, [p for _, p in members], [n for n, _ in members], buffer, offsets)
        bucket.reset()
        buckets.append(bucket)
    return buckets
