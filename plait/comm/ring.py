"""Ring algorithms: each rank talks only to its neighbours on a ring.

Rank r sends to r+1 and receives from r-1 (mod n). A buffer of S bytes is cut into n
chunks (sizes differ by at most one element).

Reduce-scatter, n-1 steps. At step s rank r sends the partial sum of chunk (r-s-1) to its
right and receives chunk (r-s-2) from its left, adding its own copy of that chunk. Each
chunk travels n-1 hops, collecting one contribution per hop, and ends complete on the rank
that owns it: rank r holds chunk r. Bytes sent per rank: (n-1)/n * S.

All-gather, n-1 steps. At step s rank r forwards chunk (r-s) to its right and receives chunk
(r-s-1) from its left. Bytes sent per rank: (n-1)/n * S.

All-reduce = reduce-scatter + all-gather: 2(n-1)/n * S per rank, the bandwidth optimum.
Each chunk is reduced once, by one rank, and then copied, so every rank ends with bitwise
the same result.

Broadcast is a chain from the root around the ring, pipelined in pieces of
``BROADCAST_PIECE_BYTES``: while rank r forwards piece i it already receives piece i+1.

::

    reduce-scatter, n = 3 (chunk index each rank sends)   all-gather
    step 0:  r0 -> c2   r1 -> c0   r2 -> c1               r0 -> c0   r1 -> c1   r2 -> c2
    step 1:  r0 -> c1   r1 -> c2   r2 -> c0               r0 -> c2   r1 -> c0   r2 -> c1
"""

from __future__ import annotations

import torch

from plait.comm.chunks import even_counts, split
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp, combine

BROADCAST_PIECE_BYTES = 1 << 20
SEGMENT_BYTES = 1 << 20


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    """``output = op over ranks of inputs[ch.rank]``; ``inputs`` (one chunk per rank) unchanged.

    All receives are posted before the first send: the transport puts a message on the
    wire only once its receiver has announced the matching receive, so announcing them all
    up front takes that round trip off every step. Chunks travel in segments of
    ``SEGMENT_BYTES``: while one segment is being added, the next is already arriving.
    Each step's partial results get buffers of their own, so sends are waited for once.
    """
    n, r = ch.size, ch.rank
    if n == 1:
        output.copy_(inputs[0])
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg = max(1, SEGMENT_BYTES // output.element_size())
    order = [(r - s - 2) % n for s in range(n - 1)]  # the chunk arriving at step s
    scratch = split(
        output.new_empty(sum(inputs[c].numel() for c in order)), [inputs[c].numel() for c in order]
    )
    arriving = [buf.split(seg) for buf in scratch]
    receives = [[ch.irecv(piece, left) for piece in pieces] for pieces in arriving]
    # step 0 sends this rank's own copy of chunk r-1
    sends = [ch.isend(piece, right) for piece in inputs[(r - 1) % n].split(seg)]
    for s, c in enumerate(order):
        last = s == n - 2  # the last step completes chunk r, into output
        targets = output.split(seg) if last else arriving[s]
        for piece, own, target, work in zip(
            arriving[s], inputs[c].split(seg), targets, receives[s], strict=True
        ):
            ch.wait(work)
            combine(piece, own, op, out=target)
            if not last:
                sends.append(ch.isend(target, right))
    ch.wait(*sends)


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    """Fill every ``chunks[i]`` with rank i's chunk; ``chunks[ch.rank]`` already holds ours.

    Every receive lands in its final place, so all are posted at once, and each segment
    is forwarded to the right as soon as it arrives.
    """
    n, r = ch.size, ch.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg = max(1, SEGMENT_BYTES // chunks[r].element_size())
    arriving = [chunks[(r - s - 1) % n].split(seg) for s in range(n - 1)]
    receives = [[ch.irecv(piece, left) for piece in pieces] for pieces in arriving]
    sends = [ch.isend(piece, right) for piece in chunks[r].split(seg)]
    for s in range(n - 2):  # what arrives at step s goes on at step s+1
        for piece, work in zip(arriving[s], receives[s], strict=True):
            ch.wait(work)
            sends.append(ch.isend(piece, right))
    ch.wait(*receives[-1], *sends)


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """In-place all-reduce of a 1-D contiguous tensor: reduce-scatter, then all-gather."""
    chunks = split(flat, even_counts(flat.numel(), ch.size))
    # chunk r is read only by the last step, elementwise, as it is written: no copy needed
    reduce_scatter(ch, chunks, chunks[ch.rank], op)
    all_gather(ch, chunks)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    """Chain broadcast from ``root`` along the ring, pipelined in pieces."""
    n, r = ch.size, ch.rank
    pos = (r - root) % n  # distance from the root along the ring
    right, left = (r + 1) % n, (r - 1) % n
    piece = max(1, BROADCAST_PIECE_BYTES // flat.element_size())
    pieces = torch.split(flat, piece)
    last_on_chain = pos == n - 1
    sends = []
    for p in pieces:
        if pos != 0:
            ch.recv(p, left)
        if not last_on_chain:
            sends.append(ch.isend(p, right))  # forward while the next piece arrives
    ch.wait(*sends)


def reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Reduce to ``root``: ring reduce-scatter, then every chunk is sent to the root.

    Bytes sent per rank: (n-1)/n * S for the reduce-scatter and S/n to the root.
    ``flat`` is left unchanged on the other ranks.
    """
    chunks = split(flat, even_counts(flat.numel(), ch.size))
    mine = flat.new_empty(chunks[ch.rank].numel())
    reduce_scatter(ch, chunks, mine, op)
    if ch.rank == root:
        ch.wait(*[ch.irecv(chunks[i], i) for i in range(ch.size) if i != root])
        chunks[root].copy_(mine)
    else:
        ch.send(mine, root)


def all_to_all(ch: Channel, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Pairwise exchange in n-1 shifted steps: at step s rank r sends ``inputs[r+s]`` to
    rank r+s and receives ``outputs[r-s]`` from rank r-s, so each step is a ring shift by s
    and no rank receives from two peers at once."""
    n, r = ch.size, ch.rank
    outputs[r].copy_(inputs[r])
    for s in range(1, n):
        ch.exchange(inputs[(r + s) % n], (r + s) % n, outputs[(r - s) % n], (r - s) % n)
