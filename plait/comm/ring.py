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


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    """``output = op over ranks of inputs[ch.rank]``; ``inputs`` (one chunk per rank) unchanged."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    largest = max(t.numel() for t in inputs)
    # two receive buffers: one is being sent on while the other fills
    spare = [inputs[0].new_empty(largest), inputs[0].new_empty(largest)]
    outgoing = inputs[(r - 1) % n]  # step 0 sends this rank's own copy of chunk r-1
    for s in range(n - 1):
        c = (r - s - 2) % n
        incoming = spare[s % 2][: inputs[c].numel()]
        ch.exchange(outgoing, right, incoming, left)
        target = output if s == n - 2 else incoming  # last step: chunk r, complete
        combine(incoming, inputs[c], op, out=target)
        outgoing = incoming


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    """Fill every ``chunks[i]`` with rank i's chunk; ``chunks[ch.rank]`` already holds ours."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        ch.exchange(chunks[(r - s) % n], right, chunks[(r - s - 1) % n], left)


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
