"""Flight recorder: each rank's last collectives, dumped to a file when one fails.

Every collective issued on a group appends one entry to a ring buffer of the last
``PLAIT_RECORDER_SIZE`` (default 2000; 0 turns it off) with its group, sequence number,
collective, algorithm, bytes, signature, state (``started`` -> ``completed`` or
``failed``) and wall-clock start/end times. Appending is a few attribute writes; nothing
leaves the process until a collective fails with a :class:`CollectiveError` (a timeout,
a mismatch, a stopped or dead peer): then the rank writes the buffer as JSON to
``<PLAIT_RECORDER_DIR>/rank<global rank>.json``. ``plait run`` sets that directory per
attempt, ``plait-recorder-<job id>/attempt-<n>`` under the system temporary directory; its
failure report names it, and a successful attempt's folder is removed. ``plait.spawn``
and ``RankPool`` give their ranks ``plait-recorder-pool-<pid>-<port>``: a failed run's
``RankError`` names it, a pool closed without naming it removes it. Under torchrun the
default is ``plait-recorder-<MASTER_PORT>`` there. The error message names the directory.
``plait doctor DIR`` (``plait/launch/doctor.py``) reads every rank's file and names the first
collective the ranks disagree on, or the ranks that never reached it.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait import settings

if TYPE_CHECKING:
    from plait.comm.group import Call

DEFAULT_SIZE = int(settings.RECORDER_SIZE.default or 0)


class Entry:
    """One collective as this rank saw it."""

    __slots__ = (
        "group",
        "seq",
        "collective",
        "algorithm",
        "bytes",
        "sig",
        "desc",
        "state",
        "start",
        "end",
    )

    def __init__(self, call: Call) -> None:
        self.group = call.group.name
        self.seq = call.seq
        self.collective = call.collective
        self.algorithm = call.algorithm
        self.bytes = call.payload_bytes
        self.sig = call.sig
        self.desc = call.desc
        self.state = "started"
        self.start = time.time()
        self.end: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def size_from_env() -> int:
    """``PLAIT_RECORDER_SIZE`` (checked: 0 .. 1,000,000 collectives), else the default."""
    return int(settings.RECORDER_SIZE.read())


def check_directory() -> None:
    """Refuse a ``PLAIT_RECORDER_DIR`` the dumps could not be written into (``plait.init``
    calls it: :func:`dump` runs on error paths and never raises, too late to say so)."""
    why = settings.recorder_dir_problem(os.environ.get("PLAIT_RECORDER_DIR", ""))
    if why is not None:
        raise ValueError(why)


_buffer: collections.deque[Entry] = collections.deque(maxlen=DEFAULT_SIZE)
_enabled = True
_dumped: set[str] = set()
_lock = threading.Lock()
_rank: int = 0


def configure(*, rank: int, size: int | None = None) -> None:
    """Size the ring buffer (``PLAIT_RECORDER_SIZE`` when ``size`` is None); forget old
    entries. Called by ``plait.init``."""
    global _buffer, _enabled, _rank
    n = size_from_env() if size is None else size
    _enabled = n > 0
    _buffer = collections.deque(maxlen=max(n, 1))
    _rank = rank
    _dumped.clear()


def start(call: Call) -> Entry | None:
    if not _enabled:
        return None
    entry = Entry(call)
    _buffer.append(entry)
    return entry


def end(entry: Entry | None, state: str) -> None:
    if entry is not None:
        entry.state = state
        entry.end = time.time()


def directory() -> Path:
    env = os.environ.get("PLAIT_RECORDER_DIR")
    if env:
        return Path(env)
    port = os.environ.get("MASTER_PORT", "0")
    return Path(tempfile.gettempdir()) / f"plait-recorder-{port}"


def path(rank: int | None = None) -> Path:
    return directory() / f"rank{_rank if rank is None else rank}.json"


def entries() -> list[dict[str, Any]]:
    return [e.as_dict() for e in list(_buffer)]


def dump(reason: str) -> Path | None:
    """Write this rank's buffer with every failure reason seen so far (a later failure
    rewrites the file, its reason added). Never raises: it runs on error paths."""
    if not _enabled:
        return None
    try:
        target = path()
        with _lock:
            reasons = sorted(_dumped | {reason[:2000]})
            _dumped.add(reason[:2000])
            target.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "rank": _rank,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "time": time.time(),
                "reasons": reasons,
                "entries": entries(),
            }
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(payload, indent=0))
            os.replace(tmp, target)
        return target
    except Exception:
        return None
