"""The stall watchdog: names why a collective is not progressing, and ends the wait.

It runs on the progress thread (``progress.py``), every ``PERIOD_S``, and costs the
collectives nothing: a wait only records on its group whom it waits for
(``Group.waiting``). For a wait blocked longer than ``STALL_S`` it reads the progress
board and the heartbeats of the store and decides:

* a rank of the group entered the same sequence number with another signature
  (collective, algorithm, op, dtype, byte count, root): :class:`CollectiveMismatch`
  naming every rank's call. With the default check the ranks' messages then carry
  different tags, so none of them was exchanged.
* the rank waited on has already moved past this sequence number, and this rank has
  waited longer than the heartbeat timeout (it skipped the collective, or this rank issued
  one more): :class:`CollectiveMismatch` naming both. Sooner would be wrong: a peer that
  finished the collective moves on while its last messages are still being delivered.
* the rank waited on (every rank of the group, for a backend collective) has not beaten
  its heartbeat for ``heartbeat_timeout`` seconds: :class:`PeerUnresponsive` naming it,
  its host and pid. A shorter silence (a stall) is only logged, with its duration.
* a peer already decided (its verdict is in the store under ``plait/verdict/<group>``):
  the same error here.

Separately (``store_silence``, on the store-watch thread of ``progress.py``): when the
store itself has not answered this rank's heartbeats for the heartbeat timeout, this rank
cannot judge its peers any more (it reads their beats from the store); it ends every
blocked wait with :class:`PeerUnresponsive` naming the store and the ranks of the other
host(s), the ones it is most likely cut off from. A shorter silence is logged.

To end the blocked wait it records the error on the group, writes the verdict for the
other ranks, dumps the flight recorder, and closes this rank's connections of the group
(a receive under a reserved tag timed out at once: the transport then fails every
pending operation of the group). The group cannot be used afterwards.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from plait import settings
from plait.comm import progress, recorder
from plait.comm.errors import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerUnresponsive,
)

if TYPE_CHECKING:
    from plait.comm.group import Call, Group

STALL_S = 0.3  # a wait blocked this long is checked (then every CHECK_EVERY_S)
CHECK_EVERY_S = 0.2
STALL_LOG_S = 1.0  # a peer silent this long (but below the timeout) is logged as a stall
DEFAULT_HEARTBEAT_TIMEOUT_S = float(settings.HEARTBEAT_TIMEOUT.default or 0)
MIN_HEARTBEAT_TIMEOUT_S = settings.HEARTBEAT_TIMEOUT.low

log = logging.getLogger("plait")

_heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT_S
_last_check: dict[int, float] = {}
_silent_since: dict[int, float] = {}  # peer -> wall time of its last beat, while silent
_stalls: list[tuple[int, float]] = []  # (peer, seconds) of stalls that ended
_store_quiet = 0.0  # longest silence of the store since it last answered (store watch)
_store_stalls: list[float] = []  # seconds of each silence of the store that ended
_fail_lock = threading.Lock()  # fail() runs on the progress and the store-watch threads


def parse_heartbeat_timeout(value: object, source: str) -> float:
    """A heartbeat timeout in seconds, or a ValueError naming ``source`` and the range."""
    return float(settings.HEARTBEAT_TIMEOUT.parse(value, source))


def configure(heartbeat_timeout: float | None) -> float:
    """Set the heartbeat timeout (``None``: ``PLAIT_HEARTBEAT_TIMEOUT`` or the default)."""
    global _heartbeat_timeout
    if heartbeat_timeout is not None:
        _heartbeat_timeout = parse_heartbeat_timeout(heartbeat_timeout, "heartbeat_timeout")
    elif os.environ.get("PLAIT_HEARTBEAT_TIMEOUT", "") != "":
        _heartbeat_timeout = parse_heartbeat_timeout(
            os.environ["PLAIT_HEARTBEAT_TIMEOUT"], "PLAIT_HEARTBEAT_TIMEOUT"
        )
    else:
        _heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT_S
    _stalls.clear()
    _silent_since.clear()
    _store_stalls.clear()
    return _heartbeat_timeout


def heartbeat_timeout() -> float:
    return _heartbeat_timeout


def stalls() -> list[tuple[int, float]]:
    """(global rank, seconds) of each peer stall this rank saw end, while it waited."""
    return list(_stalls)


def _verdict_key(group: Group) -> str:
    return f"plait/verdict/{group.name}"


def tick() -> None:
    """One round of checks over every group with a blocked wait (progress thread)."""
    now = time.monotonic()
    for g in progress.groups():
        w = g.waiting
        if w is None or g.failure is not None:
            continue
        peer, call, since = w
        if now - since < STALL_S or now - _last_check.get(id(g), 0.0) < CHECK_EVERY_S:
            continue
        _last_check[id(g)] = now
        verdict = _read_verdict(g, call)
        if verdict is not None:  # a peer decided: end this wait with its finding
            fail(g, verdict, publish=False)
            continue
        error = _diagnose(g, peer, call, now - since)
        if error is not None and g.waiting is not None and g.waiting[1] is call:
            fail(g, error)
    for r in list(_silent_since):  # a silent peer seen while waiting: did it come back?
        beat = progress.last_beat(r)
        if beat is not None and time.time() - beat <= STALL_LOG_S:
            _stall_ended(r, beat, "")


def store_silence(seconds: float, address: tuple[str, int] | None) -> bool:
    """The rendezvous store has not answered this rank's heartbeats for ``seconds``
    (store-watch thread, every ``progress.PERIOD_S``). Past the heartbeat timeout every
    blocked wait ends with :class:`PeerUnresponsive` naming the store and the ranks this
    rank is most likely cut off from; a silence longer than half of it is logged once the
    store answers again. Returns whether a wait was ended."""
    global _store_quiet
    if seconds >= _heartbeat_timeout:
        _store_quiet = max(_store_quiet, seconds)
        return _end_waits_store_lost(seconds, address)
    if seconds > store_log_s():
        _store_quiet = max(_store_quiet, seconds)
        return False
    if _store_quiet > store_log_s():  # it answered again
        quiet, _store_quiet = _store_quiet, 0.0
        _store_stalls.append(quiet)
        past = quiet >= _heartbeat_timeout
        log.warning(
            f"plait: rank {progress.beating_rank()} had no heartbeat exchange with the "
            f"rendezvous store at {_where_store(address)} for {quiet:.1f}s, then it "
            f"answered again ("
            + (
                "past the heartbeat timeout: blocked waits were ended)"
                if past
                else f"a stall, below the heartbeat timeout of {_heartbeat_timeout:g}s)"
            )
        )
    return False


def store_log_s() -> float:
    """A silence of the store longer than this is logged: half the heartbeat timeout (a
    loaded machine delays a round trip by a second now and then; that is not news)."""
    return max(STALL_LOG_S, _heartbeat_timeout / 2)


def store_stalls() -> list[float]:
    """Seconds of each silence of the store this rank saw end (see :func:`store_silence`)."""
    return list(_store_stalls)


def _where_store(address: tuple[str, int] | None) -> str:
    return f"{address[0]}:{address[1]}" if address else "(unknown address)"


def _cut_off_from(me: int) -> tuple[str, str, list[int]]:
    """(finding, advice, ranks): what this rank is most likely cut off from, judged from
    the addresses cached while the store answered."""
    mine = progress.address_of(me)
    others: dict[str, list[int]] = {}
    for r in sorted(progress.known_addresses()):
        addr = progress.address_of(r)
        if mine is not None and addr is not None and addr != mine:
            others.setdefault(addr, []).append(r)
    if not others:
        return (
            "cannot reach the rendezvous store",
            "The store's process (plait run's launcher, torchrun's agent, or the rank that "
            "hosts it: rank 0 under env://) is stopped or wedged, or this host is cut off "
            "from the store's host: look at that process and at the link.",
            [],
        )
    hosts = "; ".join(
        f"host {addr}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for addr, rs in others.items()
    )
    return (
        f"is most likely cut off from the other host(s) ({hosts})",
        "A network partition, or that host is down: check the link between the hosts.",
        [r for rs in others.values() for r in rs],
    )


def _end_waits_store_lost(seconds: float, address: tuple[str, int] | None) -> bool:
    ended = False
    for g in progress.groups():
        w = g.waiting
        if w is None or g.failure is not None:
            continue
        peer, call, since = w
        me = g.global_rank
        finding, advice, cut = _cut_off_from(me)
        on = f" on rank {peer}{progress.cached_whereabouts(peer)}" if peer is not None else ""
        error = PeerUnresponsive(
            f"{call.describe()}: rank {me} {finding}: no heartbeat exchange with the "
            f"rendezvous store at {_where_store(address)} for {seconds:.1f}s (longer than "
            f"the heartbeat timeout of {_heartbeat_timeout:g}s) while it waited{on}; rank "
            f"{me} is{progress.cached_whereabouts(me)}. {advice}{_recorder_hint()}",
            cut or ([peer] if peer is not None else []),
        )
        fail(g, error, publish=False)
        ended = True
    return ended


def _stall_ended(r: int, beat: float, during: str) -> None:
    seconds = beat - _silent_since.pop(r)
    _stalls.append((r, seconds))
    message = (
        f"plait: rank {r}{progress.whereabouts(r)} sent no heartbeat for {seconds:.1f}s, "
        f"then resumed{during} (a stall, below the heartbeat timeout of "
        f"{_heartbeat_timeout:g}s)"
    )
    log.warning(message)


def _fingerprint(seq: int, name: str, sig: str, desc: str) -> str:
    return f"{name or '(nothing yet)'} #{seq} [{sig}] {desc}".rstrip()


def _diagnose(g: Group, peer: int | None, call: Call, waited: float) -> CollectiveError | None:
    me = g.global_rank
    board = progress.read_full(g)
    mine = (call.seq, call.collective, call.sig, call.desc)
    board[me] = mine
    if call.algorithm == "p2p":  # user sends/receives are not numbered: liveness only
        return _check_heartbeats(g, peer, call, waited)
    same = {r: v for r, v in board.items() if v[0] == call.seq and v[1]}
    if g.check and any((v[1], v[2]) != (call.collective, call.sig) for v in same.values()):
        return _mismatch(g, call, same)
    # A peer past this sequence number has usually just finished it: its last messages to
    # this rank are still in flight (a loaded machine can take seconds to deliver them).
    # Only a peer that stays past it while this rank waits longer than the heartbeat
    # timeout skipped a collective (or this rank called one more).
    moved_past = peer is not None and peer in board and board[peer][0] > call.seq
    if peer is not None and moved_past and waited >= _heartbeat_timeout:
        theirs = board[peer]
        return CollectiveMismatch(
            f"{call.describe()}: rank {me} is waiting for rank {peer} in "
            f"{_fingerprint(*mine)}, but rank {peer} has already moved past #{call.seq}: it "
            f"is in {_fingerprint(*theirs)}. Either rank {peer} skipped a collective or "
            f"rank {me} called one more (a collective under `if rank == ...`, e.g. a "
            f"state_dict() or a checkpoint save on one rank only, is the usual cause). "
            f"Every rank of the group must call the same collectives in the same order."
            f"{_recorder_hint()}",
            sorted({me, peer}),
        )
    return _check_heartbeats(g, peer, call, waited)


def mismatch_on_board(g: Group, call: Call) -> CollectiveError | None:
    """The mismatch the progress board shows for ``call`` (ranks at the same sequence number
    with another collective or signature), or None. Called on a failed send or receive: a
    peer that sent a message of another size can make this rank's receive fail before
    either watchdog has looked, and the board still names the cause. One store read."""
    if not g.check or call.algorithm == "p2p":
        return None
    try:
        board = progress.read_full(g)
    except Exception:
        return None
    board[g.global_rank] = (call.seq, call.collective, call.sig, call.desc)
    same = {r: v for r, v in board.items() if v[0] == call.seq and v[1]}
    if any((v[1], v[2]) != (call.collective, call.sig) for v in same.values()):
        return _mismatch(g, call, same)
    return None


def _mismatch(g: Group, call: Call, same: dict[int, tuple[int, str, str, str]]) -> CollectiveError:
    counts: dict[tuple[str, str], list[int]] = {}
    for r, v in sorted(same.items()):
        counts.setdefault((v[1], v[2]), []).append(r)
    ranked = sorted(counts.values(), key=len, reverse=True)
    if len(ranked) > 1 and len(ranked[0]) > len(ranked[1]):
        disagreeing = sorted(r for rs in ranked[1:] for r in rs)
    else:
        disagreeing = sorted(same)
    calls = "; ".join(f"rank {r}: {_fingerprint(*same[r])}" for r in sorted(same))
    return CollectiveMismatch(
        f"{call.describe()}: the ranks of group {g.name!r} disagree on collective "
        f"#{call.seq}: {calls}. No data was exchanged (their messages carry different "
        f"tags). Every rank must call the same collectives in the same order, with the "
        f"same op, dtype, size and root (a collective under `if rank == ...`, e.g. a "
        f"state_dict() on one rank only, is the usual cause).{_recorder_hint()}",
        disagreeing,
    )


def _check_heartbeats(
    g: Group, peer: int | None, call: Call, waited: float
) -> CollectiveError | None:
    me = g.global_rank
    peers = [peer] if peer is not None else [r for r in g.ranks if r != me]
    now = time.time()
    dead = []
    for r in peers:
        beat = progress.last_beat(r)
        if beat is None:
            continue
        age = now - beat
        if age > _heartbeat_timeout:
            dead.append((r, age))
        elif age > STALL_LOG_S:
            _silent_since.setdefault(r, beat)
        elif r in _silent_since:
            _stall_ended(r, beat, f" while rank {me} waited in {call.describe()}")
    if not dead:
        return None
    names = ", ".join(
        f"rank {r}{progress.whereabouts(r)} (last heartbeat {age:.1f}s ago)" for r, age in dead
    )
    return PeerUnresponsive(
        f"{call.describe()}: rank {me} waited {waited:.1f}s on {names}, longer than the "
        f"heartbeat timeout of {_heartbeat_timeout:g}s: that process is stopped (SIGSTOP), "
        f"frozen, or its host is unreachable. Look at it (it may need SIGCONT or a kill); "
        f"raise PLAIT_HEARTBEAT_TIMEOUT or plait.init(heartbeat_timeout=...) if it is "
        f"expected to pause that long.{_recorder_hint()}",
        [r for r, _ in dead],
    )


def _recorder_hint() -> str:
    if not recorder._enabled:
        return ""
    return (
        f" Flight recorder: {recorder.directory()} (read every rank's file with "
        f"`plait doctor {recorder.directory()}`)."
    )


def _read_verdict(g: Group, call: Call) -> CollectiveError | None:
    try:
        client = progress.diagnostic_store()
        key = _verdict_key(g)
        if client is None or not client.check([key]):
            return None
        data = json.loads(client.get(key).decode())
    except Exception:
        return None
    me = g.global_rank
    if data.get("from") == me:
        return None
    message = (
        f"{call.describe()}: rank {me} gives up because rank {data['from']} found: "
        f"{data['message']}"
    )
    if data["kind"] == "CollectiveMismatch":
        return CollectiveMismatch(message, list(data["ranks"]))
    if data["kind"] == "PeerUnresponsive":
        return PeerUnresponsive(message, list(data["ranks"]))
    if data["kind"] == "CollectiveTimeout":
        return CollectiveTimeout(message, list(data["ranks"]))
    return CollectiveError(message)


def fail(
    g: Group, error: CollectiveError, *, publish: bool = True, culprit: int | None = None
) -> None:
    """Record ``error`` on ``g``, tell the other ranks (``publish``), dump the recorder,
    and end the wait (``culprit``: the global rank the shared-memory abort word names;
    this rank when None)."""
    with _fail_lock:
        if g.failure is not None:
            return
        g.failure = error
    ranks = (
        getattr(error, "disagreeing", None)
        or getattr(error, "ranks", None)
        or getattr(error, "missing", None)
        or []
    )
    try:
        client = progress.store() if publish else None
        if client is not None:
            client.set(
                _verdict_key(g),
                json.dumps(
                    {
                        "kind": type(error).__name__,
                        "from": g.global_rank,
                        "ranks": list(ranks),
                        "message": str(error),
                    }
                ),
            )
    except Exception:
        pass
    recorder.dump(f"{type(error).__name__}: {error}")
    close(g, culprit=culprit)


def close(g: Group, *, culprit: int | None = None) -> None:
    """Close this rank's connections of ``g``: every pending operation on them fails."""
    from plait.comm.group import RESERVED_TAG  # deferred: group imports watchdog

    if g.shm is not None:  # the shared-memory peers' waits end on this rank's abort word
        g.shm.abort(culprit)
    scratch = torch.zeros(1, dtype=torch.uint8)
    for r in range(g.size):
        if r == g.rank:
            continue
        try:
            g.pg.recv([scratch], r, RESERVED_TAG).wait(datetime.timedelta(milliseconds=1))
        except Exception:
            pass


def failure_for(g: Group, call: Call) -> CollectiveError | None:
    """The error a failed wait of ``call`` should raise, if the watchdog (here or on a
    peer) decided it; None otherwise. Called on error paths only."""
    if g.failure is not None:
        return g.failure
    verdict = _read_verdict(g, call)
    if verdict is not None:
        fail(g, verdict, publish=False)  # the other ranks' waits on this rank end too
    return verdict
