"""The parameter server's wire format and its point-to-point link.

Every message is a fixed-size header, eight int64 numbers sent as one tensor, followed
(for pushes and parameter replies) by the payload: one flat tensor of ``length``
elements. Nothing else crosses the wire: no pickle, no RPC, nothing executable.

Header fields, in order::

    magic    0x504C4149 ("PLAI"): anything else is not a plait message
    kind     PUSH (worker -> server, gradient follows), PULL (worker asks for parameters),
             PARAMS (server -> worker, parameters follow), DONE (worker finished),
             SAVE (worker asks the server to checkpoint), ABORT (server -> worker: training
             cannot continue; ``extra`` names the failed worker's rank)
    version  PUSH: the server version the gradient was computed on;
             PULL: the version the worker last received (-1: none yet);
             PARAMS: the version sent
    shard    the server's shard index (a message for another shard is rejected)
    length   payload elements (must equal the shard's size)
    clock    PUSH: the worker's push count on this server, a stamp: the server applies
             each clock once and ignores (and counts) a push whose clock it has applied;
             PARAMS: the clock the server expects next from this worker (a worker
             restarted against a resumed server continues from it)
    lr       PUSH: the worker's learning rate, a float64 stored bit for bit
    extra    ABORT: the failed worker's rank

:func:`decode` checks every field against what the receiver expects and raises
:class:`MalformedMessage` naming the sender otherwise. Messages between one worker and
one server travel under one tag and are matched in order, so a payload always follows
its header.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from plait.comm.errors import CollectiveError
from plait.comm.group import Call, Group

MAGIC = 0x504C4149
HEADER_FIELDS = 8
# Parameter-server messages use their own tag, apart from user p2p tags and collectives.
PS_TAG = 1 << 29


class Kind(IntEnum):
    PUSH = 1
    PULL = 2
    PARAMS = 3
    DONE = 4
    SAVE = 5
    ABORT = 6


class MalformedMessage(ValueError):
    """A message that is not what the protocol allows at this point; ``sender`` is the
    global rank it came from."""

    def __init__(self, message: str, sender: int) -> None:
        super().__init__(message)
        self.sender = sender


class PeerLost(CollectiveError):
    """The peer of a link died, closed its connection or stopped answering; ``rank``."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _lr_bits(lr: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(lr)))[0])


def _lr_from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(bits)))[0])


@dataclass(frozen=True)
class Header:
    kind: Kind
    version: int = 0
    shard: int = 0
    length: int = 0
    clock: int = 0
    lr: float = 0.0
    extra: int = 0

    def encode(self) -> torch.Tensor:
        fields = [MAGIC, int(self.kind), self.version, self.shard, self.length, self.clock]
        return torch.tensor([*fields, _lr_bits(self.lr), self.extra], dtype=torch.int64)


def decode(
    raw: torch.Tensor,
    *,
    sender: int,
    kinds: tuple[Kind, ...],
    shard: int,
    length: int,
) -> Header:
    """The header in ``raw``; raises :class:`MalformedMessage` naming ``sender`` unless it
    is a plait header of one of ``kinds`` for ``shard`` whose payload (for PUSH/PARAMS)
    has ``length`` elements."""
    values = [int(v) for v in raw.tolist()]
    if len(values) != HEADER_FIELDS or values[0] != MAGIC:
        raise MalformedMessage(
            f"message from rank {sender} is not a plait parameter-server header (magic "
            f"{values[0] if values else None:#x}, expected {MAGIC:#x}): that rank is not "
            f"running a plait worker/server of the same version, or sent on plait's tag",
            sender,
        )
    _, kind_value, version, shard_index, n, clock, lr_bits, extra = values
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise MalformedMessage(
            f"message from rank {sender} has unknown kind {kind_value}; expected one of "
            f"{[k.name for k in kinds]}",
            sender,
        ) from None
    if kind not in kinds:
        raise MalformedMessage(
            f"message from rank {sender} is a {kind.name}, but only "
            f"{[k.name for k in kinds]} are allowed here",
            sender,
        )
    if shard_index != shard:
        raise MalformedMessage(
            f"message from rank {sender} is for shard {shard_index}, but this is shard {shard}",
            sender,
        )
    if kind in (Kind.PUSH, Kind.PARAMS) and n != length:
        raise MalformedMessage(
            f"{kind.name} from rank {sender} announces {n} elements, but shard {shard} has "
            f"{length}: the sender's model differs from this one (same model and the same "
            f"number of servers on every rank?)",
            sender,
        )
    if kind is Kind.PUSH and version < 0:
        raise MalformedMessage(f"PUSH from rank {sender} claims negative version {version}", sender)
    return Header(kind, version, shard_index, n, clock, _lr_from_bits(lr_bits), extra)


