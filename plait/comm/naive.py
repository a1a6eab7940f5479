"""Naive algorithms: everything goes through one rank (the parameter-server shape).

All-reduce: every rank sends its whole buffer to rank 0, which adds them in rank order and
sends the result back to each. Rank 0 receives (n-1) * S and sends (n-1) * S bytes, the
others send and receive S: simple, and a bottleneck that grows with n. It is kept as the
readable baseline the other algorithms are tested and measured against.
"""

from __future__ import annotations

import torch

from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp, combine_

ROOT = 0


def _gather_reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Every rank sends ``flat`` to ``root``, which folds them in, in rank order."""
    if ch.rank != root:
        ch.send(flat, root)
        return
    scratch = torch.empty_like(flat)
    for peer in range(ch.size):
        if peer != root:
            ch.recv(scratch, peer)
            combine_(flat, scratch, op)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    """The root sends the whole buffer to every other rank: (n-1) * S from the root."""
    if ch.rank == root:
        ch.wait(*[ch.isend(flat, peer) for peer in range(ch.size) if peer != root])
    else:
        ch.recv(flat, root)


def reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Every rank sends its buffer to ``root``; the root reduces in rank order."""
    _gather_reduce(ch, flat, root, op)


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """Reduce to rank 0, then rank 0 sends the result to every rank."""
    _gather_reduce(ch, flat, ROOT, op)
    broadcast(ch, flat, ROOT)


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    """Rank 0 collects every rank's whole input, reduces, and sends rank i its chunk i."""
    work = torch.cat(inputs)
    _gather_reduce(ch, work, ROOT, op)
    offsets = [0]
    for t in inputs:
        offsets.append(offsets[-1] + t.numel())
    if ch.rank == ROOT:
        chunks = [work[offsets[i] : offsets[i + 1]] for i in range(ch.size)]
        ch.wait(*[ch.isend(chunks[i], i) for i in range(ch.size) if i != ROOT])
        output.copy_(chunks[ROOT])
    else:
        ch.recv(output, ROOT)


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    """Every rank sends its chunk to rank 0, which sends everything back to every rank."""
    if ch.rank == ROOT:
        ch.wait(*[ch.irecv(chunks[i], i) for i in range(ch.size) if i != ROOT])
        ch.wait(
            *[
                ch.isend(c, peer)
                for peer in range(ch.size)
                if peer != ROOT
                for i, c in enumerate(chunks)
                if i != peer
            ]
        )
    else:
        ch.send(chunks[ch.rank], ROOT)
        ch.wait(*[ch.irecv(c, ROOT) for i, c in enumerate(chunks) if i != ch.rank])


def all_to_all(ch: Channel, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Every rank posts all its sends and receives at once and waits for them all."""
    r = ch.rank
    outputs[r].copy_(inputs[r])
    recvs = [ch.irecv(outputs[i], i) for i in range(ch.size) if i != r]
    sends = [ch.isend(inputs[i], i) for i in range(ch.size) if i != r]
    ch.wait(*recvs, *sends)
