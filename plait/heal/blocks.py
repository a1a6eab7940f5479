"""Which live slot computes which block of the summation tree, and the exchange that
adds the blocks in the tree's order whatever their owners.

The global batch is ``M`` micro-batches cut into ``world`` blocks of ``M / world`` (the
job's full size, a power of two dividing ``M``): block ``v`` is micro-batches
``v*M/world ... (v+1)*M/world - 1``, one whole subtree of the fixed tree
(:mod:`plait.strategies.reproducible.tree`). While every slot lives, slot ``v`` computes
block ``v``: the layout of reproducible DDP at ``W = world``. When slots are missing their
blocks go to the survivors (:func:`assign`), so a survivor may sum more than one subtree;
the tree's top ``log2(world)`` levels are still added over block index, never over live
ranks, so the result has the bits of the full world and of one process.

Communication contract of :func:`block_tree_all_reduce` (one collective on the generation's
group, counted as ``all_reduce`` / ``tree_order/blocks``): with ``n`` members, the flat
vector is cut into ``n`` chunks; member ``i`` sends member ``j`` its blocks' pieces of chunk
``j`` (point-to-point), member ``j`` adds the ``world`` pieces of its chunk with ``tree_sum``
in block order (one message per block's piece), then the summed chunks are all-gathered
(plait's shared-memory all-gather where every member is on this host, else the ring's).
Per member: ``k (n-1)/n`` of the vector out in the first phase (``k``: blocks it holds)
and ``(n-1)/n`` in the second; with one block each (``k = 1``) that is ``2(n-1)/n``, the
bytes of a ring all-reduce. Blocks on every member of the group until done (the group's
timeout and watchdog), or runs on the group's communication thread
(:func:`start_block_exchange` with ``async_op=True``; the trainer starts one per bucket
during the last backward, :mod:`.buckets`). The messages take the group's transport:
shared memory between members on one host (:func:`.groups.build`), gloo otherwise.
"""

from __future__ import annotations

import torch

from plait.comm.group import COMPLETED, Channel, Group, Handle
from plait.comm.ops import ALGORITHMS, shared
from plait.strategies.reproducible.tree import tree_sum


def assign(members: tuple[int, ...], world: int) -> dict[int, list[int]]:
    """Blocks per member: each live slot keeps its own block; the missing slots' blocks go
    to the members in turn, those with fewest blocks first (ties: lowest slot)."""
    if not members:
        raise ValueError("healing: no live member left to compute the blocks")
    owned = {s: [s] for s in members}
    for v in range(world):
        if v not in owned:
            least = min(members, key=lambda s: (len(owned[s]), s))
            owned[least].append(v)
    return owned


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    base, extra = divmod(flat.numel(), n)
    return list(flat.split([base + (i < extra) for i in range(n)]))


def block_tree_all_reduce(
    partials: dict[int, torch.Tensor], *, owned: dict[int, list[int]], world: int, group: Group
) -> torch.Tensor:
    """The sum of every block's partial (``partials``: this member's blocks, flat vectors
    of one length and dtype), added along the balanced tree over block index; the same
    bits on every member. ``owned``: :func:`assign` of the group's members."""
    result = torch.empty_like(partials[min(partials)])
    start_block_exchange(partials, result, owned=owned, world=world, group=group, async_op=False)
    return result


def start_block_exchange(
    partials: dict[int, torch.Tensor],
    out: torch.Tensor,
    *,
    owned: dict[int, list[int]],
    world: int,
    group: Group,
    async_op: bool,
    label: str = "",
) -> Handle | None:
    """:func:`block_tree_all_reduce` of ``partials`` into ``out`` (contiguous, their length
    and dtype); with ``async_op=True`` it runs on the group's communication thread and the
    :class:`~plait.comm.group.Handle` is returned (its ``wait()`` raises the exchange's
    :class:`~plait.comm.errors.CollectiveError`). Every element is added in the same order
    whatever vector it travels in, so exchanging a vector in pieces (one call per bucket,
    :mod:`.buckets`) gives the bits of one call on the whole. ``label``: named in the
    collective's description (which bucket)."""
    mine = sorted(partials)
    sample = partials[mine[0]]
    if group.size == 1:
        out.copy_(tree_sum([partials[v] for v in range(world)]))
        return COMPLETED if async_op else None
    members = group.ranks  # slots, in group-rank order

    # the second phase is an all-gather: shared memory's (one write, every member reads)
    # where all members share this host, else the ring
    gather = ALGORITHMS["shm" if shared(group) else "ring"].all_gather

    def body(ch: Channel) -> None:
        n, me = ch.size, ch.rank
        pieces = {v: _chunks(partials[v], n) for v in mine}
        got: dict[int, torch.Tensor] = {v: pieces[v][me] for v in mine}
        pending = []
        for p in range(n):  # one message per block's piece: no copy to join them
            if p == me:
                continue
            for v in sorted(owned[members[p]]):
                got[v] = torch.empty_like(pieces[mine[0]][me])
                pending.append(ch.irecv(got[v], p))
            pending += [ch.isend(pieces[v][p], p) for v in mine]
        ch.wait(*pending)
        out_chunks = _chunks(out, n)
        out_chunks[me].copy_(tree_sum([got[v] for v in range(world)]))
        gather(ch, out_chunks)  # shared memory's windows where every member is local

    nbytes = sample.numel() * sample.element_size()
    return group.run(
        "all_reduce",
        "tree_order/blocks",
        body,
        async_op=async_op,
        payload_bytes=nbytes,
        signature=f"blocks {str(sample.dtype)[6:]} bytes={nbytes}",
        desc=f"blocks {mine} of {world}{f' {label}' if label else ''}",
    )
