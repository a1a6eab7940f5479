"""A rank's process seen from the launcher: its kernel state (:func:`proc_state`), how it
ended (:func:`describe_exit`, with the likely cause of a SIGBUS), and what a job's ranks
leave behind: processes whose environment carries the job's ``PLAIT_JOB_ID``
(:func:`leftovers`) and shared-memory segments named by a rank's pid, both removed by
:func:`sweep`."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from plait.comm import transport

# how often the launcher looks at its ranks (and at what they left), in seconds
POLL_S = 0.05


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, T = stopped, Z, ...), or '?'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"was killed by signal {-code}"
        return f"was killed by {name}" + (bus_hint() if -code == signal.SIGBUS else "")
    return f"exited with code {code}"


def bus_hint() -> str:
    """Why a rank may die of SIGBUS: a page of a memory-mapped file that could not be
    backed, most often a full shared-memory directory; with its free and total bytes."""

    directory = transport.segment_dir()
    try:
        st = os.statvfs(directory)
        room = f"{st.f_bavail * st.f_frsize:,} of {st.f_blocks * st.f_frsize:,} bytes free now"
    except OSError:
        room = "not readable"
    return (
        f" (a memory-mapped page could not be backed: most often {directory} is full, "
        f"{room}; plait's segments are reserved at group creation, so look for another "
        f"mapping, e.g. DataLoader workers' shared tensors, or enlarge {directory})"
    )


def leftovers(job_id: str, *, exclude: set[int]) -> list[tuple[int, str]]:
    """(pid, command name) of every live process whose environment has
    ``PLAIT_JOB_ID=<job_id>``, except ``exclude`` (Linux ``/proc``; none elsewhere)."""
    marker = f"PLAIT_JOB_ID={job_id}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if marker in environ and proc_state(int(entry)) not in ("Z", "X", "?"):
            found.append((int(entry), name))
    return found


def sweep(job_id: str, *, pids: set[int], shm_dir: str | None) -> tuple[list[str], list[str]]:
    """Kill every process the ranks left behind and remove every shared-memory segment
    a rank (``pids``) created; say so on stderr. Returns (processes, segments).

    A rank's descendants carry the job's ``PLAIT_JOB_ID`` in their environment
    (whatever their process group or session): those still alive once every rank has
    exited are SIGCONT+SIGKILLed, whether the job failed or succeeded. A segment of
    ``PLAIT_SHM_DIR`` (``plait-shm-<pid>-...``) named by a rank's pid was left by a rank
    killed inside the shared-memory set-up (``plait/comm/transport.py``).
    """

    killed: list[str] = []
    for _ in range(5):  # a dying process's children appear as it dies
        found = leftovers(job_id, exclude={os.getpid(), *pids})
        if not found:
            break
        for pid, name in found:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            killed.append(f"pid {pid} ({name})")
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(
            proc_state(p) not in ("Z", "X", "?") for p, _ in found
        ):
            time.sleep(POLL_S)
    if killed:
        print(
            f"plait run: killed {len(killed)} process(es) the ranks left running (their "
            f"environment carries PLAIT_JOB_ID={job_id}): {', '.join(killed)}",
            file=sys.stderr,
            flush=True,
        )
    directory = shm_dir or transport.segment_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        m = transport.STALE_NAME.match(name)
        if m is None or int(m.group(1)) not in pids:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    if removed:
        print(
            f"plait run: removed {len(removed)} shared-memory segment(s) left by ranks "
            f"that ended inside the shared-memory set-up: {', '.join(removed)}",
            file=sys.stderr,
            flush=True,
        )
    return killed, removed
