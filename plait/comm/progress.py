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

While a collective waits, each heartbeat is a round trip (a ``set``, then a ``check`` of
the key, which the store must answer; otherwise only the ``set``, which is buffered: a
TCPStore call holds the process's GIL until the store answers, and a round trip every
0.5 s slowed a 25-rank job on 2 cores threefold). The progress thread's client notes when
each of its calls begins and ends.
A second daemon thread, ``plait-store-watch``, never touches the store: every
``PERIOD_S`` it reads how long the store has been silent (``watchdog.store_silence``).
That is how a rank notices that it is cut off from the store's host, or that the store's
process is stopped: a TCPStore client's ``check`` on a dead link blocks past its own
timeout (torch 2.13: a ``check`` against a SIGSTOPped store never returned), so the
progress thread itself cannot be the one to tell. Silence is the time one store call of
the progress thread has been under way (or since its first failed call, while every call
since failed): a thread that merely did not get to run, or a process that was itself
stopped, says nothing about the store. Silence longer than the heartbeat timeout ends
every blocked collective wait, naming the store and the ranks on the other host(s); a
silence longer than half of it is logged when the store answers again. Nothing else
changes when the store is thought lost: readers still get their client (a false alarm must
not make a rank skip a store-based protocol step that the others wait for).
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
LEARN_PERIOD_S = 0.5  # how often the others' whereabouts are read until all are known
TROUBLED_S = 1.0  # a store call under way this long: error paths stop reading the store
SELF_GAP_S = 1.0  # the store watch itself did not run this long: this process was stopped
_stop = threading.Event()
_groups: weakref.WeakSet[Group] = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_address: tuple[str, int] | None = None
_local = threading.local()
_watch_thread: threading.Thread | None = None
_last_answer: float | None = None  # monotonic time the store last answered this process
_asking_since: float | None = None  # the progress thread's store call under way began
_failing_since: float | None = None  # its first failed call since the last answer


_namespace = ""  # key prefix in a store that outlives the attempt (see attempt_namespace)


def configure(host: str | None, port: int | None, namespace: str = "") -> None:
    """Point the board at the rendezvous store (``MASTER_ADDR``/``MASTER_PORT``); every
    key of plait's goes under ``namespace`` (``""``: none)."""
    global _address, _namespace
    _address = (host, int(port)) if host and port else None
    _namespace = namespace


def configure_from_env() -> None:
    configure(
        os.environ.get("MASTER_ADDR"),
        int(os.environ.get("MASTER_PORT", "0")) or None,
        attempt_namespace(),
    )


def attempt_namespace() -> str:
    """``"plait/attempt-<n>"`` when the store is an agent's that outlives the attempt
    (torchrun: ``TORCHELASTIC_USE_AGENT_STORE=True``; its static rendezvous keeps one store
    for every restart whatever ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` says), so a restarted
    attempt never reads the previous one's keys (a heartbeat, a verdict, a gloo address);
    ``""`` otherwise, and under ``plait run`` (``PLAIT_FRESH_STORE=1``), whose launcher
    starts a fresh store for each attempt and reads the heartbeats at their plain keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    if os.environ.get("PLAIT_FRESH_STORE") == "1":
        return ""
    return f"plait/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def store() -> Any:
    """This thread's own client of the rendezvous store (clients are not shared); None
    without a store. (A read may block for good on a lost store: the error paths read
    ``Group.failure`` first, which the store watch sets.)"""
    return _client()


def diagnostic_store() -> Any:
    """:func:`store` for reads that only explain a failure (a peer's beat, the board, a
    verdict): None while a store call of the progress thread has been under way (or
    failing) for over ``TROUBLED_S``: on a lost link such a read blocks for good, and an
    error path must end."""
    since = [t for t in (_asking_since, _failing_since) if t is not None]
    if since and time.monotonic() - min(since) > TROUBLED_S:
        return None
    return store()


def _client() -> Any:
    if _address is None:
        return None
    client = getattr(_local, "store", None)
    if client is None:
        timed = threading.current_thread().name == "plait-progress"
        if timed:
            _asking(True)
        try:
            client = dist.TCPStore(
                _address[0], _address[1], is_master=False, timeout=datetime.timedelta(seconds=5)
            )
        except Exception:
            if timed:
                _asking(False, ok=False)
            raise
        if _namespace:
            client = dist.PrefixStore(_namespace, client)
        if timed:
            _asking(False)
            client = _Timed(client)
        _local.store = client
    return client


class _Timed:
    """The progress thread's store client: the store watch sees when each call began, and
    whether the store answered (see the module docstring)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            _asking(True)
            try:
                out = method(*args, **kwargs)
            except Exception:
                _asking(False, ok=False)
                raise
            _asking(False)
            return out

        return call


def _asking(start: bool, *, ok: bool = True) -> None:
    """A store call of the progress thread begins (``start``) or ends (answered if ``ok``)."""
    global _asking_since, _failing_since
    now = time.monotonic()
    if start:
        _asking_since = now
        return
    _asking_since = None
    if ok:
        _failing_since = None
        answered()
    elif _failing_since is None:
        _failing_since = now


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
    client = _client()
    if client is None:
        return
    if _me != global_rank:
        client.set(where_key(global_rank), f"{socket.gethostname()} {os.getpid()} {_my_address()}")
        _me = global_rank
    key = heartbeat_key(global_rank)
    client.set(key, f"{time.time():.3f}")
    if any(g.waiting is not None for g in groups()):
        # A set is only buffered; the store must answer this. Only while a collective
        # waits (what a lost store would end): a TCPStore call holds this process's GIL
        # until the store answers (a loaded store stalled 25-rank jobs by seconds).
        client.check([key])


