"""Would plait's own algorithms deadlock on NCCL? They run here on NCCL's ordering rules.

PyTorch's ProcessGroupNCCL runs a single send or receive between two ranks on one stream
per pair, in issue order, and a send blocks its stream until the matching receive runs
(the worst case: a message too large for NCCL's buffers). Two ranks that each start a
send to the other before their receive from it therefore hold each other's pair stream
for ever. A ``batch_isend_irecv`` is one group of operations: its sends and receives
progress together, on the group's stream, and the batch completes when all of them have.

:func:`run` executes an algorithm of ``plait/comm`` (``ring.all_reduce``, ...) on ``n``
threads, each a rank with plait's real :class:`~plait.comm.group.Channel` over a
:class:`Streams` model of those rules that moves the data (plain CPU tensors):

- a message started alone (the process group's ``send``/``recv``: what plait did on every
  backend, and still does on gloo) joins the stream of its pair;
- a round started by the channel (:func:`plait.comm.rounds.start_round`, on device
  backends) joins its rank's group stream as one batch;
- an operation can run when the batch or message holding it heads its stream; the k-th
  send from a to b matches the k-th receive at b from a, and both complete (the data is
  copied) once both can run; a batch or message leaves its stream when all of its
  operations completed;
- a ``wait`` blocks its thread (the host) until what it waits for completed (on NCCL the
  compute stream waits, and the next launch waits for the compute stream: the same order).

When every live rank is blocked and nothing can run, every rank raises :class:`Deadlock`.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from plait.comm import rounds
from plait.comm.group import Call, Channel


class Deadlock(RuntimeError):
    pass


@dataclass
class _Op:
    rank: int
    peer: int
    sends: bool
    tensor: torch.Tensor
    index: int  # the k-th message of its ordered pair
    done: bool = False


@dataclass
class _Item:
    """A message started alone, or a batch, on one stream."""

    ops: list[_Op]
    done: bool = False


@dataclass
class _Work:
    streams: Streams
    item: _Item

    def wait(self, timeout: Any = None) -> None:
        self.streams.wait(self.item)

    def is_completed(self) -> bool:
        return self.item.done


@dataclass
class Streams:
    """NCCL's ordering rules for ``n`` ranks (module docstring); thread-safe."""

    n: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    streams: dict[tuple[int, Any], list[_Item]] = field(default_factory=dict)
    counts: dict[tuple[int, int, bool], int] = field(default_factory=dict)
    moved: list[int] = field(default_factory=list)  # bytes sent, per rank
    live: int = 0
    waiting: dict[int, _Item] = field(default_factory=dict)  # thread -> what it waits for
    dead: bool = False

    def __post_init__(self) -> None:
        self.moved = [0] * self.n
        self.live = self.n

    def _op(self, rank: int, sends: bool, tensor: torch.Tensor, peer: int) -> _Op:
        src, dst = (rank, peer) if sends else (peer, rank)
        key = (src, dst, sends)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        return _Op(rank, peer, sends, tensor, index)

    def start(self, rank: int, stream: Any, ops: list[tuple[bool, torch.Tensor, int]]) -> _Work:
        with self.cond:
            item = _Item([self._op(rank, s, t, p) for s, t, p in ops])
            self.streams.setdefault((rank, stream), []).append(item)
            self._progress()
            self.cond.notify_all()
            return _Work(self, item)

    def _runnable(self) -> dict[tuple[int, int, int, bool], _Op]:
        """Operations whose batch or message heads its stream, by (src, dst, k, sends)."""
        out = {}
        for (rank, _), queue in self.streams.items():
            if queue:
                for op in queue[0].ops:
                    if not op.done:
                        src, dst = (rank, op.peer) if op.sends else (op.peer, rank)
                        out[(src, dst, op.index, op.sends)] = op
        return out

    def _progress(self) -> bool:
        moved = False
        while True:
            runnable = self._runnable()
            step = False
            for (src, dst, k, sends), op in runnable.items():
                if not sends:
                    continue
                receive = runnable.get((src, dst, k, False))
                if receive is None:
                    continue
                if receive.tensor.numel() != op.tensor.numel():
                    raise AssertionError(
                        f"message {k} from rank {src} to {dst}: {op.tensor.numel()} elements "
                        f"sent, {receive.tensor.numel()} expected"
                    )
                receive.tensor.copy_(op.tensor)
                self.moved[src] += op.tensor.numel() * op.tensor.element_size()
                op.done = receive.done = True
                step = True
            for queue in self.streams.values():
                while queue and all(op.done for op in queue[0].ops):
                    queue.pop(0).done = True
                    step = True
            if not step:
                return moved
            moved = True

    def wait(self, item: _Item) -> None:
        with self.cond:
            while True:
                if self._progress():
                    self.cond.notify_all()
                if item.done:
                    return
                if self.dead:
                    raise Deadlock("another rank found the deadlock")
                # every other live rank waits too, for something not done: none can move
                if len(self.waiting) + 1 == self.live and not any(
                    other.done for other in self.waiting.values()
                ):
                    self.dead = True
                    self.cond.notify_all()
                    raise Deadlock(self.describe())
                me = threading.get_ident()
                self.waiting[me] = item
                self.cond.wait(timeout=5.0)
                del self.waiting[me]

    def finished(self) -> None:
        with self.cond:
            self.live -= 1
            self.cond.notify_all()

    def describe(self) -> str:
        heads = []
        for (rank, stream), queue in sorted(self.streams.items(), key=str):
            if queue:
                ops = ", ".join(
                    f"{'send to' if o.sends else 'recv from'} {o.peer}"
                    for o in queue[0].ops
                    if not o.done
                )
                heads.append(f"rank {rank} stream {stream}: {ops}")
        return "no operation can run; stream heads: " + "; ".join(heads)


