"""A ``plait run`` job: attempts, restarts, stop signals and the failure report.

:func:`run_job` starts an :class:`~plait.launch.attempt.Attempt` and watches it. When a rank
fails (exits non-zero, dies by a signal, or stops beating) every rank is stopped; with
``max_restarts`` left the job starts again from scratch against a fresh store (a new port,
so no key of the failed attempt is ever read), and the script learns which attempt it is
from ``PLAIT_RESTART_COUNT`` (also ``TORCHELASTIC_RESTART_COUNT``): it must resume from its
own last checkpoint.

Elastic world size (``min_nproc`` below ``nproc``; ``plait run -n 4 --min-nproc 2``, what
torchrun's ``--nnodes MIN:MAX`` gives across machines): a failure costs its root-cause
rank's slot, as a node that fails leaves a torchrun job. The next attempt starts with one
rank fewer (``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` say how many; ranks are renumbered
0..n-1, as torchrun does not keep RANK stable either), within the same ``max_restarts``
budget; the script resumes from its checkpoint resharded to the new world size
(:func:`plait.checkpoint.load` does that). A failure that would leave fewer than
``min_nproc`` ranks stops the job, saying so. Without ``min_nproc`` every restart is at
``nproc``. SIGTERM, SIGINT or SIGHUP to the launcher stop the job within the
grace period (a second signal skips what is left of it); the exit code is then 128 + the
signal's number.

The report names the *root cause* once, at the top, with its traceback: among the ranks
that failed on their own, the earliest failure that is not a reaction to another rank
(a closed connection or a collective timeout; see :mod:`plait.launch.rank_entry`). Every other
rank's error follows as one line labelled as a consequence.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from plait import settings
from plait.comm.watchdog import parse_heartbeat_timeout
from plait.launch import lifeline
from plait.launch.attempt import Attempt, Failure, PortInUse, RankProc, describe_exit, new_job_id

DEFAULT_GRACE_S = 5.0
SETTLE_S = 1.0  # after a failure, how long the others get to fail on their own
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _say(text: str) -> None:
    print(f"plait run: {text}", file=sys.stderr, flush=True)


def run_job(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    min_nproc: int | None = None,
    grace: float = DEFAULT_GRACE_S,
    timeout: float | None = None,
    heartbeat_timeout: float | None = None,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``script`` on ``nproc`` local ranks until they finish; return the exit code.

    0 when every rank exited 0 (or left with permission, ``plait/launch/may_exit/<r>``);
    the root-cause rank's exit code (1 if it died by a signal or froze) after a failure
    with no restarts left, or when restarting would leave fewer than ``min_nproc`` ranks;
    124 after ``timeout`` seconds; 128 + n after signal n. ``min_nproc`` (1 <= min_nproc
    <= nproc, needs ``max_restarts`` >= 1): restart with one rank fewer after each failure
    (see the module docstring).
    """
    for warning in settings.check(dict(os.environ, **(env or {}))):  # bad values raise
        _say(warning)
    check_nproc(nproc)
    check_elastic(nproc=nproc, min_nproc=min_nproc, max_restarts=max_restarts)
    if heartbeat_timeout is not None:
        parse_heartbeat_timeout(heartbeat_timeout, "heartbeat_timeout (--heartbeat-timeout)")
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        return _run(
            script,
            script_args,
            nproc=nproc,
            max_restarts=max_restarts,
            min_nproc=nproc if min_nproc is None else min_nproc,
            grace=grace,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            master_port=master_port,
            env=env,
            received=received,
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


RANKS_PER_CORE = 16  # each local rank is a Python process with torch (about 300 MB)


def check_nproc(nproc: int, *, nodes: int = 1) -> None:
    """Refuse a local rank count this machine cannot hold: below 1, above
    ``RANKS_PER_CORE`` per CPU core (``PLAIT_MAX_NPROC`` overrides), or above the user's
    process limit (``ulimit -u``). Raises ValueError naming the numbers."""

    if nproc < 1:
        raise ValueError(f"-n (nproc) must be at least 1, got {nproc}")
    cores = os.cpu_count() or 1
    named = settings.MAX_NPROC.read()  # checked: a whole number >= 1, or unset
    limit = RANKS_PER_CORE * cores if named is None else int(named)
    if nproc > limit:
        where = (
            "set by PLAIT_MAX_NPROC"
            if named is not None
            else (
                f"{RANKS_PER_CORE} per core on this machine of {cores} cores; each rank is a "
                f"Python process with torch, about 300 MB"
            )
        )
        more = " or spread the job over more machines (--nnodes)" if nodes == 1 else ""
        raise ValueError(
            f"-n {nproc} starts {nproc} ranks on this machine, more than {limit} ({where}); "
            f"pass at most -n {limit}{more}, or raise the limit with PLAIT_MAX_NPROC"
        )
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and nproc >= soft:
        raise ValueError(
            f"-n {nproc} ranks reach this user's process limit ({soft}, ulimit -u); "
            f"pass fewer ranks or raise the limit"
        )


def check_elastic(*, nproc: int, min_nproc: int | None, max_restarts: int) -> None:
    """Refuse an elastic configuration that cannot work, naming the flag to change."""
    if nproc < 1:
        raise ValueError(f"nproc (-n) must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts (--max-restarts) must be >= 0, got {max_restarts}")
    if min_nproc is None:
        return
    if not 1 <= min_nproc <= nproc:
        raise ValueError(
            f"min_nproc (--min-nproc) must be between 1 and nproc (-n {nproc}), got {min_nproc}"
        )
    if min_nproc < nproc and max_restarts < 1:
        raise ValueError(
            f"min_nproc (--min-nproc {min_nproc}) below nproc (-n {nproc}) restarts with fewer "
            f"ranks after a failure, which needs restarts: add --max-restarts k (k >= 1)"
        )


def recorder_root(job_id: str) -> Path:
    """The job's flight-recorder folder: ``<tmp>/plait-recorder-<job id>``, one
    ``attempt-<n>`` folder per attempt inside (``PLAIT_RECORDER_DIR`` of its ranks)."""
    return Path(tempfile.gettempdir()) / f"plait-recorder-{job_id}"


def _run(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    max_restarts: int,
    min_nproc: int,
    grace: float,
    timeout: float | None,
    heartbeat_timeout: float | None,
    master_port: int | None,
    env: dict[str, str] | None,
    received: list[int],
) -> int:
    job_id = new_job_id()
    recorder = recorder_root(job_id)
    elastic = min_nproc < nproc
    deadline = time.monotonic() + timeout if timeout else None
    restart = 0
    while True:
        try:
            attempt = Attempt(
                script,
                script_args,
                nproc=nproc,
                restart_count=restart,
                max_restarts=max_restarts,
                job_id=job_id,
                port=master_port,
                env=env,
                heartbeat_timeout=heartbeat_timeout,
                recorder_dir=recorder / f"attempt-{restart}",
            )
        except PortInUse as exc:
            _say(str(exc))
            return 1
        failure = _watch(attempt, deadline, received, timeout)
        if failure is None:
            for rank, code in attempt.allowed:
                _say(f"rank {rank} left early ({describe_exit(code)}), allowed; job done")
            attempt.discard_dumps()
            attempt.close()
            if restart and recorder.is_dir():
                _say(
                    f"the flight-recorder dumps of the failed attempts stay in {recorder} "
                    f"(read them with: plait doctor {recorder}); remove it once read"
                )
            return 0
        if failure.kind == "exit":
            attempt.settle(min(SETTLE_S, grace))
        killed = attempt.stop(grace, hurry=_more_signals(received))
        _report(attempt, failure, killed, grace)
        _report_dumps(attempt)
        attempt.close()
        if received and failure.kind != "signal":  # told to stop while stopping the ranks
            _say(f"received {signal.Signals(received[0]).name}; not restarting")
            return 128 + received[0]
        if failure.kind in ("exit", "frozen") and restart < max_restarts and not received:
            # an elastic job loses the root-cause rank's slot (a frozen rank's too)
            lost = elastic and failure.rank is not None
            if lost and nproc - 1 < min_nproc:
                _say(
                    f"{failure.message}: its slot is lost, and {nproc - 1} rank(s) would be "
                    f"left, fewer than --min-nproc {min_nproc}; not restarting (the job failed)"
                )
                return failure.code
            restart += 1
            if lost:
                nproc -= 1
                _say(
                    f"restarting with {nproc} ranks, one fewer (restart {restart} of "
                    f"{max_restarts}, WORLD_SIZE={nproc}, PLAIT_RESTART_COUNT={restart}; "
                    f"--min-nproc {min_nproc}) after: {failure.message}"
                )
            else:
                _say(
                    f"restarting every rank (restart {restart} of {max_restarts}, "
                    f"PLAIT_RESTART_COUNT={restart}) after: {failure.message}"
                )
            continue
        if failure.kind in ("exit", "frozen") and max_restarts:
            _say(f"no restarts left ({max_restarts} used); the job failed")
        return failure.code


def _more_signals(received: list[int]) -> Callable[[], bool]:
    """True once a stop signal arrives beyond those already seen (skip the grace)."""
    seen = len(received)
    return lambda: len(received) > seen


def _watch(
    attempt: Attempt, deadline: float | None, received: list[int], timeout: float | None
) -> Failure | None:
    while True:
        if received:
            sig = signal.Signals(received[0]).name
            return Failure(
                "signal", None, None, 128 + received[0], f"received {sig}; stopping the job"
            )
        failure = attempt.poll()
        if failure is not None:
            if failure.kind == "exit":
                failure.code = failure.code if failure.code > 0 else 1
            return failure
        if attempt.done():
            return None
        if deadline is not None and time.monotonic() > deadline:
            late = [r.rank for r in attempt.ranks if r.exited_at is None]
            return Failure(
                "timeout", None, None, 124, f"ranks {late} still running after {timeout:g}s"
            )
        time.sleep(0.05)


def _candidate_key(r: RankProc, errors: dict[int, dict[str, Any]]) -> tuple[bool, float]:
    err = errors.get(r.rank)
    if err is not None:
        return bool(err.get("consequence")), float(err["time"])
    return False, r.exited_wall or time.time()


def _report(attempt: Attempt, failure: Failure, killed: int, grace: float) -> None:
    errors = attempt.errors()
    err: dict[str, Any] | None
    stop_note = f" ({killed} needed SIGKILL after the {grace:g}s grace)" if killed else ""
    if failure.kind in ("signal", "timeout"):
        _say(f"{failure.message}; stopped {len(attempt.ranks)} ranks{stop_note}")
        for rank, err in sorted(errors.items()):
            _say(f"rank {rank} had raised {err['type']}: {err['message']}")
        return
    failed_alone = [
        r
        for r in attempt.ranks
        if not r.stopped_by_launcher and not r.allowed_exit and r.proc.returncode not in (0, None)
    ]
    if failure.kind == "frozen":
        root = next(r for r in attempt.ranks if r.rank == failure.rank)
        _say(f"{failure.message}: root cause; it was stopped (SIGCONT, SIGTERM, SIGKILL)")
    elif not failed_alone:  # cannot happen: the failing rank exited on its own
        _say(f"{failure.message} (root cause)")
        root = None
    else:
        root = min(failed_alone, key=lambda r: _candidate_key(r, errors))
        failure.rank, failure.pid = root.rank, root.pid
        code = root.proc.returncode or 1
        failure.code = code if code > 0 else 1
        failure.message = f"rank {root.rank} {describe_exit(code)}"
        err = errors.get(root.rank)
        what = f": {err['type']}: {err['message']}" if err else ""
        _say(f"rank {root.rank} (pid {root.pid}) {describe_exit(code)}{what} (root cause)")
        if err:
            print(
                f"---- root cause: traceback of rank {root.rank} (pid {root.pid}, "
                f"host {err['host']}) ----\n{err['traceback'].rstrip()}\n"
                f"---- end of rank {root.rank}'s traceback ----",
                file=sys.stderr,
                flush=True,
            )
    for r in attempt.ranks:
        if r is root or r.allowed_exit:
            continue
        err = errors.get(r.rank)
        if err is not None:
            _say(f"consequence: rank {r.rank} (pid {r.pid}) raised {err['type']}: {err['message']}")
        elif r.stopped_by_launcher:
            _say(f"consequence: rank {r.rank} (pid {r.pid}) was stopped by plait run")
        elif r.proc.returncode not in (0, None):
            _say(f"consequence: rank {r.rank} (pid {r.pid}) {describe_exit(r.proc.returncode)}")
    if killed:
        _say(f"{killed} rank(s) needed SIGKILL after the {grace:g}s grace")


def _report_dumps(attempt: Attempt) -> None:
    """Name the flight-recorder dumps the failed attempt's ranks wrote, and how to read
    them; remove the attempt's folder when they wrote none."""
    dumped = attempt.recorder_dumps()
    if not dumped:
        attempt.discard_dumps()
        return
    where = attempt.recorder_dir
    _say(
        f"flight recorder: ranks {dumped} wrote their last collectives into {where}; "
        f"`plait doctor {where}` names the first collective the ranks disagree on"
    )


def run_torchrun(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    nnodes: int | str,
    node_rank: int,
    master_addr: str,
    master_port: int,
    max_restarts: int = 0,
    grace: float = DEFAULT_GRACE_S,
    local_addr: str | None = None,
    rdzv_conf: str | None = None,
) -> int:
    """Several machines: hand the job to torchrun's launcher (static rendezvous at
    ``master_addr:master_port``; the same environment contract for the script).

    ``nnodes="MIN:MAX"``: torchrun's elastic rendezvous instead (``--rdzv-backend c10d
    --rdzv-endpoint master_addr:master_port``, run id ``plait-<port>`` so every node of
    the job names the same one; ``--node-rank`` is then torchrun's to assign, and
    ``rdzv_conf`` is passed as ``--rdzv-conf``, e.g. ``last_call_timeout=5``): the job
    starts once MIN nodes joined and admits up to MAX.

    With ``max_restarts``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set (it matters to
    torchrun's c10d rendezvous: on torch 2.13 with gloo a restarted attempt against the
    shared store fails in ``connectFullMesh``, fact sheet M1). The static rendezvous used
    here keeps one store for every attempt whatever that variable says; ``plait.init``
    then rendezvouses each attempt under ``plait/attempt-<n>`` (see
    :func:`plait.comm.progress.attempt_namespace`), so no attempt reads another's keys.
    torchrun itself dies with ``plait run`` (SIGTERM when it is killed), and SIGTERM/SIGINT
    are passed on to it; it gets ``grace`` + 35 s (its own grace for its workers is 30 s)
    before SIGKILL.
    """

    env = dict(os.environ)
    env.pop("PLAIT_LAUNCHER_PID", None)
    if max_restarts:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
    if ":" in str(nnodes):
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}",
            f"--rdzv-id=plait-{master_port}",
        ]
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
    else:
        cmd += [
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
        ]
    cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if local_addr:
        cmd.append(f"--local-addr={local_addr}")
    me = os.getpid()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        proc = subprocess.Popen(
            [*cmd, script, *script_args],
            env=env,
            preexec_fn=lambda: lifeline.preexec(me, signal.SIGTERM),
        )
        passed_on = 0
        kill_at: float | None = None
        while proc.poll() is None:
            if len(received) > passed_on:
                proc.send_signal(received[passed_on])
                passed_on += 1
                kill_at = kill_at or time.monotonic() + grace + 35.0
            if kill_at is not None and time.monotonic() > kill_at:
                _say(f"torchrun (pid {proc.pid}) did not stop after the grace; SIGKILL")
                proc.kill()
                proc.wait()
                break
            time.sleep(0.05)
        if received:
            _say(f"received {signal.Signals(received[0]).name}; torchrun stopped")
            return 128 + received[0]
        return int(proc.returncode)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
