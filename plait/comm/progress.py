"""Where every rank is, and whether it is alive: a progress board and heartbeats in the
rendezvous store.

One daemon thread per process (never on the collectives' path) writes, through its own
store client:

* the board, every ``PERIOD_S`` (0.1 s) when it changed: the last collective each group
  on this rank entered, ``plait/progress/<group>/<global rank>`` =
  ``"<seq> <collective>\t<signature>\t<shapes>"``. Entering a collective only sets a
  tuple on its group. A rank whose collective stalls or times out reads its peers'
  entries to name the ranks that disagree with it or never reached it (``watchdog.py``).
* a heartbeat, every ``HEARTBEAT_PERIOD_S`` (0.5 s): ``plait/heartbeat/<global rank>`` =
  the decimal wall-clock time (``time.time()``, e.g. ``"1763880000.125"``) of the last
  beat, and once ``plait/heartbeat/<global rank>/where`` = ``"<host> <pid>"``. A rank
  waiting in a collective on a peer whose beat is older than the heartbeat timeout
  (``PLAIT_HEARTBEAT_TIMEOUT``, default 5 s) raises, naming it; the launcher may read the
  same keys from its own client of the store.

Then the thread runs the watchdog's checks (``watchdog.tick``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from plait.comm.group import Group

PERIOD_S = 0.1
HEARTBEAT_PERIOD_S = 0.5
_stop = threading.Event()
_groups: weakref.WeakSet[Group] = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_address: tuple[str, int] | None = None
_local = threading.local()


def configure(host: str | None, port: int | None) -> None:
    """Point the board at the rendezvous store (``MASTER_ADDR``/``MASTER_PORT``)."""
    global _address
    _address = (host, int(port)) if host and port else None


def configure_from_env() -> None:
    configure(os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", "0")) or None)


def store() -> Any:
    """This thread's own client of the rendezvous store (clients are not shared)."""
    if _address is None:
        return None
    client = getattr(_local, "store", None)
    if client is None:
        client = dist.TCPStore(
            _address[0], _address[1], is_master=False, timeout=datetime.timedelta(seconds=5)
        )
        _local.store = client
    return client


def _key(group: Group, global_rank: int) -> str:
    return f"plait/progress/{group.name}/{global_rank}"


def heartbeat_key(global_rank: int) -> str:
    """Store key holding rank ``global_rank``'s last beat (decimal ``time.time()``)."""
    return f"plait/heartbeat/{global_rank}"


def where_key(global_rank: int) -> str:
    """Store key holding ``"<host> <pid>"`` of rank ``global_rank``."""
    return f"plait/heartbeat/{global_rank}/where"


_me: int | None = None
_where: dict[int, str] = {}


def beat(global_rank: int) -> None:
    """Publish one heartbeat of this process (rank ``global_rank``)."""
    global _me
    client = store()
    if client is None:
        return
    if _me != global_rank:
        client.set(where_key(global_rank), f"{socket.gethostname()} {os.getpid()}")
        _me = global_rank
    client.set(heartbeat_key(global_rank), f"{time.time():.3f}")


_beating: int | None = None  # the global rank whose heartbeat this process writes


def last_beat(global_rank: int) -> float | None:
    """Wall-clock time of rank ``global_rank``'s last heartbeat; None if unknown."""
    try:
        client = store()
        key = heartbeat_key(global_rank)
        if client is None or not client.check([key]):
            return None
        return float(client.get(key).decode())
    except Exception:
        return None


def whereabouts(global_rank: int) -> str:
    """``" (host H, pid P)"`` for a rank that published it, else ``""``."""
    if global_rank not in _where:
        try:
            client = store()
            key = where_key(global_rank)
            if client is None or not client.check([key]):
                return ""
            host, _, pid = client.get(key).decode().partition(" ")
            _where[global_rank] = f" (host {host}, pid {pid})"
        except Exception:
            return ""
    return _where[global_rank]