class _Waiter:
    """One daemon thread that waits on transport work for a watched :class:`Link`, so the
    link's caller can check the peer's liveness meanwhile. A wait the peer never answers
    keeps this thread blocked; being a daemon, it does not hold the process at exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]] | None]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # close(): no wait is pending
                return
            work, done, errors = job
            try:
                work.wait()
            except BaseException as exc:  # handed to the caller
                errors.append(exc)
            finally:
                done.set()

    def submit(self, work: Any) -> tuple[threading.Event, list[BaseException]]:
        done, errors = threading.Event(), list[BaseException]()
        self._jobs.put((work, done, errors))
        return done, errors

    def close(self) -> None:
        """End the thread once the waits submitted so far are done."""
        self._jobs.put(None)


class Link:
    """Blocking point-to-point messages with one peer on ``group`` (tag :data:`PS_TAG`).

    No wait has a receive timeout: in gloo a timed-out receive fails every connection of
    the process, so a slow peer would take healthy ones down with it. A dead peer's
    closed connection raises :class:`PeerLost` at once. A hung peer is the job of
    ``watch``: with it, waits run on a helper thread while the caller calls ``watch()``
    every ``poll_s`` seconds; a reason returned (e.g. "no heartbeat for 6.1s") raises
    :class:`PeerLost` naming the peer and the reason. Without it a wait blocks until the
    peer answers or its connection fails (the server's handler threads, whose liveness a
    monitor thread checks). Bytes are counted in :func:`plait.comm.stats` under
    ``("ps", "p2p")``.
    """

    def __init__(
        self,
        group: Group,
        peer: int,
        *,
        watch: Callable[[], str | None] | None = None,
        poll_s: float = 0.25,
        what: str = "",
    ) -> None:
        self.group = group
        self.peer = peer  # global rank
        self.peer_index = group.ranks.index(peer)
        self.watch = watch
        self.poll_s = poll_s
        self.what = what or f"rank {peer}"  # how messages name the peer
        self._waiter: _Waiter | None = None

    def close(self) -> None:
        """Stop the helper thread of a watched link (after its last message)."""
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None

    def _lost(self, verb: str, why: str) -> PeerLost:
        return PeerLost(
            f"rank {self.group.global_rank} could not {verb} {self.what}: {why}", self.peer
        )

    def _posting_failed(self, verb: str, exc: BaseException) -> PeerLost:
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else repr(exc)
        return self._lost(
            verb,
            f"its connection failed ({text}). The peer probably crashed or exited; look at its log",
        )

    def _wait(self, work: Any, verb: str, nbytes: int, sent: bool) -> None:
        errors: list[BaseException] = []
        if self.watch is None:
            try:
                work.wait()
            except RuntimeError as exc:
                errors.append(exc)
        else:
            if self._waiter is None:
                self._waiter = _Waiter(f"plait-ps-link-{self.peer}")
            done, errors = self._waiter.submit(work)
            while not done.wait(self.poll_s):
                why = self.watch()
                if why is not None:
                    raise self._lost(verb, f"{why}. Look at that process")
        if errors:
            first = errors[0]
            text = str(first).strip().splitlines()[0][:200] if str(first).strip() else repr(first)
            raise self._lost(
                verb,
                f"its connection failed ({text}). The peer probably crashed or exited; "
                f"look at its log",
            ) from first
        call = Call(self.group, "ps", "p2p", 0, nbytes)
        if sent:
            call.sent = nbytes
        else:
            call.received = nbytes
        call.commit()

    def start_send(self, tensor: torch.Tensor) -> tuple[Any, int]:
        """Start sending ``tensor``; pass the result to :meth:`finish_send`."""
        try:
            work = self.group.pg.send([tensor], self.peer_index, PS_TAG)
        except RuntimeError as exc:  # posting fails at once on a closed connection
            raise self._posting_failed("send to", exc) from exc
        return work, tensor.numel() * tensor.element_size()

    def finish_send(self, started: tuple[Any, int]) -> None:
        self._wait(started[0], "send to", started[1], True)

    def send(self, tensor: torch.Tensor) -> None:
        self.finish_send(self.start_send(tensor))

    def recv(self, tensor: torch.Tensor) -> None:
        try:
            work = self.group.pg.recv([tensor], self.peer_index, PS_TAG)
        except RuntimeError as exc:
            raise self._posting_failed("receive from", exc) from exc
        self._wait(work, "receive from", tensor.numel() * tensor.element_size(), False)

    def send_header(self, header: Header) -> None:
        self.send(header.encode())

    def recv_header(self, *, kinds: tuple[Kind, ...], shard: int, length: int) -> Header:
        raw = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        self.recv(raw)
        return decode(raw, sender=self.peer, kinds=kinds, shard=shard, length=length)
