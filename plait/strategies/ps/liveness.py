"""Is a parameter-server peer alive? Read from the heartbeats in the rendezvous store.

Every plait rank's progress thread writes ``plait/heartbeat/<global rank>`` = the decimal
``time.time()`` of its last beat, about every 0.5 s (see :mod:`plait.comm.progress`). A
peer whose last beat is older than the heartbeat timeout (``PLAIT_HEARTBEAT_TIMEOUT``,
default 5 s) is stopped, frozen or gone. The parameter server uses this, never a receive
timeout, to tell a slow worker from a dead one: a gloo receive that times out fails every
connection of the process, healthy peers included.

A rank that never published a beat (no store, or heartbeats not running) is unknown and
treated as alive: a process that died still closes its connections, which the transport
reports at once; only a hung peer then goes unnoticed.

Also here: the store key by which an asynchronous worker tells ``plait run`` that it may
die without ending the job (``plait/launch/may_exit/<global rank>`` = ``"1"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from plait.comm import progress, watchdog

DEFAULT_TIMEOUT_S = watchdog.DEFAULT_HEARTBEAT_TIMEOUT_S


def heartbeat_key(global_rank: int) -> str:
    return f"plait/heartbeat/{global_rank}"


def may_exit_key(global_rank: int) -> str:
    return f"plait/launch/may_exit/{global_rank}"


def heartbeat_timeout() -> float:
    """Seconds without a beat after which a peer counts as dead: the process's heartbeat
    timeout (``plait.init(heartbeat_timeout=...)``, else ``PLAIT_HEARTBEAT_TIMEOUT``,
    checked there, else 5)."""
    return float(watchdog.heartbeat_timeout())


def last_beat(global_rank: int, client: Any = None) -> float | None:
    """``time.time()`` of ``global_rank``'s last heartbeat; None if none is known."""
    try:
        client = client if client is not None else progress.store()
        key = heartbeat_key(global_rank)
        if client is None or not client.check([key]):
            return None
        return float(client.get(key).decode())
    except Exception:
        return None


class Liveness:
    """``dead(rank)``: why ``rank`` counts as dead (its heartbeat is older than
    ``timeout`` seconds), or None while it beats or was never seen beating.

    ``read`` (default: the store) maps a global rank to its last beat; tests pass their own.
    """

    def __init__(
        self,
        *,
        timeout: float | None = None,
        read: Callable[[int], float | None] | None = None,
    ) -> None:
        self.timeout = heartbeat_timeout() if timeout is None else float(timeout)
        self._read = read if read is not None else last_beat

    def age(self, global_rank: int) -> float | None:
        beat = self._read(global_rank)
        return None if beat is None else max(0.0, time.time() - beat)

    def dead(self, global_rank: int) -> str | None:
        age = self.age(global_rank)
        if age is None or age <= self.timeout:
            return None
        return (
            f"no heartbeat for {age:.1f}s (more than the {self.timeout:g}s heartbeat "
            f"timeout): the process is stopped, frozen or gone"
        )


def allow_exit(global_rank: int) -> bool:
    """Tell ``plait run`` that this rank may die without ending the job; False if there
    is no store to tell."""
    try:
        client = progress.store()
        if client is None:
            return False
        client.set(may_exit_key(global_rank), "1")
        return True
    except Exception:
        return False
