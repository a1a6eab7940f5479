"""Rounds: how a plait algorithm's messages go out on a device backend (NCCL).

ProcessGroupNCCL runs a single send or receive between two ranks on one stream per pair,
in issue order, and a send holds that stream until its receive runs. plait's algorithms
(``ring.py``, ``tree.py``, ...) post receives before sends, which is right for gloo (its
pairs match by tag): started one message at a time on NCCL, two ranks that each post to
the other hang. So on a device backend the :class:`~plait.comm.group.Channel` holds each
message of an algorithm's call until the next wait, then starts a *round*: one
``torch.distributed.batch_isend_irecv``, whose operations NCCL progresses together.

Which messages a wait starts (:func:`choose`): every send still held (a send goes out no
later than the first wait after it, keeping the algorithm's order), the receives waited for
with those posted before them from the same peers (a pair's messages match in issue
order), then the oldest receives still held until the batch holds as many receives as
sends. NCCL completes a batch only when all of its operations have, and runs a rank's
batches in order: a receive posted ahead and started too early would hold the batch until
a send the peer makes only after its next wait; a send whose receive the peer holds back
would do the same. Balanced, round k of every rank holds the receives that match its
neighbours' round-k sends. ``tests/test_nccl_rounds.py`` runs every algorithm at 2, 3 and
4 ranks under a model of these rules (``tests/nccl_streams.py``).

Communication: the algorithm's own messages, unchanged in number and bytes; only when they
are handed to the backend changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.comm.group import _Pending


def choose(
    held: list[_Pending], waited: Sequence[_Pending | None]
) -> tuple[list[_Pending], list[_Pending]]:
    """(the messages to start now, in issue order; those still held) for a wait on
    ``waited`` (module docstring). Nothing starts when every waited message has started."""
    wanted = {id(p) for p in waited if p is not None and p.work is None}
    if not wanted:
        return [], held
    last: dict[int, int] = {}  # peer's group rank -> index of its last waited receive
    for i, p in enumerate(held):
        if id(p) in wanted and not p.sends:
            last[p.member] = i
    chosen = {id(p) for i, p in enumerate(held) if p.sends or i <= last.get(p.member, -1)}
    owed = sum(1 if p.sends else -1 for p in held if id(p) in chosen)
    for p in held:
        if owed <= 0:
            break
        if not p.sends and id(p) not in chosen:
            chosen.add(id(p))
            owed -= 1
    going = [p for p in held if id(p) in chosen]
    return going, [p for p in held if id(p) not in chosen]


class RoundWork:
    """The backend's work for one started round: waits for all of it."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self, timeout: Any = None) -> None:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def start_round(pg: Any, ops: Sequence[tuple[bool, torch.Tensor, int]], tag: int) -> list[Any]:
    """Start ``ops`` (sends or receives: ``(sends, tensor, group rank of the peer)``) as one
    ``torch.distributed.batch_isend_irecv`` on ``pg``: on NCCL one group of operations,
    which progress together. The backend's works, to wait for. On ``meta`` (PyTorch's fake
    backend, which moves nothing and has no batches) one by one."""
    import torch.distributed as dist  # deferred: only device backends start rounds

    if ops[0][1].device.type == "meta":
        return [
            pg.send([t], peer, tag) if sends else pg.recv([t], peer, tag) for sends, t, peer in ops
        ]
    batch = [
        dist.P2POp(dist.isend if sends else dist.irecv, t, group=pg, tag=tag, group_peer=peer)
        for sends, t, peer in ops
    ]
    return list(dist.batch_isend_irecv(batch))
