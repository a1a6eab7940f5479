"""The point-to-point channel every plait algorithm is written on, and what it counts.

A :class:`Call` is one collective as issued on a group (its sequence number, tag and byte
counters); a :class:`Channel` hands the algorithm group-local ranks and
``isend``/``irecv``/``wait`` under the call's tag, over the group's transport (shared
memory for a rank on this host, the process group otherwise; on a device backend an
algorithm's messages go out in rounds, :mod:`plait.comm.rounds`). Algorithms (``ring.py``,
``tree.py``, ...) never see the process group, so what they send is what the counters say
they sent (:func:`stats`, :func:`group_stats`). :class:`~plait.comm.group.Group` issues the
calls. A CUDA tensor handed to a channel of a gloo group travels through a host copy (gloo
moves host memory only; shared memory copies device memory itself): a body written on
channels, as the healing exchanges are, runs on a CUDA model over gloo unchanged.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait.comm import device, progress, recorder, rounds, tuner, watchdog
from plait.comm.errors import CollectiveError, CollectiveTimeout

if TYPE_CHECKING:
    from plait.comm.group import Group
    from plait.comm.shm import ShmOp

# Collective messages carry tags with this bit set, so they never match a user's send/recv.
COLLECTIVE_TAG_BIT = 1 << 30
# With the default-mode check on, a collective's tag is COLLECTIVE_TAG_BIT | (seq mod 2^10)
# << 20 | (20 bits of a hash of its signature): ranks that disagree on the collective, op,
# dtype, byte count, root or algorithm post messages under different tags, which the
# transport never matches, so no mismatched bytes are ever exchanged; the stall watchdog
# (watchdog.py) then names the disagreement from the progress board.
_SEQ_BITS, _SIG_BITS = 10, 20
# The watchdog closes a peer's connection by timing out a receive under this tag.
RESERVED_TAG = (1 << 31) - 1


def signature_tag(seq: int, sig: str) -> int:
    """The tag of collective ``seq`` with canonical signature ``sig`` (check mode)."""
    h = zlib.crc32(sig.encode()) & ((1 << _SIG_BITS) - 1)
    tag = COLLECTIVE_TAG_BIT | ((seq % (1 << _SEQ_BITS)) << _SIG_BITS) | h
    return tag - 1 if tag == RESERVED_TAG else tag


@dataclass
class CommStat:
    """What one rank did for one (collective, algorithm) pair since the last reset."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes: int = 0  # sum of the user tensors' sizes, for reference


_stats: dict[tuple[str, str], CommStat] = {}
_group_stats: dict[tuple[str, str, str], CommStat] = {}
_stats_lock = threading.Lock()


def stats(reset: bool = False) -> dict[tuple[str, str], CommStat]:
    """Bytes this rank sent and received, per ``(collective, algorithm)``.

    plait's own algorithms count every byte they hand to the transport. ``"native"``
    collectives are counted in ``calls`` and ``payload_bytes`` only: what the backend sends
    internally is not visible to plait, so their sent/received stay 0. :func:`group_stats`
    splits the same counts by group.
    """
    with _stats_lock:
        snapshot = {k: CommStat(**vars(v)) for k, v in _stats.items()}
        if reset:
            _stats.clear()
            _group_stats.clear()
    return snapshot


def group_stats(reset: bool = False) -> dict[tuple[str, str, str], CommStat]:
    """The counts of :func:`stats` per ``(group name, collective, algorithm)``.

    Group names are those of :class:`Group` (``"world"``, a mesh's ``"mesh0.tp0[0,1]"``, ...),
    so the traffic of each dimension of a mesh can be read apart: summing the entries whose
    name is this rank's ``mesh.group("tp").name`` gives what tensor parallelism sent.
    Reset together with :func:`stats`.
    """
    with _stats_lock:
        snapshot = {k: CommStat(**vars(v)) for k, v in _group_stats.items()}
        if reset:
            _stats.clear()
            _group_stats.clear()
    return snapshot


def reset_stats() -> None:
    stats(reset=True)


