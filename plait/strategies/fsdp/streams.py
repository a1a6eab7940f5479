"""FSDP2's side streams on CUDA: the all-gather and the reduce-scatter leave the compute stream.

Written from FSDP2's design (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``,
``_fsdp_state.py``) and reviewed; it has not run yet (no GPU here): the GPU suite's
overhead table measures it when one is available. Off CUDA (CPU, ``meta``) there are no
side streams and every function here is a no-op, so the CPU tests run the same code.

On NCCL an asynchronous collective already runs on NCCL's own stream, which waits for the
issuing stream at the call, and ``Work.wait()`` makes the waiting thread's current stream
wait for it (``plait.comm.group.Started``). What the side streams add:

- **all-gather stream**: a prefetch's copy-in (the shard cast to ``param_dtype`` into its
  send buffer) and the all-gather are issued there, after everything the compute stream
  holds so far (the shard's last update), so compute kernels issued after the prefetch
  do not queue behind the copy-in. The compute stream waits for the gather where the
  unit needs its parameters (``ShardedUnit.wait``: the collective's ``Handle.wait()`` on
  the compute stream, then a wait for the event recorded on the side stream after the
  issue, as FSDP2 orders its streams with events: :class:`Ordered`).
- **reduce-scatter stream**: at a unit's post-backward, the stream waits for the compute
  stream (the gradient is complete), then casts the gradient to ``reduce_dtype`` and
  issues the reduce-scatter, so the backward of the units before it is not queued behind
  the cast; the compute stream waits for it (and the side stream's event) at the end of
  backward (``_RootState.finish_backward``).

Memory: a tensor made on one stream and used on another must not be reused by the caching
allocator before the other is done with it. plait keeps every such tensor referenced until
the compute stream has waited for the collective that uses it (the all-gather's source in
``ShardedUnit._gathering``, the gradient and its reduced shard in
``_RootState.reductions``), and the gathered buffer is allocated on the compute stream
before the side stream is entered (the side stream waits for the compute stream first).
A blocking gather (``unshard()`` without ``async_op``) stays on the compute stream: it is
waited at once there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SideStreams:
    """The two streams of one device's sharded units (shared by every unit of a root)."""

    all_gather: Any  # torch.cuda.Stream
    reduce_scatter: Any  # torch.cuda.Stream


def for_device(device: torch.device) -> SideStreams | None:
    """Side streams for units computing on ``device``: two new CUDA streams on a CUDA
    device, None elsewhere (CPU, ``meta``: one stream, nothing to order)."""
    if device.type != "cuda":
        return None
    return SideStreams(torch.cuda.Stream(device), torch.cuda.Stream(device))


class Issued:
    """What one :func:`issued_on` block issued: its side stream (None off CUDA) and the
    event recorded there when the block ends."""

    __slots__ = ("stream", "event")

    def __init__(self, stream: Any | None) -> None:
        self.stream = stream
        self.event: Any | None = None


@contextlib.contextmanager
def issued_on(stream: Any | None) -> Iterator[Issued]:
    """Issue the block's kernels and collectives on ``stream``, after everything queued
    so far on the current stream (``stream.wait_stream``), and record an event there at
    the end. ``None``: the current stream, unchanged (off CUDA)."""
    issued = Issued(stream)
    if stream is None:
        yield issued
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield issued
        issued.event = stream.record_event()


class Ordered:
    """A collective's handle issued inside an :func:`issued_on` block: ``wait()`` waits
    for the collective, then makes the current stream wait for the block's event, so
    everything the side stream did around the collective (the copy-in, the gradient's
    cast, the plain copy of a one-rank group, whose handle is complete at once) is ordered
    before the compute that reads the result."""

    __slots__ = ("handle", "issued")

    def __init__(self, handle: Any, issued: Issued) -> None:
        self.handle = handle
        self.issued = issued

    def wait(self) -> None:
        self.handle.wait()
        event = self.issued.event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def get_future(self) -> Any:
        return self.handle.get_future()

    def is_completed(self) -> bool:
        return bool(self.handle.is_completed())


def ordered(handle: Any, issued: Issued) -> Any:
    """``handle`` as an :class:`Ordered` when it was issued on a side stream, else itself."""
    return handle if issued.stream is None or handle is None else Ordered(handle, issued)
