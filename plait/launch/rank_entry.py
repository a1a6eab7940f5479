"""How ``plait run`` starts a rank: ``python -m plait.launch.rank_entry script.py args...``.

Before the script runs, the rank

1. dies with its launcher (:mod:`plait.launch.lifeline`; also armed between fork and exec);
2. checks it reached its own job's store, claims its rank and waits for the world to fill
   (:func:`plait.launch.rendezvous.preflight`; bounded by ``PLAIT_RENDEZVOUS_TIMEOUT``, default
   300 s, and ``PLAIT_CONNECT_TIMEOUT``, default 30 s, for reaching the store).

Then the script runs as ``__main__``, exactly as ``python script.py args`` would run it. If it
raises, the traceback goes to ``PLAIT_ERROR_FILE`` (JSON: rank, pid, host, time, exception
and traceback) for the launcher, which prints the root cause once for the whole job; the
rank's own stderr gets one line, and the exit code is 1.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from plait import settings
from plait.launch import lifeline, rendezvous

# Exceptions a rank raises because *another* rank failed (a closed connection, a collective
# that timed out waiting for a peer): consequences, never the root cause.
CONSEQUENCE_TYPES = (
    "CollectiveError",
    "CollectiveTimeout",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "BrokenPipeError",
    "ConnectionResetError",
    "PeerFailure",
)
CONSEQUENCE_TEXT = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh",
    "Socket Timeout",
    "timed out waiting",
    "heartbeat",
)


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a reaction to another rank's failure."""
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc)
    return bool(names & set(CONSEQUENCE_TYPES)) or any(s in text for s in CONSEQUENCE_TEXT)


def write_error(path: str, exc: BaseException) -> None:
    """Record ``exc`` (with the traceback being handled) for the launcher."""
    entry = {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0] if str(exc) else "",
        "consequence": is_consequence(exc),
        "traceback": traceback.format_exc(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entry, f)
    os.replace(tmp, path)


def _preflight() -> Any:
    """The store client (kept for :func:`_beat_done`) after the rendezvous checks."""

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    connect_s = float(settings.CONNECT_TIMEOUT.read())  # checked: a bad value is named
    rendezvous_s = float(settings.RENDEZVOUS_TIMEOUT.read())
    store = rendezvous.connect(
        addr, port, timeout=connect_s, rank=rank, setting=settings.CONNECT_TIMEOUT.name
    )
    rendezvous.preflight(
        store,
        addr=addr,
        port=port,
        rank=rank,
        world_size=world_size,
        job_id=os.environ.get("PLAIT_JOB_ID"),
        timeout=rendezvous_s,
        setting=settings.RENDEZVOUS_TIMEOUT.name,
    )
    return store


def _beat_done(store: Any) -> None:
    """Tell the launcher this rank's script is over (``plait/heartbeat/<rank>/done``), so
    the seconds the interpreter takes to exit are never mistaken for a frozen rank."""
    if store is None:
        return
    try:
        store.set(f"plait/heartbeat/{os.environ['RANK']}/done", "1")
    except Exception:  # the launcher's store is gone: nobody is watching
        pass


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m plait.launch.rank_entry script.py [args...]", file=sys.stderr)
        return 2
    lifeline.arm_from_env()
    script = argv[0]
    error_file = os.environ.get("PLAIT_ERROR_FILE")
    rank = os.environ.get("RANK", "?")
    store = None
    try:
        if os.environ.get("PLAIT_JOB_ID"):
            store = _preflight()
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(script).resolve().parent))
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        _beat_done(store)
        raise
    except BaseException as exc:
        _beat_done(store)
        if not error_file:
            raise
        write_error(error_file, exc)
        print(
            f"rank {rank} (pid {os.getpid()}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''} (traceback in plait run's report)",
            file=sys.stderr,
            flush=True,
        )
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    _beat_done(store)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