@dataclass
class Call:
    """One collective as issued: its identity, tag and byte counters."""

    group: Group
    collective: str
    algorithm: str
    seq: int
    payload_bytes: int = 0
    sig: str = ""  # canonical signature: what every rank must agree on (hashed into the tag)
    desc: str = ""  # for people: shapes and dtypes as passed
    sent: int = 0
    received: int = 0
    tag: int = field(init=False)
    # where it was issued (device.origin()): named when a message it sends is refused
    origin: tuple[Any, int] | None = field(default=None, init=False)
    # on a device backend, the messages started and not yet handed to the backend: the
    # round an algorithm issues together goes out as one batch (Channel.wait)
    round: list[_Pending] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.sig and self.group.check:
            self.tag = signature_tag(self.seq, self.sig)
        else:
            self.tag = COLLECTIVE_TAG_BIT | (self.seq % COLLECTIVE_TAG_BIT)

    def describe(self) -> str:
        where = f"on group {self.group.name!r}"
        if self.algorithm == "p2p":
            return f"{self.collective} (tag {self.tag}) {where}"
        return f"{self.collective} #{self.seq} {where} (algorithm {self.algorithm!r})"

    def fingerprint(self) -> str:
        """What this rank called, for error messages: ``all_reduce #3 sum float32 ...``."""
        return f"{self.collective} #{self.seq} {self.sig} {self.desc}".strip()

    def commit(self) -> None:
        with _stats_lock:
            for s in (
                _stats.setdefault((self.collective, self.algorithm), CommStat()),
                _group_stats.setdefault(
                    (self.group.name, self.collective, self.algorithm), CommStat()
                ),
            ):
                s.calls += 1
                s.bytes_sent += self.sent
                s.bytes_received += self.received
                s.payload_bytes += self.payload_bytes


class _Pending:
    __slots__ = ("work", "peer", "verb", "shm", "tensor", "member", "staged")

    def __init__(
        self,
        work: Any,
        peer: int,
        verb: str,
        shm: ShmOp | None = None,
        *,
        tensor: torch.Tensor | None = None,
        member: int = -1,
    ) -> None:
        self.work = work  # None while it waits in its call's round (device backends)
        self.peer = peer
        self.verb = verb
        self.shm = shm
        self.tensor = tensor  # kept until the round is started
        self.member = member  # the peer's group rank
        # a CUDA message on a host backend (gloo): (the host copy it travels in, the CUDA
        # tensor a receive is copied back into at its wait, None for a send)
        self.staged: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def sends(self) -> bool:
        return self.verb == "send to"


