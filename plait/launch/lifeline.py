"""Ranks die with their launcher: a rank never outlives the process that started it.

A launcher killed with ``kill -9`` cannot stop its ranks, so each rank arranges its own
end, in two ways:

- ``plait run`` starts each rank with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` set between fork
  and exec (:func:`preexec`, Linux): the kernel kills the rank the moment the launcher
  dies. The launcher forks from its main thread, which lives as long as it does (the
  kernel ties the death signal to the *thread* that forked, not to the process).
- :func:`arm` (``plait.spawn`` ranks at start-up; ``plait.init`` under torchrun, whose
  agent may start workers from any thread) starts a daemon thread that polls ``getppid()``
  every half second and kills the process when the parent has changed (it was re-parented:
  its parent died). Also the fallback where prctl is unavailable.

The parent is checked once right after arming, so a launcher that died in between is
noticed too. Nothing here communicates.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_armed_for: int | None = None


def _prctl_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, sig: int) -> None:
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
            return


def arm(parent_pid: int | None = None, *, sig: int = signal.SIGKILL) -> None:
    """Make this process receive ``sig`` (default SIGKILL) within half a second of its
    parent process's death (a watcher thread polling ``getppid()``).

    ``parent_pid``: the launcher's pid, when known (``PLAIT_LAUNCHER_PID``); if the
    current parent is already another process, the launcher is gone and the signal is
    sent at once. Idempotent; never raises.
    """
    global _armed_for
    parent = os.getppid()
    if _armed_for == parent:
        return
    _armed_for = parent
    threading.Thread(
        target=_watch_parent, args=(parent, sig), name="plait-lifeline", daemon=True
    ).start()
    if parent_pid is not None and parent != parent_pid:
        os.kill(os.getpid(), sig)  # the launcher died before we armed


def arm_from_env() -> None:
    """:func:`arm` with the launcher's pid from ``PLAIT_LAUNCHER_PID`` (if set).

    For ``plait.init``: under torchrun the parent is the elastic agent, so a ``kill -9``
    of the agent ends the ranks instead of leaving them training.
    """
    pid = os.environ.pop("PLAIT_LAUNCHER_PID", None)  # not for this rank's own children
    arm(int(pid) if pid and pid.isdigit() else None)


def preexec(launcher_pid: int, sig: int = signal.SIGKILL) -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: own process group, die with the launcher.

    Runs in the child between fork and exec; the death signal survives exec.
    """
    os.setpgid(0, 0)
    _prctl_pdeathsig(sig)
    if os.getppid() != launcher_pid:
        os._exit(1)
