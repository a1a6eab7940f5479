"""One ring step on the cp group: send a tensor to the next rank and receive the previous
rank's, both posted at once so the caller can compute while they travel.

Each shift is one :class:`~plait.comm.group.Call` on the group, so
``plait.comm.group_stats()`` counts its bytes under ``(group, name, "p2p")``: ring attention
uses ``"cp_kv"`` (keys and values in forward and again in backward) and ``"cp_dkv"`` (their
gradients travelling back to their owner). The receives and sends of a shift are
posted together (:meth:`~plait.comm.channel.Channel.post_together`: one ``batch_isend_irecv`` on a
device backend, where NCCL's stream per rank pair would otherwise hang a 2-rank ring).
Messages of one kind between two ranks are
matched in posting order under one tag per kind; the kinds' tags differ, so a forward and a
backward shift never match each other. A wait is bounded by the group's timeout and raises
:class:`RingError` naming this rank, the peer and what it was moving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.comm.errors import CollectiveError
from plait.comm.group import Call, Channel, Group, _Pending

# user p2p tags are below 2**30; the cp group carries only these (one per kind)
TAGS = {"cp_kv": (1 << 29) | 1, "cp_dkv": (1 << 29) | 2, "cp_kv_bwd": (1 << 29) | 3}


class RingError(CollectiveError):
    """A context-parallel rank could not move a block around the cp ring."""


@dataclass
class Shift:
    """A posted ring step: wait for it with :meth:`wait`, which returns the received blocks."""

    channel: Channel
    pending: list[_Pending | None]
    sent: list[torch.Tensor]
    received: list[torch.Tensor]
    what: str

    def wait(self) -> list[torch.Tensor]:
        """Block until every message is done (at most the group's timeout)."""
        g = self.channel.group
        try:
            self.channel.wait(*self.pending)
        except CollectiveError as exc:
            raise RingError(
                f"context parallelism: rank {g.global_rank} (cp rank {g.rank} of {g.size}, "
                f"group {g.name!r}) could not {self.what}: {exc}"
            ) from exc
        self.channel.call.commit()
        # the sent blocks are free once sent; keeping them here would hold a third K/V
        # block (or dK/dV sum) alive while the caller posts the next step
        received, self.sent, self.received, self.pending = self.received, [], [], []
        return received


def shift(tensors: list[torch.Tensor], group: Group, *, kind: str, what: str) -> Shift:
    """Post: send each of ``tensors`` to cp rank ``rank + 1`` and receive the same shapes
    from ``rank - 1`` (mod the group size) into new buffers. Does not block.

    ``kind`` names the message for the byte counters (``"cp_kv"``, ``"cp_kv_bwd"``,
    ``"cp_dkv"``); the stats entry is ``(group.name, kind, "p2p")``.
    """
    call = Call(group, kind, "p2p", seq=group.seq)
    call.tag = TAGS[kind]
    ch = Channel(call)
    sent = [t.detach().contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    # one round on a device backend: on NCCL a 2-rank ring's receive and send share a stream
    pending = ch.post_together([(t, prev) for t in received], [(t, nxt) for t in sent])
    return Shift(ch, pending, sent, received, f"{what} (to cp rank {nxt}, from cp rank {prev})")
