"""Groups of ranks and the point-to-point channel every plait algorithm is written on.

A :class:`Group` wraps one ``torch.distributed`` process group. It numbers the collectives
issued on it (the sequence number every rank agrees on), runs asynchronous collectives on
one worker thread in issue order, and hands each collective a :class:`Channel`: group-local
ranks, a tag of its own, a timeout, and byte counters. Algorithms (``ring.py``,
``tree.py``, ...) only ever call ``Channel.send/recv/exchange`` and never see the process
group, so what they send is what the counters say they sent.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait.comm import debug, device, progress, recorder, rounds, tuner, watchdog
from plait.comm.errors import CollectiveError, CollectiveTimeout

if TYPE_CHECKING:
    from plait.comm.shm import ShmLink, ShmOp

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


# Groups by key, for the collectives a compiled graph holds (traceable.py): a graph node
# names its group by this string, as PyTorch's functional collectives name theirs.
_by_key: weakref.WeakValueDictionary[str, Group] = weakref.WeakValueDictionary()
_keys = itertools.count()


def group_by_key(key: str) -> Group:
    """The live group whose :attr:`Group.key` is ``key`` (raises naming it if it is gone)."""
    group = _by_key.get(key)
    if group is None or group.destroyed:
        raise RuntimeError(
            f"no live plait group has key {key!r}: a compiled graph runs a collective on a "
            f"group that was destroyed (plait.destroy_group, Mesh.destroy, plait.shutdown); "
            f"compile the model again after making its groups anew"
        )
    return group


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
    __slots__ = ("work", "peer", "verb", "shm", "tensor", "member")

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
            work = self.group.pg.send([tensor], self.members[peer], self.call.tag)
        except RuntimeError as exc:  # the connection to the peer is already gone
            raise self.failure(peer, "send to", exc) from exc
        return _Pending(work, peer, "send to")

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
            work = self.group.pg.recv([tensor], self.members[peer], self.call.tag)
        except RuntimeError as exc:
            raise self.failure(peer, "receive from", exc) from exc
        return _Pending(work, peer, "receive from")

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
        if group.shm is not None:  # end the waits of this rank's local peers too
            group.shm.abort(None if peer is None else self.global_rank(peer))
        if isinstance(error, CollectiveTimeout):
            # tell the other ranks (whose connections to this one the timeout closed) why
            watchdog.fail(group, error)
        else:
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


class Group:
    """A set of ranks with a process group, a collective counter and a worker thread.

    Build groups with :func:`plait.comm.world` and :func:`plait.comm.new_group`; pass them
    explicitly as ``group=`` to every collective.
    """

    def __init__(
        self,
        *,
        pg: Any,
        ranks: Sequence[int],
        global_rank: int,
        name: str,
        backend: str,
        timeout: float,
        debug: bool = False,
        node_size: int | None = None,
        check: bool = True,
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not in group {name!r} (ranks {list(ranks)})")
        self._pg = pg
        self.destroyed = False
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.name = name
        self.backend = backend
        self.timeout = float(timeout)
        self.timeout_delta = datetime.timedelta(seconds=self.timeout)
        self.debug = debug
        self.check = check
        self.node_size = node_size
        self.seq = 0
        # the last collective this rank entered on the group: (seq, collective, sig, desc)
        self.entered: tuple[int, str, str, str] = (0, "", "", "")
        # set while blocked on one message: (global rank waited on or None, call, since)
        self.waiting: tuple[int | None, Call, float] | None = None
        # set by the watchdog when it ended a wait: raised by every later wait of the call
        self.failure: CollectiveError | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future[Any] | None = None
        # backend collectives started on the caller's thread and not yet waited (start_native)
        self._started: list[Started] = []
        self._node_of: list[str] | None = None
        # this rank's shared-memory link to its ranks on this host (transport.attach)
        self.shm: ShmLink | None = None
        # the process group for messages from higher to lower ranks (runtime.reverse_group)
        self.reverse: Group | None = None
        # unique in this process: how a compiled graph's collective names the group
        self.key = f"{name}#{next(_keys)}"
        _by_key[self.key] = self
        progress.register(self)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"

    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives are made: this rank's GPU on NCCL,
        ``meta`` on PyTorch's fake backend, the CPU on gloo (``device.py``)."""
        return device.group_device(self)

    @property
    def pg(self) -> Any:
        """The backend process group (raises once the group is destroyed)."""
        if self._pg is None:
            raise RuntimeError(
                f"group {self.name!r} (ranks {list(self.ranks)}) was destroyed on rank "
                f"{self.global_rank} (plait.destroy_group, Mesh.destroy, plait.shutdown or the "
                f"end of the RankPool run that made it): create a new group or mesh"
            )
        return self._pg

    def release(self) -> Any:
        """Forget the backend process group (it is freed once torch drops it too) and
        return it; the group is unusable afterwards. Called by ``plait.destroy_group``."""
        pg, self._pg = self._pg, None
        self.destroyed = True
        return pg

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def run(
        self,
        collective: str,
        algorithm: str,
        body: Callable[[Channel], Any],
        *,
        async_op: bool,
        payload_bytes: int,
        signature: str,
        desc: str = "",
    ) -> Handle | None:
        """Issue one collective: number it, check it (debug), run ``body`` on a channel.

        Sequence numbers are taken here, on the calling thread, so they follow issue order
        on every rank even when the collective runs later on the worker thread.
        ``signature`` is what every rank must agree on (collective arguments that decide
        which messages flow); with ``check`` on it is folded into the messages' tags.
        """
        self.seq += 1
        sig = f"{algorithm} {signature}" if signature else algorithm
        call = Call(self, collective, algorithm, self.seq, payload_bytes, sig, desc)
        call.origin = device.origin()
        if self.debug:
            debug.check_signature(call, f"{sig} {desc}")

        def task() -> Any:
            if self.failure is not None:
                raise self._broken(call)
            self.entered = (call.seq, collective, call.sig, call.desc)
            entry = recorder.start(call)
            try:
                result = body(Channel(call))
                if call.round:  # a message never waited for: its peer would wait forever
                    raise RuntimeError(
                        f"{call.describe()}: the algorithm left {len(call.round)} message(s) "
                        f"not waited for (first: {call.round[0].verb} channel rank "
                        f"{call.round[0].peer}); every isend/irecv must be waited for"
                    )
            except BaseException:
                recorder.end(entry, "failed")
                raise
            recorder.end(entry, "completed")
            call.commit()
            return result

        if async_op:
            return Handle(self._submit(task), call)
        if not self.idle():
            self._submit(task).result()  # keep issue order behind pending async work
        else:
            task()
        return None

    def idle(self) -> bool:
        """No asynchronous collective of this group is still queued or running."""
        return self._last is None or self._last.done()

    def start_native(
        self,
        collective: str,
        payload_bytes: int,
        start: Callable[[], Any],
        *,
        signature: str = "",
        desc: str = "",
    ) -> Handle:
        """Issue a backend collective that is asynchronous by itself on the calling thread,
        without the worker thread, and hand what the backend returns (a :class:`Started`
        ``Work``, or a ``torch.futures.Future``) to the :class:`Handle`: it is waited on the
        thread that calls ``Handle.wait()``, where the result is needed.

        Issue order: backends match collectives by the order they are issued, so when
        asynchronous collectives of plait's own algorithms are still queued on the worker
        thread, this first waits for them (their errors stay with their handles); on a
        device backend ``auto`` picks the backend's collectives, so that happens only
        when a plait algorithm was named.
        """
        if not self.idle():
            self.settle()
        self.seq += 1
        sig = f"native {signature}" if signature else "native"
        call = Call(self, collective, "native", self.seq, payload_bytes, sig, desc)
        call.origin = device.origin()
        if self.debug:
            debug.check_signature(call, f"{sig} {desc}")
        if self.failure is not None:
            raise self._broken(call)
        self.entered = (call.seq, collective, call.sig, call.desc)
        entry = recorder.start(call)
        try:
            future = start()
        except RuntimeError as exc:
            recorder.end(entry, "failed")
            raise Channel(call).failure(None, "start", exc) from exc
        recorder.end(entry, "started")
        call.commit()
        if isinstance(future, Started):
            future.call = call
            self._started = [s for s in self._started if not s.finished] + [future]
        return Handle(future, call)

    def _broken(self, call: Call) -> CollectiveError:
        """The error for a collective issued after the group failed."""
        return CollectiveError(
            f"{call.describe()}: group {self.name!r} failed earlier and cannot be used again "
            f"(its connections are closed): {self.failure}"
        )

    def _submit(self, task: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"plait-{self.name}"
            )
        self._last = self._executor.submit(task)
        return self._last

    def synchronize(self) -> None:
        """Wait for every asynchronous collective issued on this group so far (those on
        the worker thread, and the backend's own started on the caller's thread)."""
        if self._last is not None:
            self._last.result()
        started, self._started = self._started, []
        for s in started:
            if not s.finished:
                Handle(s, s.call).wait()

    def settle(self) -> None:
        """Wait for every asynchronous collective issued so far, failed ones included,
        without raising their errors (their handles do)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        progress.unregister(self)
        if self.shm is not None and self.idle():
            self.shm.close()
            self.shm = None


class Started:
    """A backend collective started on the caller's thread (:meth:`Group.start_native`):
    the backend's ``Work`` (None: nothing to send, an empty tensor), what remains to do
    once it completes (``finish``: copy a staged result back, divide an average), and the
    value its future carries (``result``).

    ``timeout``: what ``Work.wait`` is given. On a device backend it is None: on NCCL,
    ``Work.wait()`` makes the waiting thread's current CUDA stream wait for NCCL's stream
    and returns at once, while ``Work.wait(timeout)`` would block the host until the
    collective ends (PyTorch's ``WorkNCCL::synchronizeInternal``); the group's timeout
    is then the process group's own (plait creates every process group with it),
    enforced by ProcessGroupNCCL's watchdog, which fails the work. ``finish`` runs once,
    after that wait (or in the future's callback, when ``get_future()`` was asked for),
    so on the device it is ordered after the collective.
    """

    __slots__ = ("work", "finish", "result", "timeout", "call", "finished", "_chained", "_lock")

    def __init__(
        self,
        work: Any,
        finish: Callable[[], None] | None = None,
        result: Any = None,
        *,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.work = work
        self.finish = finish
        self.result = result
        self.timeout = timeout
        self.call: Call | None = None  # set by Group.start_native
        self.finished = False
        self._chained: torch.futures.Future[Any] | None = None
        # reentrant: a future completed already runs its ``then`` callback at once, inside
        # ``future()``, and the callback completes this one
        self._lock = threading.RLock()

    def complete(self) -> None:
        """Run ``finish`` (once): the collective has completed (or, on a device, the
        current stream waits for it)."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        if self.finish is not None:
            self.finish()

    def wait(self) -> None:
        """Wait for the backend's work on this thread (see the class docstring)."""
        if self._chained is not None:
            self._chained.wait()
        elif self.work is not None:
            if self.timeout is None:
                self.work.wait()
            else:
                self.work.wait(self.timeout)
        self.complete()

    def future(self, error: Callable[[BaseException], BaseException]) -> torch.futures.Future[Any]:
        """The work's future, chained with ``finish``; errors become ``error(exc)``."""
        with self._lock:
            if self._chained is None:
                if self.work is None:
                    base: torch.futures.Future[Any] = torch.futures.Future()
                    base.set_result(None)
                else:
                    base = self.work.get_future()

                def checked(f: torch.futures.Future[Any]) -> Any:
                    try:
                        f.value()
                    except Exception as exc:
                        raise error(exc) from exc
                    self.complete()
                    return self.result

                self._chained = base.then(checked)
            return self._chained

    def is_completed(self) -> bool:
        return self.finished or self.work is None or bool(self.work.is_completed())


class Handle:
    """Returned by ``async_op=True``: ``wait()`` blocks until the collective is done.

    It wraps the worker thread's future, or, for a backend collective started directly
    on the caller's thread, the backend's own ``Work`` (:class:`Started`; on a device
    backend every native asynchronous collective) or ``torch.futures.Future``: those are
    waited on the thread that calls ``wait()``, where the result is needed. Every error
    reaches the caller as a :class:`~plait.comm.errors.CollectiveError` naming the
    collective (and the peer where known), through ``wait()`` and through
    ``get_future()`` alike; a future chained from ``get_future()`` with ``.then(...)``
    carries it too, as long as the callback reads ``fut.value()`` (torch runs ``.then``
    callbacks on failed futures as well).
    """

    __slots__ = ("_future", "_call")

    def __init__(
        self,
        future: concurrent.futures.Future[Any] | torch.futures.Future[Any] | Started | None,
        call: Call | None = None,
    ) -> None:
        self._future = future
        self._call = call

    def _error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, CollectiveError) or self._call is None:
            return exc
        return Channel(self._call).failure(None, "finish", exc)

    def wait(self, timeout: float | None = None) -> None:
        """Block until done and re-raise its error; ``timeout`` in seconds (None: no limit).

        The collective itself is bounded by its group's timeout, so this never hangs
        forever even with ``timeout=None``.
        """
        if isinstance(self._future, (torch._C.Future, Started)):
            call = self._call
            if call is not None:
                call.group.waiting = (None, call, time.monotonic())
            try:
                self._future.wait()
            except Exception as exc:
                raise self._error(exc) from exc
            finally:
                if call is not None:
                    call.group.waiting = None
        elif self._future is not None:
            self._future.result(timeout)

    def is_completed(self) -> bool:
        if isinstance(self._future, Started):
            return self._future.is_completed()
        return self._future is None or self._future.done()

    def get_future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` completed (or failed) with the collective."""
        if isinstance(self._future, Started):
            return self._future.future(self._error)
        if isinstance(self._future, torch._C.Future):

            def checked(f: torch.futures.Future[Any]) -> Any:
                try:
                    return f.value()
                except Exception as exc:
                    raise self._error(exc) from exc

            return self._future.then(checked)  # type: ignore[no-any-return]
        fut: torch.futures.Future[None] = torch.futures.Future()
        if self._future is None:
            fut.set_result(None)
            return fut

        def done(f: concurrent.futures.Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fut.set_exception(exc)  # type: ignore[arg-type]
            else:
                fut.set_result(None)

        self._future.add_done_callback(done)
        return fut


COMPLETED = Handle(None)