def answered() -> None:
    """The store answered a request of this process just now."""
    global _last_answer
    _last_answer = time.monotonic()


def last_answer() -> float | None:
    """Monotonic time the store last answered a heartbeat; None before the first."""
    return _last_answer


def _my_address() -> str:
    """The local address this host reaches the store from (a UDP connect sends nothing)."""
    if _address is None:
        return "?"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((_address[0], _address[1] or 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "?"


_beating: int | None = None  # the global rank whose heartbeat this process writes


def last_beat(global_rank: int) -> float | None:
    """Wall-clock time of rank ``global_rank``'s last heartbeat; None if unknown."""
    try:
        client = diagnostic_store()
        key = heartbeat_key(global_rank)
        if client is None or not client.check([key]):
            return None
        return float(client.get(key).decode())
    except Exception:
        return None


_addresses: dict[int, str] = {}  # global rank -> address it reaches the store from


def whereabouts(global_rank: int) -> str:
    """``" (host H, address A, pid P)"`` for a rank that published it, else ``""``."""
    if global_rank not in _where and (diagnostic_store() is None or not _learn_where(global_rank)):
        return ""
    return _where[global_rank]


def cached_whereabouts(global_rank: int) -> str:
    """:func:`whereabouts` from the cache only (never asks the store)."""
    return _where.get(global_rank, "")


def known_addresses() -> list[int]:
    """Global ranks whose address is cached."""
    return list(_addresses)


def beating_rank() -> int | None:
    """The global rank whose heartbeat this process writes."""
    return _beating


def address_of(global_rank: int) -> str | None:
    """The address rank ``global_rank`` reaches the store from, if known (cached)."""
    return _addresses.get(global_rank)


def _learn_where(global_rank: int) -> bool:
    try:
        client = store()
        key = where_key(global_rank)
        if client is None or not client.check([key]):
            return False
        host, pid, addr = (client.get(key).decode().split(" ") + ["?", "?"])[:3]
    except Exception:
        return False
    if addr != "?":
        _addresses[global_rank] = addr
        _where[global_rank] = f" (host {host}, address {addr}, pid {pid})"
    else:
        _where[global_rank] = f" (host {host}, pid {pid})"
    return True


def _learn_every_where() -> bool:
    """Cache every registered group's ranks' whereabouts while the store answers (a rank
    cut off from it later still names the others); True once all are known."""
    ranks = {r for g in groups() for r in g.ranks}
    return all([r in _where or _learn_where(r) for r in sorted(ranks)])  # tries each


def register(group: Group) -> None:
    global _thread, _beating, _watch_thread
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
        if _watch_thread is None and _address is not None:
            _watch_thread = threading.Thread(
                target=_watch_store_forever, name="plait-store-watch", daemon=True
            )
            _watch_thread.start()


def groups() -> list[Group]:
    with _lock:
        return list(_groups)


def stop() -> None:
    """Stop the daemon thread and wait (briefly) until it is out of any store call.

    Called by ``plait.shutdown`` and at interpreter exit, so no thread of plait is
    inside the store or the backend while the process tears down."""
    global _thread, _watch_thread, _last_answer, _asking_since, _failing_since
    with _lock:
        thread, _thread = _thread, None
        watch, _watch_thread = _watch_thread, None
    _stop.set()
    for t in (thread, watch):
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
    _last_answer = _asking_since = _failing_since = None
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
    from plait.comm import watchdog  # deferred: watchdog imports progress

    published: dict[int, tuple[int, str, str, str]] = {}
    next_beat = 0.0
    failures = 0
    everyone_known = False
    next_learn = 0.0
    while not _stop.wait(PERIOD_S):
        try:
            now = time.monotonic()
            if now >= next_beat:
                beat(global_rank)
                next_beat = now + HEARTBEAT_PERIOD_S
            if not everyone_known and now >= next_learn:  # seldom: O(world) reads each
                everyone_known = _learn_every_where()
                next_learn = now + LEARN_PERIOD_S
            publish_all(published)
            failures = 0
        except Exception:  # the store is unreachable: keep trying (the store watch decides)
            failures += 1
            _local.store = None  # reconnect next time
            if failures > 100 and not any(g.waiting for g in groups()):
                return  # long without a store and nothing waits: the job is over
            time.sleep(min(1.0, 0.1 * failures))
            continue
        try:
            watchdog.tick()
        except Exception:
            pass


def _watch_store_forever() -> None:
    """How long the store has been silent, every ``PERIOD_S`` (never touches the store):
    the time since the progress thread's store call under way began, or since its first
    failed call when every call since has failed; zero between calls. A thread that merely
    did not get to run (a loaded machine, the GIL held elsewhere) says nothing about the
    store, nor time during which this whole process was stopped."""
    from plait.comm import watchdog  # deferred: watchdog imports progress

    last_tick = time.monotonic()
    resumed = 0.0  # this process ran again after a gap: count the store's silence from here
    warned = False
    while not _stop.wait(PERIOD_S):
        now = time.monotonic()
        if now - last_tick > SELF_GAP_S:
            resumed = now
        last_tick = now
        if _last_answer is None:
            continue
        since = [t for t in (_asking_since, _failing_since) if t is not None]
        silence = now - max(min(since), resumed) if since else 0.0
        try:
            watchdog.store_silence(silence, _address)
        except Exception as exc:  # the watch must keep running; say once that it failed
            if not warned:
                warned = True
                watchdog.log.warning(
                    "plait store watch: checking the store's silence failed: %r", exc
                )


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
        client = diagnostic_store()
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
