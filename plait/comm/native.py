"""The backend's own collectives (gloo's or NCCL's), behind plait's interface.

Same arguments and results as plait's algorithms, so ``algorithm="native"`` is one more
choice and the benchmark can put the two side by side. plait cannot see what the backend
sends internally, so the byte counters record only the call and its payload.

Each collective comes in two forms: ``start_<collective>`` starts the backend's
collective and returns a :class:`~plait.comm.group.Started` (its ``Work`` and what remains
to do when it completes), and ``<collective>(ch, ...)`` runs it to the end on a channel
(plait's algorithm interface, on the worker thread or inline). On a device backend
(NCCL, the fake backend) ``plait.comm.ops`` hands an asynchronous call's ``Started`` to
the caller's :class:`~plait.comm.group.Handle` (:meth:`Group.start_native`), so the
collective runs beside the compute issued after it and is waited where its result is
needed, as PyTorch's DDP and FSDP2 do; waits there pass no timeout (see ``Started``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.comm import tuner
from plait.comm.group import Channel, Group, Started
from plait.comm.reduce_op import TO_TORCH, ReduceOp, prescaled

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _started(
    group: Group, work: Any, finish: Callable[[], None] | None = None, result: Any = None
) -> Started:
    """``work`` as a :class:`Started`: waited without a timeout on a device backend (a
    stream wait on NCCL; the process group's watchdog holds the group's timeout), with it
    on a host backend."""
    timeout = None if tuner.is_device_backend(group.backend) else group.timeout_delta
    return Started(work, finish, result, timeout=timeout)


def _wait(ch: Channel, started: Started) -> None:
    group = ch.group
    group.waiting = (None, ch.call, time.monotonic())
    try:
        started.wait()
    except RuntimeError as exc:
        raise ch.failure(None, "finish", exc) from exc
    finally:
        group.waiting = None


def _agree(ch: Channel) -> None:
    """With the check on, on a host backend: before handing the call to the backend,
    exchange a one-byte token with every other rank under the call's tag, which encodes
    its signature. Ranks that disagree never match, so none enters the backend's
    collective (whose size checks abort the process) unless every rank agrees; the
    watchdog names the stall. Costs one round of tiny messages.

    Not on a device backend: NCCL matches point-to-point messages by issue order and
    ignores tags, so the token could not carry the signature, and it runs a pair's sends
    and receives on one stream in issue order, where the receive posted before the send
    to the same peer would deadlock two ranks (``tests/test_meta_device_p2p.py``); it
    would also make every collective wait on the host. There, ``PLAIT_DEBUG=1`` compares
    the signatures through the store, and the flight recorder names the last calls."""
    if not ch.group.check or tuner.is_device_backend(ch.group.backend):
        return
    others = [p for p in range(ch.size) if p != ch.rank]
    token = torch.zeros(1, dtype=torch.uint8, device=ch.group.device)
    box = torch.empty(len(others), dtype=torch.uint8, device=ch.group.device)
    sent, received = ch.call.sent, ch.call.received
    pending = [ch.irecv(box[i : i + 1], p) for i, p in enumerate(others)]
    pending += [ch.isend(token, p) for p in others]
    ch.wait(*pending)
    ch.call.sent, ch.call.received = sent, received  # native calls count no bytes


def _adjacent(chunks: list[torch.Tensor]) -> torch.Tensor | None:
    """The single buffer ``chunks`` are equal, adjacent views of, if they are."""
    first = chunks[0]
    if any(c.numel() != first.numel() for c in chunks):
        return None
    if any(
        c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        or c.storage_offset() != first.storage_offset() + i * first.numel()
        for i, c in enumerate(chunks)
    ):
        return None
    return first.as_strided((first.numel() * len(chunks),), (1,), first.storage_offset())


# --- started: the backend's work, and what remains when it completes -----------------------
def start_all_reduce(flat: torch.Tensor, op: ReduceOp, group: Group) -> Started:
    """Start the backend's all-reduce of ``flat`` in place (``op`` a backend op: no avg)."""
    return _started(group, dist.all_reduce(flat, TO_TORCH[op], group=group.pg, async_op=True))


def start_broadcast(flat: torch.Tensor, root: int, group: Group) -> Started:
    root_rank = group.ranks[root]
    return _started(group, dist.broadcast(flat, root_rank, group=group.pg, async_op=True))