def register(group: Group) -> None:
    global _thread, _beating
    with _lock:
        _groups.add(group)
        if _thread is None and _address is not None:
            _beating = group.global_rank
            _stop.clear()
            _thread = threading.Thread(
                target=_publish_forever,
                args=(group.global_rank,),
                name="plait-progress",
                daemon=True,
            )
            _thread.start()


def groups() -> list[Group]:
    with _lock:
        return list(_groups)


def stop() -> None:
    """Stop the daemon thread and wait (briefly) until it is out of any store call.

    Called by ``plait.shutdown`` and at interpreter exit, so no thread of plait is
    inside the store or the backend while the process tears down."""
    global _thread
    with _lock:
        thread, _thread = _thread, None
    _stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2.0)
    if thread is not None and _beating is not None:
        try:  # a launcher stops watching this rank's heartbeat: it did not freeze
            client = store()
            if client is not None:
                client.set(heartbeat_key(_beating) + "/done", "1")
        except Exception:
            pass


atexit.register(stop)


def unregister(group: Group) -> None:
    with _lock:
        _groups.discard(group)


def _publish_forever(global_rank: int) -> None:
    from plait.comm import watchdog

    published: dict[int, tuple[int, str, str, str]] = {}
    next_beat = 0.0
    failures = 0
    lost_since: float | None = None
    while not _stop.wait(PERIOD_S):
        try:
            now = time.monotonic()
            if now >= next_beat:
                beat(global_rank)
                next_beat = now + HEARTBEAT_PERIOD_S
            publish_all(published)
            failures = 0
        except Exception:  # the store is unreachable: keep trying
            failures += 1
            _local.store = None  # reconnect next time
            if lost_since is None:
                lost_since = time.monotonic()
            try:
                if watchdog.store_lost(time.monotonic() - lost_since, _address):
                    return  # every blocked wait was ended; the job is over here
            except Exception:
                pass
            if failures > 100 and not any(g.waiting for g in groups()):
                return  # long without a store and nothing waits: the job is over
            continue
        lost_since = None
        try:
            watchdog.tick()
        except Exception:
            pass


def publish_all(published: dict[int, tuple[int, str, str, str]] | None = None) -> None:
    client = store()
    if client is None:
        return
    with _lock:
        groups = list(_groups)
    for g in groups:
        entered = g.entered
        if published is not None and published.get(id(g)) == entered:
            continue
        seq, name, sig, desc = entered
        client.set(_key(g, g.global_rank), f"{seq} {name}\t{sig}\t{desc}")
        if published is not None:
            published[id(g)] = entered


def read_full(group: Group, publish: bool = True) -> dict[int, tuple[int, str, str, str]]:
    """Last published (seq, collective, signature, shapes) of each rank of ``group``;
    unknown ranks omitted."""
    try:
        if publish:
            publish_all()
        client = store()
        if client is None:
            return {}
        board = {}
        for r in group.ranks:
            key = _key(group, r)
            if client.check([key]):
                head, _, rest = client.get(key).decode().partition("\t")
                sig, _, desc = rest.partition("\t")
                seq, _, name = head.partition(" ")
                board[r] = (int(seq), name, sig, desc)
        return board
    except Exception:
        return {}


def read(group: Group) -> dict[int, tuple[int, str]]:
    """Last published (seq, collective) of each rank of ``group``; unknown ranks omitted."""
    return {r: (v[0], v[1]) for r, v in read_full(group).items()}


def missing_ranks(group: Group, seq: int) -> list[int]:
    """Ranks of ``group`` whose last entered collective is before ``seq``."""
    board = read(group)
    return [r for r in group.ranks if board.get(r, (0, ""))[0] < seq]


def describe(group: Group) -> str:
    board = read(group)
    if not board:
        return ""
    parts = [
        f"rank {r} at #{board[r][0]} {board[r][1] or '(none yet)'}"
        if r in board
        else f"rank {r} unknown"
        for r in group.ranks
    ]
    return "Last collective entered: " + ", ".join(parts) + ". "
