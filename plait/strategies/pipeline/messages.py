"""The pipeline's point-to-point messages: tags, posting, bounded waits, shape metadata.

Every tensor between two stages is one message on the ``pp`` group under its own tag
(kind, stage, micro-batch), so messages of one step never match the wrong receive; a pair
of ranks still delivers its messages in posting order (see ``schedules.add_comms``). Each
message is its own :class:`~plait.comm.group.Call`, so ``plait.comm.group_stats()`` counts
its bytes under ``pp_activation``, ``pp_gradient``, ``pp_shape`` or ``pp_tied_grad``. A
wait is bounded by the group's timeout and raises :class:`PipelineError` naming the tensor
and the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plait.comm.errors import CollectiveError
from plait.comm.group import Call, Channel, Group
from plait.trace import Tracer

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
META = 10  # ndim, dtype code, up to 8 dims


class PipelineError(CollectiveError):
    """A pipeline stage failed, or a rank could not get a tensor from its neighbour."""


def tag(kind: int, stage: int, mb: int) -> int:
    """kind: 0 activation, 1 gradient, 2 shape, 3 tied gradient; below 2**30 (user tags)."""
    return (kind << 28) | ((stage & 0xFFF) << 16) | (mb & 0xFFFF)


@dataclass
class Message:
    """A posted send or receive: wait for it with :meth:`Link.wait`."""

    channel: Channel
    pending: Any
    tensor: torch.Tensor
    what: str


class Link:
    """Posts and waits for this rank's pipeline messages on ``group``."""

    def __init__(self, group: Group, tracer: Tracer | None) -> None:
        self.group = group
        self.tracer = tracer

    def channel(self, verb: str, message_tag: int) -> Channel:
        call = Call(self.group, verb, "p2p", seq=self.group.seq)
        call.tag = message_tag
        return Channel(call)

    def isend(self, t: torch.Tensor, peer: int, message_tag: int, verb: str, what: str) -> Message:
        """Start sending ``t`` to pp rank ``peer``; does not block."""
        t = t.detach().contiguous()
        ch = self.channel(verb, message_tag)
        return Message(ch, ch.isend(t, peer), t, what)

    def irecv(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        peer: int,
        message_tag: int,
        verb: str,
        what: str,
        device: torch.device | None = None,
    ) -> Message:
        """Post a receive into a new buffer (on ``device``, default the CPU) from pp rank
        ``peer``; does not block."""
        t = torch.empty(shape, dtype=dtype, device=device)
        ch = self.channel(verb, message_tag)
        return Message(ch, ch.irecv(t, peer), t, what)

    def wait(self, msg: Message) -> torch.Tensor:
        """Block until ``msg`` is done (at most the group's timeout); returns its tensor."""
        token = self.tracer.begin("wait", stream="comm", what=msg.what) if self.tracer else 0
        try:
            msg.channel.wait(msg.pending)
        except CollectiveError as exc:
            raise PipelineError(
                f"pipeline: rank {self.group.global_rank} (pp rank {self.group.rank}) could "
                f"not {msg.what}: {exc}"
            ) from exc
        finally:
            if self.tracer:
                self.tracer.end(token)
        msg.channel.call.commit()
        return msg.tensor

    def exchange_sum(self, t: torch.Tensor, peer: int, message_tag: int) -> torch.Tensor:
        """``t`` plus pp rank ``peer``'s ``t``, added in the same order on both ranks."""
        mine = t.detach().clone().contiguous()
        theirs = torch.empty_like(mine)
        ch = self.channel("pp_tied_grad", message_tag)
        r = ch.irecv(theirs, peer)
        w = ch.isend(mine, peer)
        try:
            ch.wait(r, w)
        except CollectiveError as exc:
            raise PipelineError(
                f"pipeline: pp rank {self.group.rank} could not exchange the tied gradient "
                f"with pp rank {peer}: {exc}"
            ) from exc
        ch.call.commit()
        return mine + theirs if self.group.rank < peer else theirs + mine


def encode_meta(y: torch.Tensor) -> torch.Tensor:
    meta = torch.zeros(META, dtype=torch.int64)
    meta[0], meta[1] = y.dim(), DTYPES.index(y.dtype)
    meta[2 : 2 + y.dim()] = torch.tensor(list(y.shape))
    return meta


def decode_meta(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return torch.Size(meta[2 : 2 + int(meta[0])].tolist()), DTYPES[int(meta[1])]
