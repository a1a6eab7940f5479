"""Tree algorithms: binomial trees for reduce and broadcast, a double binary tree for all-reduce.

Binomial tree rooted at ``root``, ranks renumbered ``v = (r - root) mod n``. In round k
(mask = 2^k) the ranks whose bit k is set send to ``v - 2^k`` and drop out; the others
receive from ``v + 2^k``. Reduce climbs the rounds, broadcast walks them down. log2(n)
rounds; the root sends (broadcast) or receives (reduce) the whole buffer log2(n) times,
which is why trees win on latency (small messages) and rings on bandwidth.

::

    binomial broadcast, n = 8, root 0
    round 0: 0 -> 4
    round 1: 0 -> 2, 4 -> 6
    round 2: 0 -> 1, 2 -> 3, 4 -> 5, 6 -> 7

Double binary tree all-reduce (the shape NCCL uses). Two binary trees over the same ranks,
built so that a rank that is an inner node of one is a leaf of the other: the first is the
in-order tree (leaves are the even ranks), the second its mirror ``r -> n-1-r`` (for even
n) or its shift ``r -> r+1`` (odd n, where one rank is inner in both). Half of the buffer is
reduced up the first tree and broadcast down it, the other half uses the second tree, both
at the same time, so every rank's links carry about the same load.
"""

from __future__ import annotations

import torch

from plait.comm.chunks import even_counts, split
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp, combine_


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast of ``flat`` from ``root``."""
    n = ch.size
    v = (ch.rank - root) % n
    mask = 1
    while mask < n:
        if v & mask:
            ch.recv(flat, (v - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if v + mask < n:
            sends.append(ch.isend(flat, (v + mask + root) % n))
        mask >>= 1
    ch.wait(*sends)


def reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Binomial-tree reduce to ``root`` (in place there; unchanged on other ranks)."""
    n = ch.size
    v = (ch.rank - root) % n
    acc = flat
    scratch = None
    mask = 1
    while mask < n:
        if v & mask:
            ch.send(acc, (v - mask + root) % n)
            return
        child = v + mask
        if child < n:
            if scratch is None:
                scratch = torch.empty_like(flat)
                if v != 0:
                    acc = flat.clone()  # inner nodes must not change the caller's tensor
            ch.recv(scratch, (child + root) % n)
            combine_(acc, scratch, op)
        mask <<= 1


def in_order_tree(n: int) -> tuple[list[int], list[list[int]]]:
    """Parent (-1 for the root) and children of each rank in the in-order binary tree.

    Node ``v = rank + 1``; its level is its lowest set bit b, and its parent is ``v - b``
    or ``v + b``, whichever has lowest set bit 2b, climbing further while that exceeds n.
    The root is the largest power of two <= n. Leaves are the odd v (even ranks).
    """
    top = 1
    while top * 2 <= n:
        top *= 2

    def up(v: int) -> int:
        b = v & -v
        return v - b if (v // (2 * b)) % 2 == 1 else v + b

    parent = [-1] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for v in range(1, n + 1):
        if v == top:
            continue
        p = up(v)
        while p > n:
            p = up(p)
        parent[v - 1] = p - 1
        children[p - 1].append(v - 1)
    return parent, children


def double_tree(n: int) -> list[tuple[list[int], list[list[int]]]]:
    """The two trees of the double binary tree, as (parent, children) lists by rank."""
    parent, children = in_order_tree(n)
    if n % 2 == 0:
        to_t1 = [n - 1 - r for r in range(n)]  # mirror: swaps inner nodes and leaves
    else:
        to_t1 = [(r + 1) % n for r in range(n)]
    from_t1 = [0] * n
    for r, x in enumerate(to_t1):
        from_t1[x] = r
    parent2 = [-1 if parent[to_t1[r]] < 0 else from_t1[parent[to_t1[r]]] for r in range(n)]
    children2 = [[from_t1[c] for c in children[to_t1[r]]] for r in range(n)]
    return [(parent, children), (parent2, children2)]


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """Double binary tree all-reduce: half the buffer per tree, both trees at once.

    Each tree: reduce up to its root (inner nodes add their children's partial results),
    then broadcast the root's result down. The two trees' phases are interleaved so that
    no wait depends on a later phase of the other tree (no deadlock).
    """
    halves = split(flat, even_counts(flat.numel(), 2))
    trees = double_tree(ch.size)
    me = ch.rank
    # up: receive children's partial results, add, send to parent
    incoming = [
        [(torch.empty_like(h), c) for c in kids[me]]
        for h, (_, kids) in zip(halves, trees, strict=True)
    ]
    posted = [[ch.irecv(buf, c) for buf, c in bufs] for bufs in incoming]
    sends = []
    for h, (parent, _), bufs, works in zip(halves, trees, incoming, posted, strict=True):
        for (buf, _), w in zip(bufs, works, strict=True):
            ch.wait(w)
            combine_(h, buf, op)
        if parent[me] >= 0:
            sends.append(ch.isend(h, parent[me]))
    ch.wait(*sends)
    # down: the root's result travels back to the leaves
    posted_down = [
        ch.irecv(h, parent[me]) if parent[me] >= 0 else None
        for h, (parent, _) in zip(halves, trees, strict=True)
    ]
    sends = []
    for h, (_, kids), w in zip(halves, trees, posted_down, strict=True):
        ch.wait(w)
        sends.extend(ch.isend(h, c) for c in kids[me])
    ch.wait(*sends)