class Channel:
    """Point-to-point messages among some ranks of a group, for one collective call.

    Ranks are numbered ``0 .. size-1`` inside the channel. ``members[i]`` is the group rank
    of channel rank ``i``; :meth:`view` makes a channel over a subset (hierarchical and
    halving-doubling algorithms use this to run a phase among some ranks only). Messages
    between two ranks are matched in order, under the call's tag.

    Each peer's messages take the group's transport for it (``transport.py``): shared
    memory (``group.shm``) for a rank on this host, the process group otherwise. The
    algorithms do not see which; the byte counters count the same bytes either way.
    """

    __slots__ = ("call", "group", "members", "rank", "size", "together")

    def __init__(self, call: Call, members: Sequence[int] | None = None) -> None:
        self.call = call
        self.together = False  # posting messages as one round (post_together)
        self.group = call.group
        self.members = tuple(range(self.group.size)) if members is None else tuple(members)
        self.rank = self.members.index(self.group.rank)
        self.size = len(self.members)

    def view(self, members: Sequence[int]) -> Channel:
        """A channel over ``members`` (channel ranks of this one); this rank must be in it."""
        return Channel(self.call, [self.members[m] for m in members])

    def global_rank(self, peer: int) -> int:
        return self.group.ranks[self.members[peer]]

    # --- non-blocking --------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int) -> _Pending | None:
        """Start sending ``tensor`` (contiguous) to channel rank ``peer``; skips empty ones."""
        n = tensor.numel()
        if n == 0:
            return None
        device.check(self.call.collective, "a message", tensor, self.group, self.call.origin)
        self.call.sent += n * tensor.element_size()
        link = self.group.shm
        try:
            if link is not None and link.reaches(self.members[peer]):
                op = link.isend(tensor, self.members[peer], self.call.tag)
                return _Pending(None, peer, "send to", op)
            if self._in_rounds():  # started with its round, at the next wait
                return self._join_round(tensor, peer, "send to")
            host = tensor.cpu() if self._staged(tensor) else tensor
            work = self.group.pg.send([host], self.members[peer], self.call.tag)
        except RuntimeError as exc:  # the connection to the peer is already gone
            raise self.failure(peer, "send to", exc) from exc
        pending = _Pending(work, peer, "send to")
        if host is not tensor:
            pending.staged = (host, None)  # alive until the send completes
        return pending

    def irecv(self, tensor: torch.Tensor, peer: int) -> _Pending | None:
        """Start receiving into ``tensor`` (contiguous) from channel rank ``peer``."""
        n = tensor.numel()
        if n == 0:
            return None
        device.check(
            self.call.collective, "a message's buffer", tensor, self.group, self.call.origin
        )
        self.call.received += n * tensor.element_size()
        link = self.group.shm
        try:
            if link is not None and link.reaches(self.members[peer]):
                op = link.irecv(tensor, self.members[peer], self.call.tag)
                return _Pending(None, peer, "receive from", op)
            if self._in_rounds():  # started with its round, at the next wait
                return self._join_round(tensor, peer, "receive from")
            staged = self._staged(tensor)
            host = torch.empty(tensor.shape, dtype=tensor.dtype) if staged else tensor
            work = self.group.pg.recv([host], self.members[peer], self.call.tag)
        except RuntimeError as exc:
            raise self.failure(peer, "receive from", exc) from exc
        pending = _Pending(work, peer, "receive from")
        if staged:
            pending.staged = (host, tensor)  # copied into ``tensor`` at its wait
        return pending

    def _staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels through a host copy: a CUDA tensor on a host backend
        (gloo moves host memory only). Shared memory needs none (its copies are torch
        ``copy_`` calls, which read and write device memory); a device backend moves it
        where it is."""
        return tensor.is_cuda and not tuner.is_device_backend(self.group.backend)

    # --- rounds (device backends) ---------------------------------------------------------
    def _in_rounds(self) -> bool:
        """Whether this call's messages wait for their round: a plait algorithm on a
        device backend. Point-to-point calls (``"p2p"``: the user's send/recv, the
        pipeline's and ring attention's messages) start at once, as on gloo: they are
        waited for later, and their peers must not wait for that."""
        on_device = tuner.is_device_backend(self.group.backend)
        return on_device and (self.together or self.call.algorithm != "p2p")

    def post_together(
        self,
        receives: Sequence[tuple[torch.Tensor, int]],
        sends: Sequence[tuple[torch.Tensor, int]],
    ) -> list[_Pending | None]:
        """Post ``receives`` and ``sends`` (``(tensor, channel rank of the peer)`` pairs)
        at once, without waiting. On a device backend they start now as one round (one
        ``batch_isend_irecv``): NCCL runs a pair's messages on one stream in issue order,
        so two ranks that each posted a receive from the other before their send to it would
        hang (a ring shift on 2 ranks). Elsewhere each starts alone, receives first."""
        self.together = True
        try:
            pending = [self.irecv(t, p) for t, p in receives]
            pending += [self.isend(t, p) for t, p in sends]
        finally:
            self.together = False
        if self.call.round:
            self._start_round(pending)
        return pending

    def _join_round(self, tensor: torch.Tensor, peer: int, verb: str) -> _Pending:
        pending = _Pending(None, peer, verb, tensor=tensor, member=self.members[peer])
        self.call.round.append(pending)
        return pending

    def _start_round(self, waited: Sequence[_Pending | None]) -> None:
        """Start the messages of the call's round that :func:`.rounds.choose` picks for a
        wait on ``waited``, as one batch (:func:`.rounds.start_round`)."""
        going, self.call.round = rounds.choose(self.call.round, waited)
        if not going:
            return
        ops = []
        for p in going:
            assert p.tensor is not None
            ops.append((p.sends, p.tensor, p.member))
        try:
            work = rounds.RoundWork(rounds.start_round(self.group.pg, ops, self.call.tag))
        except RuntimeError as exc:
            raise self.failure(going[0].peer, going[0].verb, exc) from exc
        for p in going:
            p.work, p.tensor = work, None

    def wait(self, *pending: _Pending | None) -> None:
        """Wait for started sends/receives; raises a named error past the group's timeout.

        While it blocks, ``group.waiting`` says on whom, so the watchdog can tell a stall
        on a rank that disagrees, skipped this collective or stopped (heartbeat) apart
        from a slow one, and end the wait with a named error. On a device backend the
        round these messages belong to is started first (:meth:`_start_round`).
        """
        group = self.group
        timeout = group.timeout_delta
        link = group.shm
        on_device = tuner.is_device_backend(group.backend)
        if self.call.round:
            self._start_round(pending)
        for p in pending:
            if p is None:
                continue
            group.waiting = (self.global_rank(p.peer), self.call, time.monotonic())
            try:
                if p.shm is not None:
                    assert link is not None
                    link.wait(p.shm, self.members[p.peer])
                    if self.call.collective == "send":  # the user's send: until received
                        link.wait_taken(p.shm, self.members[p.peer])
                elif link is not None and link.busy():
                    # shared-memory operations of this rank still need moving while the
                    # backend's completes (a peer may wait on them first)
                    link.poll_until(p.work.is_completed, None)
                    p.work.wait(timeout)
                elif on_device:
                    # NCCL: the current stream waits for the message, the host does not
                    # (a timeout would block it); the process group holds the timeout
                    p.work.wait()
                else:
                    p.work.wait(timeout)
                if p.staged is not None and p.staged[1] is not None:
                    p.staged[1].copy_(p.staged[0])  # a staged receive: back to the device
            except RuntimeError as exc:
                raise self.failure(p.peer, p.verb, exc) from exc
            finally:
                group.waiting = None

    # --- blocking ------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.wait(self.isend(tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.wait(self.irecv(tensor, peer))

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time (one ring step)."""
        r = self.irecv(recv, src)
        s = self.isend(send, dst)
        self.wait(r, s)

    # --- errors --------------------------------------------------------------------------
    def failure(self, peer: int | None, verb: str, exc: BaseException) -> CollectiveError:
        """The error to raise when waiting to ``verb`` channel rank ``peer`` failed
        (``peer=None``: a native collective of the whole group)."""
        group = self.group
        flagged = watchdog.failure_for(group, self.call)
        if flagged is not None:  # the watchdog ended this wait, or a peer's did
            recorder.dump(f"{type(flagged).__name__}: {flagged}")
            return flagged
        mismatch = watchdog.mismatch_on_board(group, self.call)
        if mismatch is not None:  # a message of another size failed before any watchdog looked
            watchdog.fail(group, mismatch)
            return mismatch
        if peer is None:  # a backend collective: any other rank of the group
            others = [r for r in group.ranks if r != group.global_rank]
            whom = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        else:
            whom = f"rank {self.global_rank(peer)}"
        text = str(exc)
        error = self._failure(peer, verb, exc, whom, text)
        culprit = None if peer is None else self.global_rank(peer)
        if isinstance(error, CollectiveTimeout):
            # Tell the other ranks why before ending their waits (watchdog.fail publishes,
            # then closes): a local peer woken by this rank's abort word reads this verdict
            # and names the rank that never came, not this rank's abort.
            culprit = error.missing[0] if error.missing else culprit
            watchdog.fail(group, error, culprit=culprit)
            if group.shm is not None:  # (fail closes only the first time)
                group.shm.abort(culprit)
            return error
        if group.shm is not None:  # end the waits of this rank's local peers too
            group.shm.abort(culprit)
        recorder.dump(f"{type(error).__name__}: {error}")
        return error

    def _failure(
        self, peer: int | None, verb: str, exc: BaseException, whom: str, text: str
    ) -> CollectiveError:
        group = self.group
        me = group.global_rank
        if "timed out" in text.lower() or "timeout" in text.lower():
            p2p = self.call.algorithm == "p2p"
            missing = [] if p2p else progress.missing_ranks(group, self.call.seq)
            if missing:
                why = f"Ranks that did not arrive at #{self.call.seq}: {missing}. "
            elif p2p:
                missing = [] if peer is None else [self.global_rank(peer)]
                why = f"{whom} did not post the matching message. "
            else:
                missing = [] if peer is None else [self.global_rank(peer)]
                why = (
                    f"Every rank entered #{self.call.seq}, but {whom} stopped answering "
                    f"(it may have failed or be stuck inside it). "
                )
            return CollectiveTimeout(
                f"{self.call.describe()}: rank {me} waited {group.timeout:g}s to {verb} "
                f"{whom}. {why}"
                f"{progress.describe(group)}Check that every rank of the group calls the "
                f"same collectives in the same order, or raise the timeout "
                f"(plait.init(timeout=...)).",
                missing,
            )
        first_line = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
        where = "" if peer is None else progress.whereabouts(self.global_rank(peer))
        return CollectiveError(
            f"{self.call.describe()}: rank {me} failed to {verb} {whom}{where} ({first_line}). "
            f"A peer probably crashed or exited; look at its log."
        )
