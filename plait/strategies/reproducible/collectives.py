"""Reductions whose per-element addition order is the fixed tree over rank index.

Ring, tree, halving-doubling and the backend's reductions each add the ranks'
contributions in their own order, so the bits of a sum depend on the algorithm and the
world size. Here the addition is done locally, in one order, and only exact operations
cross the wire:

- :func:`tree_reduce_scatter`: an all-to-all hands rank ``r`` every rank's piece of block
  ``r`` (``(W-1)/W`` of the tensor sent per rank), then rank ``r`` adds them with
  :func:`~.tree.tree_sum` in rank order;
- :func:`tree_all_reduce`: the same on ``W`` equal chunks, then an all-gather of the summed
  chunks (another ``(W-1)/W``): ``2(W-1)/W`` of the tensor per rank in all, exactly the
  bytes of a ring all-reduce.

Communication contract: one collective on ``group`` per call, counted in the group's
statistics as ``all_reduce`` / ``reduce_scatter`` with algorithm ``tree_order/<route>``.
Both sum (no average: reproducible mode scales each micro-batch loss by ``1/M`` instead).
``algorithm`` picks how the exact phases travel: the all-to-all by ``algorithm`` where it
implements one (``ring``, ``naive``, ``native``), else ``ring``; the all-gather by
``algorithm`` where it implements one (``ring``, ``halving_doubling``, ``naive``, ``shm``,
``native``), else ``ring`` (so ``tree``, ``hierarchical`` and ``ring_tree``, which have
neither, move the bytes by ring; ``auto``: ``shm`` for the all-gather when every rank
shares this host, else ``ring``). The transport (shared memory or gloo) is the group's. Neither
changes a bit of the result. Both block on every rank of ``group`` (its timeout), or
return a :class:`~plait.comm.Handle` with ``async_op=True`` (one collective on the group's
communication thread, numbered and checked as any other).
"""

from __future__ import annotations

import torch

from plait.comm.chunks import split
from plait.comm.group import COMPLETED, Channel, Group, Handle
from plait.comm.ops import ALGORITHMS, SUPPORTED, shared
from plait.strategies.reproducible.tree import tree_sum


def _phase(collective: str, algorithm: str, group: Group) -> str:
    if algorithm == "auto":  # shared memory where every rank is on this host
        algorithm = "shm" if shared(group) else "ring"
    if algorithm == "shm" and not shared(group):
        algorithm = "ring"
    return algorithm if algorithm in SUPPORTED[collective] else "ring"


def _tree_reduce_scatter_on(
    ch: Channel, algorithm: str, blocks: list[torch.Tensor], out: torch.Tensor
) -> None:
    """``out = tree_sum over ranks of their blocks[ch.rank]`` (runs on the channel)."""
    n = ch.size
    mine = blocks[ch.rank].numel()
    received = [torch.empty(mine, dtype=out.dtype, device=out.device) for _ in range(n)]
    if any(b.numel() for b in blocks):
        ALGORITHMS[_phase("all_to_all", algorithm, ch.group)].all_to_all(ch, received, blocks)
    out.copy_(tree_sum(received) if n > 1 else received[0])


def tree_reduce_scatter(
    out: torch.Tensor,
    blocks: list[torch.Tensor],
    *,
    group: Group,
    algorithm: str = "ring",
    async_op: bool = False,
) -> Handle | None:
    """``out`` (flat, contiguous) becomes the sum over ranks of their ``blocks[rank]``,
    added along the balanced tree over rank index. ``blocks``: one flat contiguous tensor
    per rank (sizes may differ; ``blocks[group.rank]`` matches ``out``)."""
    ins = [b.detach().reshape(-1).contiguous() for b in blocks]
    if group.size == 1:
        out.copy_(ins[0])
        return COMPLETED if async_op else None
    nbytes = sum(b.numel() for b in ins) * out.element_size()

    def body(ch: Channel) -> None:
        _tree_reduce_scatter_on(ch, algorithm, ins, out)

    sizes = [b.numel() for b in ins]
    return group.run(
        "reduce_scatter",
        f"tree_order/{_phase('all_to_all', algorithm, group)}",
        body,
        async_op=async_op,
        payload_bytes=nbytes,
        signature=f"{str(out.dtype)[6:]} blocks={sizes}",
        desc=f"tree-ordered sum of {sizes[group.rank]} elements",
    )


def tree_all_reduce(
    flat: torch.Tensor,
    *,
    group: Group,
    algorithm: str = "ring",
    async_op: bool = False,
) -> Handle | None:
    """``flat`` (1-D, contiguous) becomes, in place, the sum over ranks added along the
    balanced tree over rank index: bitwise the same on every rank, for every algorithm,
    transport and (power-of-two) world size that splits the same micro-batch tree."""
    if group.size == 1 or flat.numel() == 0:
        return COMPLETED if async_op else None
    n = group.size
    base, extra = divmod(flat.numel(), n)
    counts = [base + (i < extra) for i in range(n)]
    nbytes = flat.numel() * flat.element_size()

    def body(ch: Channel) -> None:
        chunks = split(flat, counts)
        summed = torch.empty_like(chunks[ch.rank])
        _tree_reduce_scatter_on(ch, algorithm, chunks, summed)
        chunks[ch.rank].copy_(summed)
        ALGORITHMS[_phase("all_gather", algorithm, group)].all_gather(ch, chunks)

    route = f"{_phase('all_to_all', algorithm, group)}+{_phase('all_gather', algorithm, group)}"
    return group.run(
        "all_reduce",
        f"tree_order/{route}",
        body,
        async_op=async_op,
        payload_bytes=nbytes,
        signature=f"sum {str(flat.dtype)[6:]} bytes={nbytes}",
        desc=f"shape={tuple(flat.shape)}",
    )
