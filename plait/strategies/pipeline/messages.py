"""The pipeline's point-to-point messages: tags, posting, bounded waits, shape metadata.

Every tensor between two stages is one message on the ``pp`` group under its own tag
(kind, stage, micro-batch), so messages of one step never match the wrong receive; a pair
of ranks still delivers its messages in posting order (see ``schedules.add_comms``). Each
message is its own :class:`~plait.comm.group.Call`, so ``plait.comm.group_stats()`` counts
its bytes under ``pp_activation``, ``pp_gradient``, ``pp_shape`` or ``pp_tied_grad``. A
wait is bounded by the group's timeout and raises :class:`PipelineError` naming the tensor
and the peer.

On a device backend (NCCL) each direction of a pair travels on its own process group:
messages from a lower to a higher pp rank on the ``pp`` group, the others on its twin
(:func:`plait.runtime.reverse_group`, made when the :class:`Link` is). ProcessGroupNCCL
runs a pair's sends and receives on one stream per process group in issue order, so with
both directions on one group the receives the runtime posts early would block the sends
their peer waits for (a deadlock on every schedule, ``tests/test_meta_device_p2p.py``);
one stream per direction completes every schedule (:func:`direction`). gloo and the
shared-memory transport match by tag and move each direction independently: one group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plait import runtime
from plait.comm import tuner
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


def direction(sender: int, receiver: int, *, per_direction: bool) -> int:
    """Which process group a message from pp rank ``sender`` to pp rank ``receiver``
    takes: 0, the ``pp`` group; 1, its reverse twin (device backends, from a higher to a
    lower rank). The simulation in ``tests/meta_device_p2p.py`` keys NCCL's streams by it."""
    return 1 if per_direction and sender > receiver else 0


class Link:
    """Posts and waits for this rank's pipeline messages on ``group`` (and, on a device
    backend, on its reverse twin: the module docstring). Making one on a device backend is
    collective over the group's ranks the first time (the twin's process group)."""

    def __init__(self, group: Group, tracer: Tracer | None) -> None:
        self.group = group
        self.tracer = tracer
        self.per_direction = tuner.is_device_backend(group.backend) and group.size > 1
        self.groups = (group, runtime.reverse_group(group) if self.per_direction else group)

    def channel(
        self, verb: str, message_tag: int, sender: int | None = None, receiver: int | None = None
    ) -> Channel:
        g = self.group
        if sender is not None and receiver is not None:
            g = self.groups[direction(sender, receiver, per_direction=self.per_direction)]
        call = Call(g, verb, "p2p", seq=g.seq)
        call.tag = message_tag
        return Channel(call)

    def isend(self, t: torch.Tensor, peer: int, message_tag: int, verb: str, what: str) -> Message:
        """Start sending ``t`` to pp rank ``peer``; does not block."""
        t = t.detach().contiguous()
        ch = self.channel(verb, message_tag, self.group.rank, peer)
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
        ch = self.channel(verb, message_tag, peer, self.group.rank)
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
        me = self.group.rank
        ch = self.channel("pp_tied_grad", message_tag, me, peer)
        # per direction: the receive on the other process group (one call each way)
        ch_in = self.channel("pp_tied_grad", message_tag, peer, me) if self.per_direction else ch
        r = ch_in.irecv(theirs, peer)
        w = ch.isend(mine, peer)
        try:
            if ch_in is ch:
                ch.wait(r, w)
            else:
                ch_in.wait(r)
                ch.wait(w)
        except CollectiveError as exc:
            raise PipelineError(
                f"pipeline: pp rank {self.group.rank} could not exchange the tied gradient "
                f"with pp rank {peer}: {exc}"
            ) from exc
        if ch_in is not ch:
            ch_in.call.commit()
        ch.call.commit()
        return mine + theirs if me < peer else theirs + mine


def encode_meta(y: torch.Tensor) -> torch.Tensor:
    meta = torch.zeros(META, dtype=torch.int64)
    meta[0], meta[1] = y.dim(), DTYPES.index(y.dtype)
    meta[2 : 2 + y.dim()] = torch.tensor(list(y.shape))
    return meta


def decode_meta(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return torch.Size(meta[2 : 2 + int(meta[0])].tolist()), DTYPES[int(meta[1])]
