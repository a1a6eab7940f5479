"""One attempt of a ``plait run`` job: start N local ranks, watch them, stop them.

The launcher hosts a fresh rendezvous store for every attempt (a free loopback port, or
``--master-port``), writes the job's nonce into it (:mod:`plait.launch.rendezvous`), and starts
each rank as ``python -m plait.launch.rank_entry script.py args`` in its own process group, armed
to die with the launcher (:mod:`plait.launch.lifeline`). It then polls, every 50 ms:

- exits: a rank that exits non-zero, or dies by a signal, fails the attempt; unless it set
  store key ``plait/launch/may_exit/<rank>`` to ``"1"`` first (a parameter-server worker
  that may leave): then it is logged and the others run on;
- heartbeats: a rank that has written ``plait/heartbeat/<rank>`` (the decimal
  ``time.time()`` of its last beat) and then beats no more for ``heartbeat_timeout``
  seconds while its process is alive is declared frozen, named with its pid (and whether
  it is stopped), and fails the attempt. A rank that never beat is not watched, nor one
  that set ``plait/heartbeat/<rank>/done`` (its script ended, or it left the group);
- the wall-clock limit and the stop signals (SIGTERM, SIGINT, SIGHUP) handed to the
  launcher.

Stopping is the same for every cause: SIGCONT (a stopped rank cannot act on SIGTERM), then
SIGTERM to each rank's process group, then SIGKILL to whatever is left after the grace
period; every pid is reaped before :meth:`Attempt.stop` returns. When an attempt ends, in
success or failure, :meth:`Attempt.close` kills whatever the ranks left running (processes
whose environment carries the job's ``PLAIT_JOB_ID``, in any process group or session),
removes the shared-memory segments its ranks' pids name and its ``plait-run-*`` work
directory, and says so on stderr.

The store itself is :mod:`plait.launch.host_store`'s; what a rank's process is and what it
leaves behind, :mod:`plait.launch.processes`'.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait import settings
from plait.launch import lifeline, rendezvous
from plait.launch.host_store import PortInUse, host_store
from plait.launch.processes import POLL_S, describe_exit, proc_state, sweep

HEARTBEAT_POLL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = float(settings.HEARTBEAT_TIMEOUT.default or 0)
HEARTBEAT_KEY = "plait/heartbeat/{rank}"
# Set (to anything) when the rank stopped beating on purpose: its script ended, or it left
# the process group; from then on it is not watched (exiting can take seconds).
HEARTBEAT_DONE_KEY = "plait/heartbeat/{rank}/done"
MAY_EXIT_KEY = "plait/launch/may_exit/{rank}"
# Where torch's env:// rendezvous puts the default group's keys in the same store.
_PG_PREFIX = "default_pg/"


def heartbeat_timeout_default() -> float:
    """``PLAIT_HEARTBEAT_TIMEOUT`` (checked: >= 1 s, as the ranks check it), else 5."""

    return float(settings.HEARTBEAT_TIMEOUT.read())


@dataclass
class Failure:
    """Why an attempt ended early. ``kind``: exit, frozen, timeout or signal."""

    kind: str
    rank: int | None
    pid: int | None
    code: int
    message: str
    detected_at: float = field(default_factory=time.monotonic)


@dataclass
class RankProc:
    rank: int
    proc: subprocess.Popen[bytes]
    error_file: Path
    exited_at: float | None = None  # monotonic, when the launcher saw it gone
    exited_wall: float | None = None  # the same moment, wall clock
    allowed_exit: bool = False
    beat_seen: bool = False
    beat_done: bool = False
    stopped_by_launcher: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid


class Attempt:
    """One start of the job's ranks against a fresh store (see the module docstring)."""

    def __init__(
        self,
        script: str,
        script_args: list[str],
        *,
        nproc: int,
        restart_count: int,
        max_restarts: int,
        job_id: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        heartbeat_timeout: float | None = None,
        workdir: Path | None = None,
        recorder_dir: Path | None = None,
    ) -> None:
        self.nproc = nproc
        self.started_wall = time.time()
        self.job_id = job_id
        self.restart_count = restart_count
        self.heartbeat_timeout = (
            heartbeat_timeout if heartbeat_timeout is not None else heartbeat_timeout_default()
        )
        self.store = host_store(port)
        self.port = int(self.store.port)
        self.store.set(rendezvous.JOB_KEY, job_id)
        self._own_workdir = workdir is None  # made here: removed by close()
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="plait-run-"))
        self._shm_dir = (env or {}).get("PLAIT_SHM_DIR") or os.environ.get("PLAIT_SHM_DIR")
        self._closed = False
        self.ranks: list[RankProc] = []
        self.allowed: list[tuple[int, int]] = []  # (rank, code) of ranks allowed to exit
        self._next_beat_check = 0.0
        base = dict(os.environ, **(env or {}))
        # the flight recorder's dumps (plait/comm/recorder.py): into the folder the user
        # named, else into recorder_dir, this attempt's folder of the job's, which the
        # failure report names and a successful attempt removes
        named = base.get("PLAIT_RECORDER_DIR", "").strip()
        self.recorder_dir = Path(named) if named else recorder_dir
        self._own_recorder_dir = not named and recorder_dir is not None
        if self._own_recorder_dir:
            base["PLAIT_RECORDER_DIR"] = str(recorder_dir)
        if "OMP_NUM_THREADS" not in base:  # N ranks share the cores (as torchrun does)
            base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        me = os.getpid()
        for rank in range(nproc):
            error_file = self.workdir / f"error-a{restart_count}-r{rank}.json"
            rank_env = dict(
                base,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self.port),
                TORCHELASTIC_USE_AGENT_STORE="True",  # ranks join the launcher's store
                TORCHELASTIC_RESTART_COUNT=str(restart_count),
                TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
                TORCHELASTIC_RUN_ID=job_id,
                PLAIT_RESTART_COUNT=str(restart_count),
                PLAIT_MAX_RESTARTS=str(max_restarts),
                PLAIT_JOB_ID=job_id,
                PLAIT_LAUNCHER_PID=str(me),
                PLAIT_FRESH_STORE="1",  # keys at their plain names (this launcher reads them)
                PLAIT_ERROR_FILE=str(error_file),
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "plait.launch.rank_entry", script, *script_args],
                env=rank_env,
                preexec_fn=lambda: lifeline.preexec(me),
            )
            self.ranks.append(RankProc(rank, proc, error_file))

    # --- watching -------------------------------------------------------------------------
    def poll(self) -> Failure | None:
        """One look at the ranks: the first failure, or None (see :meth:`done`)."""
        now = time.monotonic()
        for r in self.ranks:
            code = r.proc.poll()
            if code is None or r.exited_at is not None:
                continue
            r.exited_at, r.exited_wall = now, time.time()
            if code == 0:
                continue
            if self._may_exit(r.rank):
                r.allowed_exit = True
                self.allowed.append((r.rank, code))
                print(
                    f"plait run: rank {r.rank} (pid {r.pid}) {describe_exit(code)}; it was "
                    f"allowed to leave ({MAY_EXIT_KEY.format(rank=r.rank)}), the others go on",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            return Failure("exit", r.rank, r.pid, code, f"rank {r.rank} {describe_exit(code)}")
        if now >= self._next_beat_check:
            self._next_beat_check = now + HEARTBEAT_POLL_S
            return self._check_heartbeats()
        return None

    def done(self) -> bool:
        return all(r.exited_at is not None for r in self.ranks)

    def _read(self, key: str) -> str | None:
        for k in (key, _PG_PREFIX + key):
            try:
                if self.store.check([k]):
                    return bytes(self.store.get(k)).decode()
            except (RuntimeError, OSError):
                return None
        return None

    def _may_exit(self, rank: int) -> bool:
        return self._read(MAY_EXIT_KEY.format(rank=rank)) == "1"

    def _check_heartbeats(self) -> Failure | None:
        now = time.time()
        for r in self.ranks:
            if r.exited_at is not None or r.beat_done:
                continue
            if self._read(HEARTBEAT_DONE_KEY.format(rank=r.rank)) is not None:
                r.beat_done = True
                continue
            value = self._read(HEARTBEAT_KEY.format(rank=r.rank))
            if value is None:
                continue
            try:
                beat = float(value)
            except ValueError:  # not a time: not a heartbeat this launcher understands
                continue
            r.beat_seen = True
            silent = now - beat
            if silent > self.heartbeat_timeout and r.proc.poll() is None:
                state = proc_state(r.pid)
                how = " (the process is stopped: SIGSTOP?)" if state == "T" else ""
                return Failure(
                    "frozen",
                    r.rank,
                    r.pid,
                    1,
                    f"rank {r.rank} (pid {r.pid}) sent no heartbeat for {silent:.1f}s "
                    f"(threshold {self.heartbeat_timeout:g}s, PLAIT_HEARTBEAT_TIMEOUT){how}",
                )
        return None

    def settle(self, seconds: float) -> None:
        """Give the other ranks ``seconds`` to fail on their own (so their errors are
        recorded as consequences) before they are stopped."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.done():
            for r in self.ranks:
                if r.exited_at is None and r.proc.poll() is not None:
                    r.exited_at, r.exited_wall = time.monotonic(), time.time()
            time.sleep(POLL_S)

    # --- stopping -------------------------------------------------------------------------
    def stop(self, grace: float, *, hurry: Any = None) -> int:
        """Stop every rank: SIGCONT, SIGTERM, then SIGKILL after ``grace`` seconds.

        ``hurry()`` (optional) returning True skips the rest of the grace period. Returns
        how many ranks needed SIGKILL. Every rank is reaped before this returns.
        """
        alive = [r for r in self.ranks if r.proc.poll() is None]
        for r in alive:
            r.stopped_by_launcher = True
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for r in alive:  # its process group: the rank's own children go too
                _killpg(r, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(r.proc.poll() is None for r in alive):
            if hurry is not None and hurry():
                break
            time.sleep(POLL_S)
        killed = 0
        for r in self.ranks:
            if r.proc.poll() is None:
                killed += 1
                _killpg(r, signal.SIGKILL)
        for r in self.ranks:
            r.proc.wait()
            if r.exited_at is None:
                r.exited_at, r.exited_wall = time.monotonic(), time.time()
        return killed

    def errors(self) -> dict[int, dict[str, Any]]:
        """The error files the ranks wrote (rank -> entry)."""
        out = {}
        for r in self.ranks:
            try:
                out[r.rank] = json.loads(r.error_file.read_text())
            except (OSError, ValueError):
                continue
        return out

    def recorder_dumps(self) -> list[int]:
        """The ranks whose flight-recorder dump (``rank<N>.json``) this attempt wrote."""
        if self.recorder_dir is None:
            return []
        ranks = []
        for f in self.recorder_dir.glob("rank*.json"):
            try:
                if f.stat().st_mtime >= self.started_wall - 1.0:  # not an earlier job's
                    ranks.append(int(f.stem[len("rank") :]))
            except (OSError, ValueError):
                continue
        return sorted(ranks)

    def discard_dumps(self) -> None:
        """Remove this attempt's recorder folder when the launcher made it (a successful
        attempt's dumps, or an empty folder: nobody will read them), and the job's folder
        above it once that is empty. A folder the user named is left alone."""
        if not self._own_recorder_dir or self.recorder_dir is None:
            return
        shutil.rmtree(self.recorder_dir, ignore_errors=True)
        try:
            self.recorder_dir.parent.rmdir()  # only if no other attempt's dumps are kept
        except OSError:
            pass

    def close(self) -> None:
        """After the ranks exited (or :meth:`stop`): kill what they left running, remove
        the shared-memory segments they left, the error files and the work directory.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.sweep()
        for r in self.ranks:
            for p in (r.error_file, Path(f"{r.error_file}.tmp")):
                try:
                    p.unlink()
                except OSError:
                    pass
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        del self.store

    def sweep(self) -> tuple[list[str], list[str]]:
        """Kill every process the ranks left behind and remove every shared-memory segment
        a rank of this attempt created; say so on stderr. Returns (processes, segments)
        (:func:`~plait.launch.processes.sweep`)."""
        return sweep(self.job_id, pids={r.pid for r in self.ranks}, shm_dir=self._shm_dir)


def _killpg(r: RankProc, sig: int) -> None:
    """Signal the process group of a rank not yet reaped (its pid is still ours)."""
    if r.proc.returncode is not None:
        return
    try:
        os.killpg(r.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            r.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


# what job.py imports from here; each lives in the module named above
__all__ = [
    "Attempt",
    "Failure",
    "PortInUse",
    "RankProc",
    "describe_exit",
    "heartbeat_timeout_default",
    "new_job_id",
]