def start_reduce_scatter(
    inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp, group: Group
) -> Started:
    """Start reducing ``inputs`` (one block per rank) into ``output`` (this rank's block)."""
    whole = _adjacent(inputs)
    pg, rop = group.pg, TO_TORCH[op]
    if whole is not None:
        return _started(group, _reduce_scatter_single(output, whole, rop, group=pg, async_op=True))
    # uneven blocks: backends want equal ones, so pad every block to the largest
    largest = max(t.numel() for t in inputs)
    padded = output.new_zeros(len(inputs), largest)
    for row, t in zip(padded, inputs, strict=True):
        row[: t.numel()].copy_(t)
    mine = output.new_empty(largest)
    work = _reduce_scatter_single(mine, padded.view(-1), rop, group=pg, async_op=True)

    def finish() -> None:
        output.copy_(mine[: output.numel()])

    return _started(group, work, finish)


def start_all_gather(chunks: list[torch.Tensor], group: Group) -> Started:
    """Start gathering every rank's ``chunks[rank]`` into ``chunks`` (this rank's filled)."""
    whole = _adjacent(chunks)
    pg, rank = group.pg, group.rank
    if whole is not None:
        work = _all_gather_single(whole, chunks[rank].clone(), group=pg, async_op=True)
        return _started(group, work)
    # uneven blocks: backends want equal ones, so pad every block to the largest
    largest = max(t.numel() for t in chunks)
    mine = chunks[rank].new_zeros(largest)
    mine[: chunks[rank].numel()].copy_(chunks[rank])
    gathered = mine.new_empty(len(chunks), largest)
    work = _all_gather_single(gathered.view(-1), mine, group=pg, async_op=True)

    def finish() -> None:
        for c, row in zip(chunks, gathered, strict=True):
            c.copy_(row[: c.numel()])

    return _started(group, work, finish)


# --- run to the end on a channel: plait's algorithm interface -------------------------------
def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    _agree(ch)
    _wait(ch, start_all_reduce(flat, op, ch.group))


def all_reduce_async(tensor: torch.Tensor, op: ReduceOp, group: Group) -> Any:
    """Start the backend's all-reduce of ``tensor`` in place; a future of ``tensor``.

    ``avg`` is a sum followed by a division, done when the sum completes (before it
    starts for float16: see :func:`~plait.comm.reduce_op.prescaled`)."""
    summed = ReduceOp.SUM if op is ReduceOp.AVG else op
    before = prescaled(op, tensor.dtype)
    if before:
        tensor.div_(group.size)
    work = dist.all_reduce(tensor, TO_TORCH[summed], group=group.pg, async_op=True)
    future = work.get_future()

    def finish(f: Any) -> torch.Tensor:
        f.value()  # re-raises the backend's error: a failed future must not carry a value
        return tensor.div_(group.size) if op is ReduceOp.AVG and not before else tensor

    return future.then(finish)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    _agree(ch)
    _wait(ch, start_broadcast(flat, root, ch.group))


def reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    _agree(ch)
    # backends may use the non-root buffers as scratch; plait leaves them unchanged
    buf = flat if ch.rank == root else flat.clone()
    work = dist.reduce(buf, ch.global_rank(root), TO_TORCH[op], group=ch.group.pg, async_op=True)
    _wait(ch, _started(ch.group, work))


def reduce_scatter(
    ch: Channel, inputs: list[torch.Tensor], output: torch.Tensor, op: ReduceOp
) -> None:
    _agree(ch)
    _wait(ch, start_reduce_scatter(inputs, output, op, ch.group))


def all_gather(ch: Channel, chunks: list[torch.Tensor]) -> None:
    _agree(ch)
    _wait(ch, start_all_gather(chunks, ch.group))


def all_to_all(ch: Channel, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    _agree(ch)
    out = torch.cat(outputs) if outputs else torch.empty(0)
    work = dist.all_to_all_single(
        out,
        torch.cat(inputs),
        [t.numel() for t in outputs],
        [t.numel() for t in inputs],
        group=ch.group.pg,
        async_op=True,
    )
    _wait(ch, _started(ch.group, work))
    for o, piece in zip(outputs, torch.split(out, [t.numel() for t in outputs]), strict=True):
        o.copy_(piece)


def barrier(ch: Channel) -> None:
    _agree(ch)
    _wait(ch, _started(ch.group, dist.barrier(group=ch.group.pg, async_op=True)))
