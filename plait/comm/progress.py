"""Where every rank is: a progress board in the rendezvous store.

A daemon thread publishes, a few times a second, the last collective each group on this
rank entered (``plait/progress/<group>/<rank> = "<seq> <collective>"``). The board costs
the collectives nothing: entering a collective only sets a tuple on its group. When a
collective times out, the rank that timed out reads its peers' entries and names the
ranks that never reached that sequence number.
"""

from __future__ import annotations

import datetime
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from plait.comm.group import Group

PERIOD_S = 0.1
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


def register(group: Group) -> None:
    global _thread
    with _lock:
        _groups.add(group)
        if _thread is None and _address is not None:
            _thread = threading.Thread(target=_publish_forever, name="plait-progress", daemon=True)
            _thread.start()


def unregister(group: Group) -> None:
    with _lock:
        _groups.discard(group)


def _publish_forever() -> None:
    published: dict[int, tuple[int, str]] = {}
    event = threading.Event()
    while True:
        event.wait(PERIOD_S)
        try:
            publish_all(published)
        except Exception:  # the store went away (shutdown, rank 0 exited): stop quietly
            return


def publish_all(published: dict[int, tuple[int, str]] | None = None) -> None:
    client = store()
    if client is None:
        return
    with _lock:
        groups = list(_groups)
    for g in groups:
        entered = g.entered
        if published is not None and published.get(id(g)) == entered:
            continue
        client.set(_key(g, g.global_rank), f"{entered[0]} {entered[1]}")
        if published is not None:
            published[id(g)] = entered


def read(group: Group) -> dict[int, tuple[int, str]]:
    """Last published (seq, collective) of each rank of ``group``; unknown ranks omitted."""
    try:
        publish_all()
        client = store()
        if client is None:
            return {}
        board = {}
        for r in group.ranks:
            key = _key(group, r)
            if client.check([key]):
                seq, _, name = client.get(key).decode().partition(" ")
                board[r] = (int(seq), name)
        return board
    except Exception:
        return {}


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
