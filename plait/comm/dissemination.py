"""Dissemination barrier: ceil(log2 n) rounds; in round k rank r signals r + 2^k and waits
for r - 2^k. After the last round every rank has heard, directly or through others, from
every rank, so none leaves before all have arrived."""

from __future__ import annotations

import torch

from plait.comm.group import Channel


def barrier(ch: Channel) -> None:
    n, r = ch.size, ch.rank
    where = ch.group.device  # NCCL moves CUDA tensors only
    token = torch.zeros(1, dtype=torch.uint8, device=where)
    heard = torch.empty(1, dtype=torch.uint8, device=where)
    step = 1
    while step < n:
        ch.exchange(token, (r + step) % n, heard, (r - step) % n)
        step *= 2
