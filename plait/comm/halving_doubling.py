"""Recursive halving and doubling (Rabenseifner's all-reduce).

For n a power of two, reduce-scatter by recursive halving: in round k rank r pairs with
``r xor d`` (d = n/2, n/4, ..., 1), keeps one half of the range it still holds, sends the
other half to its partner, and adds the partner's copy of the kept half. After log2(n)
rounds rank r holds the complete chunk r. All-gather by recursive doubling retraces the
rounds backwards (d = 1, 2, ..., n/2), swapping ever larger ranges. Bytes sent per rank:
S/2 + S/4 + ... = (n-1)/n * S for each half, 2(n-1)/n * S for the all-reduce, in only
2 log2(n) messages (the ring needs 2(n-1)).

When n is not a power of two (the standard fix): let p be the largest power of two below
n and q = n - p. Ranks 0 .. 2q-1 pair up; the even rank of each pair first hands its data
to the odd one and sits out, so p ranks run the power-of-two algorithm; at the end the odd
rank hands the result back. ::

    n = 6 (p = 4, q = 2):  0 -> 1, 2 -> 3 fold in;  ranks 1, 3, 4, 5 halve and double;
                           1 -> 0, 3 -> 2 fold out
"""

from __future__ import annotations

import torch

from plait.comm.chunks import even_counts, split
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp, combine, combine_


def _fold(n: int) -> tuple[int, int]:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p, n - p


def _virtual(rank: int, q: int) -> int | None:
    """The rank among the p participants, or None for a rank that sits out."""
    if rank < 2 * q:
        return rank // 2 if rank % 2 else None
    return rank - q


def _real(v: int, q: int) -> int:
    return 2 * v + 1 if v < q else v + q


def _halving(ch: Channel, pieces: list[torch.Tensor], v: int, p: int, q: int, op: ReduceOp) -> None:
    """Recursive halving among the p participants: ``pieces[v]`` ends complete on v."""
    lo, hi = 0, p
    d = p // 2
    scratch = pieces[0].new_empty(sum(t.numel() for t in pieces))
    while d >= 1:
        partner = v ^ d
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
        kept = _span(pieces, *keep)
        given = _span(pieces, *give)
        incoming = scratch[: kept.numel()]
        ch.exchange(given, _real(partner, q), incoming, _real(partner, q))
        combine_(kept, incoming, op)
        lo, hi = keep
        d //= 2


def _doubling(ch: Channel, pieces: list[torch.Tensor], v: int, p: int, q: int) -> None:
    """Recursive doubling among the p participants: every participant ends with all pieces."""
    lo, hi = v, v + 1
    d = 1
    while d < p:
        partner = v ^ d
        plo, phi = (lo + d, hi + d) if v < partner else (lo - d, hi - d)
        ch.exchange(
            _span(pieces, lo, hi), _real(partner, q), _span(pieces, plo, phi), _real(partner, q)
        )
        lo, hi = min(lo, plo), max(hi, phi)
        d *= 2


def _span(pieces: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Pieces lo..hi-1 as one tensor; they are adjacent views of one flat buffer."""
    first, last = pieces[lo], pieces[hi - 1]
    start = first.storage_offset()
    length = last.storage_offset() + last.numel() - start
    return first.as_strided((length,), (1,), start)


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """In-place all-reduce: fold in, halve, double, fold out."""
    n, r = ch.size, ch.rank
    p, q = _fold(n)
    v = _virtual(r, q)
    if r < 2 * q:  # fold in: the even rank of each pair gives its data to the odd one
        if v is None:
            ch.send(flat, r + 1)
        else:
            incoming = torch.empty_like(flat)
            ch.recv(incoming, r - 1)
            # even + odd, the order the fold-out partner would use
            combine(incoming, flat, op, out=flat)
    if v is not None:
        pieces = split(flat, even_counts(flat.numel(), p))
        _halving(ch, pieces, v, p, q, op)
        _doubling(ch, pieces, v, p, q)
    if r < 2 * q:  # fold out
        if v is None:
            ch.recv(flat, r + 1)
        else:
            ch.send(flat, r - 1)


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    """Reduce-scatter of ``inputs`` (one chunk per rank, adjacent views of one buffer).

    The n chunks are grouped into p pieces, one per participant: the two chunks of a
    folded pair form one piece. After halving, the odd rank of a pair sends the even rank
    its chunk. ``inputs`` are left unchanged.
    """
    n, r = ch.size, ch.rank
    p, q = _fold(n)
    v = _virtual(r, q)
    work = torch.cat(inputs) if inputs else output.new_empty(0)
    chunks = split(work, [t.numel() for t in inputs])
    pieces = [_span(chunks, 2 * i, 2 * i + 2) if i < q else chunks[i + q] for i in range(p)]
    if r < 2 * q:
        if v is None:
            ch.send(work, r + 1)
        else:
            incoming = torch.empty_like(work)
            ch.recv(incoming, r - 1)
            combine(incoming, work, op, out=work)
    if v is not None:
        _halving(ch, pieces, v, p, q, op)
    if r < 2 * q:
        if v is None:
            ch.recv(output, r + 1)
            return
        ch.send(chunks[r - 1], r - 1)
    output.copy_(chunks[r])


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    """All-gather into ``chunks`` (adjacent views of one buffer; ``chunks[rank]`` is ours)."""
    n, r = ch.size, ch.rank
    p, q = _fold(n)
    v = _virtual(r, q)
    pieces = [_span(chunks, 2 * i, 2 * i + 2) if i < q else chunks[i + q] for i in range(p)]
    whole = _span(chunks, 0, n)
    if r < 2 * q:  # the even rank gives its chunk to its partner, and sits out
        if v is None:
            ch.send(chunks[r], r + 1)
            ch.recv(whole, r + 1)
            return
        ch.recv(chunks[r - 1], r - 1)
    _doubling(ch, pieces, v, p, q)  # type: ignore[arg-type]
    if r < 2 * q:
        ch.send(whole, r - 1)
