"""One job per checkpoint root: ``root/owner.json`` names the job whose coordinator saves
there, so two jobs given the same root are refused instead of pruning each other's steps
and pointing ``latest`` at each other's weights.

The coordinator (group rank 0) claims the root before every save (``writer.py``, before
``transaction.prepare`` touches anything). The owner file holds the job id
(``PLAIT_JOB_ID`` under ``plait run``, ``TORCHELASTIC_RUN_ID`` under torchrun, else one id
per process), the host, its boot id, the pid and its start time. A claim succeeds when
there is no owner, the owner is this job (a restart of it included), or the owner's
process is gone (same host and boot: its pid no longer runs the same process); the file
is then written anew (atomically). Otherwise :class:`OwnedByAnotherJob` names both jobs.
An owner on another host cannot be checked from here: the error says to delete
``owner.json`` once that job has ended. Nothing here communicates.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from plait.checkpoint.agree import CheckpointError
from plait.checkpoint.files import write_bytes_atomic

OWNER = "owner.json"
_PROCESS_JOB = f"process-{uuid.uuid4().hex[:12]}"


class OwnedByAnotherJob(CheckpointError):
    """The checkpoint root belongs to another job that still runs."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "?"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('?' if unknown or gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def job_id() -> str:
    """This job's id: ``PLAIT_JOB_ID``, else ``TORCHELASTIC_RUN_ID``, else this process's."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return os.environ.get("PLAIT_JOB_ID") or (run if run not in ("", "none") else _PROCESS_JOB)


def me() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "job": job_id(),
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid": pid,
        "start": _start_time(pid),
    }


def _describe(o: dict[str, Any]) -> str:
    return f"job {o.get('job')!r} (pid {o.get('pid')} on host {o.get('host')})"


def _ended(o: dict[str, Any]) -> bool | None:
    """True when the owner's process is gone, False when it runs, None when it cannot be
    told (another host)."""
    if o.get("host") != socket.gethostname() or o.get("boot") != _boot_id():
        return None if o.get("host") != socket.gethostname() else True  # rebooted: gone
    return _start_time(int(o.get("pid", -1))) != o.get("start")


def claim(root: Path) -> None:
    """Make this job the owner of ``root`` or raise :class:`OwnedByAnotherJob`."""
    path = root / OWNER
    mine = me()
    try:
        owner = json.loads(path.read_text())
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError):
        owner = None  # damaged: rewritten below
    if owner is not None and owner.get("job") != mine["job"]:
        ended = _ended(owner)
        if ended is not True:
            how = (
                "it still runs"
                if ended is False
                else "it runs on another host, so whether it still runs cannot be told from "
                f"here; once it has ended, delete {path}"
            )
            raise OwnedByAnotherJob(
                f"checkpoint root {root} belongs to {_describe(owner)}, and {how}; this is "
                f"{_describe(mine)}. Two jobs saving into one root would prune each other's "
                f"steps and point 'latest' at each other's weights: give each job its own "
                f"root"
            )
    if owner is None or {k: v for k, v in owner.items() if k != "since"} != mine:
        write_bytes_atomic(path, (json.dumps({**mine, "since": time.time()}) + "\n").encode())


__all__ = ["OWNER", "OwnedByAnotherJob", "claim", "job_id"]