class _Pg:
    """A process group whose single messages take their pair's stream."""

    def __init__(self, streams: Streams, rank: int) -> None:
        self.streams, self.rank = streams, rank

    def _pair(self, peer: int) -> tuple[str, int, int]:
        return ("pair", min(self.rank, peer), max(self.rank, peer))

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        return self.streams.start(self.rank, self._pair(peer), [(True, tensors[0], peer)])

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        return self.streams.start(self.rank, self._pair(peer), [(False, tensors[0], peer)])


class _Group:
    """What a :class:`Channel` reads of a group. ``backend``: ``"nccl-streams"`` (a device
    backend: the channel batches each round) or ``"gloo"`` (every message started alone,
    what plait did on NCCL before rounds)."""

    def __init__(self, streams: Streams, rank: int, backend: str, node_size: int) -> None:
        self.pg = _Pg(streams, rank)
        self.rank, self.size = rank, streams.n
        self.global_rank = rank
        self.ranks = tuple(range(streams.n))
        self.name = "streams"
        self.backend = backend
        self.check = True
        self.node_size = node_size
        self.shm = None
        self.timeout_delta = datetime.timedelta(seconds=30)
        self.waiting: Any = None
        self.failure = None
        self.device = torch.device("cpu")


@dataclass
class Result:
    outputs: list[Any]  # per rank, what ``body`` returned
    sent: list[int]  # bytes each rank's channel counted as sent
    received: list[int]
    moved: list[int]  # bytes each rank's sends actually delivered in the model
    error: str | None  # the deadlock, if any


def run(
    n: int,
    body: Callable[[Channel], Any],
    *,
    batched: bool,
    node_size: int = 2,
    monkeypatch: pytest.MonkeyPatch,
) -> Result:
    """``body(channel)`` on ``n`` threads, one rank each, over one :class:`Streams`."""
    streams = Streams(n)

    def start_round(pg: Any, ops: Sequence[tuple[bool, torch.Tensor, int]], tag: int) -> list[Any]:
        return [pg.streams.start(pg.rank, "group", list(ops))]

    monkeypatch.setattr(rounds, "start_round", start_round)
    backend = "nccl-streams" if batched else "gloo"
    outputs: list[Any] = [None] * n
    calls: list[Call | None] = [None] * n
    errors: list[str] = []

    def rank_main(rank: int) -> None:
        try:
            group: Any = _Group(streams, rank, backend, node_size)
            call = Call(group, "sim", "sim", 1)
            calls[rank] = call
            outputs[rank] = body(Channel(call))
            assert not call.round, f"rank {rank}: messages never waited for"
        except Deadlock as exc:
            errors.append(f"rank {rank}: {exc}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        finally:
            streams.finished()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated rank did not finish"
    error = "; ".join(sorted(errors)) or None
    return Result(
        outputs,
        [c.sent if c else 0 for c in calls],
        [c.received if c else 0 for c in calls],
        list(streams.moved),
        error,
    )
