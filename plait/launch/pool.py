"""Running a function on N local ranks: ``spawn`` and the reusable ``RankPool``.

The parent process hosts the rendezvous store (a ``TCPStore`` on a free loopback port,
so two launches never race for a port) and starts N processes with the ``spawn`` start
method. Each joins the process group with ``plait.init`` and then runs the functions the
parent sends it, one at a time, returning each result over a pipe (local, never the
network). Starting a process that imports torch costs a second or two, so the test suite
keeps one pool per world size alive and runs many functions on it.

Failures never hang: a rank that raises is reported with its rank and traceback, a rank
that dies is named with its exit code, and ranks still running past ``timeout`` are
named and the pool is torn down.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait import runtime
from plait.launch import lifeline

DEFAULT_RUN_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank raised: ``rank`` names it, ``remote_traceback`` is its traceback, and
    ``__cause__`` is the original exception when it could be carried back."""

    def __init__(self, rank: int, message: str, remote_traceback: str) -> None:
        super().__init__(
            f"rank {rank} failed: {message}\n\n--- traceback on rank {rank} ---\n{remote_traceback}"
        )
        self.rank = rank
        self.remote_traceback = remote_traceback


class RankTimeout(TimeoutError):
    """Ranks did not finish in time; ``ranks`` names them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class RankExited:
    """The result of a rank that ``RankPool.run(..., may_exit=...)`` allowed to die."""

    rank: int
    exit_code: int | None


def _check_picklable(fn: Callable[..., Any]) -> None:
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"cannot run {getattr(fn, '__qualname__', fn)!r} on spawned ranks: it was defined "
            f"at an interactive prompt, which new processes cannot import. Define it in a "
            f".py file (a module, or a script guarded by `if __name__ == '__main__':`) and "
            f"import it"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"cannot send {getattr(fn, '__qualname__', fn)!r} to spawned ranks ({exc}). "
            f"Lambdas and functions nested inside other functions cannot be imported by a "
            f"new process: define it at the top level of a module"
        ) from exc


def _worker(
    rank: int,
    world_size: int,
    port: int,
    conn: mpc.Connection,
    init_kwargs: dict[str, Any],
    env: dict[str, str],
) -> None:

    lifeline.arm()  # a rank never outlives its parent (even after kill -9)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )

    def reply(status: str, payload: Any) -> None:
        try:
            data = pickle.dumps((status, payload))
        except Exception as exc:  # a result that cannot travel back
            data = pickle.dumps(("err", (f"result could not be pickled: {exc}", "", None)))
        conn.send_bytes(data)

    def failure(exc: BaseException) -> tuple[str, str, bytes | None]:
        try:
            original = pickle.dumps(exc)
            pickle.loads(original)
        except Exception:
            original = None
        return f"{type(exc).__name__}: {exc}", traceback.format_exc(), original

    try:
        timeout = init_kwargs.get("timeout") or runtime.DEFAULT_TIMEOUT_S
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        runtime.init(store=store, **init_kwargs)
    except BaseException as exc:
        reply("err", failure(exc))
        return
    reply("ready", None)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break
        try:
            fn, args, kwargs = pickle.loads(message)
            kept = runtime.live_groups()
            result = fn(*args, **kwargs)
            # each run starts from the world group, as a fresh process would: the groups
            # it made are destroyed before it answers (gloo keeps three threads and a
            # socket per peer for every group until then)
            runtime.destroy_groups(keep=kept)
            reply("ok", result)
        except BaseException as exc:
            reply("err", failure(exc))
    try:
        runtime.shutdown()
    except Exception:
        pass


class RankPool:
    """N ranks kept alive to run many functions: ``pool.run(fn, *args)``.

    ``run`` sends ``fn`` (importable by name) to every rank, which calls
    ``fn(*args, **kwargs)`` with the process group joined, and returns the results in rank
    order. Each run starts from the world group: the groups a run made (meshes, sub-groups)
    are destroyed on every rank before its result comes back, so a pool that runs many
    functions holds no more threads or sockets than a fresh one (``threads()`` counts
    them). After a failure or a timeout the pool is closed: start a new one. ``timeout``
    and ``debug`` left as None follow ``PLAIT_TIMEOUT`` and ``PLAIT_DEBUG`` (the ranks
    inherit this process's environment, plus ``env``). ``backend``: the process group's
    (``"gloo"`` by default; None lets :func:`plait.init` choose: NCCL where every rank owns
    a GPU). Ranks die with this process.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        backend: str | None = "gloo",
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")

        self.world_size = world_size
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=start_timeout),
            wait_for_workers=False,
        )
        self.port = self._store.port
        # the flight recorder's dumps (plait/comm/recorder.py) go to a folder of the pool's
        # own unless one was set: a failure names it, a pool closed without one removes it
        env = dict(env or {})
        self._own_dumps = "PLAIT_RECORDER_DIR" not in {**os.environ, **env}
        if self._own_dumps:
            env["PLAIT_RECORDER_DIR"] = str(
                Path(tempfile.gettempdir()) / f"plait-recorder-pool-{os.getpid()}-{self.port}"
            )
        self.recorder_dir = Path(env.get("PLAIT_RECORDER_DIR") or os.environ["PLAIT_RECORDER_DIR"])
        self._named_dumps = False
        ctx = mp.get_context("spawn")
        self._conns: list[mpc.Connection] = []
        self._procs: list[Any] = []
        init_kwargs = {"timeout": timeout, "debug": debug, "backend": backend}
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, self.port, child, init_kwargs, env),
                name=f"plait-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.closed = False
        self._collect(start_timeout, what="start")

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = DEFAULT_RUN_TIMEOUT_S,
        may_exit: Collection[int] = (),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order.

        Raises :class:`RankError` for the first rank that raised, :class:`RankTimeout`
        naming the ranks still running after ``timeout`` seconds. A rank in ``may_exit``
        that dies (a failure being tested) gets a :class:`RankExited` result instead, the
        others run on; the pool is closed afterwards.
        """
        if self.closed:
            raise RuntimeError("this RankPool is closed (after a failure); start a new one")
        _check_picklable(fn)
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        what = getattr(fn, "__qualname__", repr(fn))
        results = self._collect(timeout, what=what, may_exit=frozenset(may_exit))
        if any(isinstance(r, RankExited) for r in results):
            self.close()
        return results

    def _collect(
        self, timeout: float, what: str, may_exit: frozenset[int] = frozenset()
    ) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            waitables: dict[Any, int] = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            ready = mpc.wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(pending)
                note = self._dumps()  # before close(), which removes an unnamed folder
                self.close()
                raise RankTimeout(
                    f"ranks {late} of {self.world_size} did not finish {what} within "
                    f"{timeout:g}s; they were stopped. A rank that waits for a peer forever "
                    f"usually means the ranks called different collectives{note}",
                    late,
                )
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                if obj is not conn and not conn.poll():
                    code = self._exit_code(r)
                    if r in may_exit:
                        results[r] = RankExited(r, code)
                        pending.discard(r)
                        continue
                    note = self._dumps()  # before close(), which removes an unnamed folder
                    self.close()
                    raise RankError(
                        r, f"the process died (exit code {code}) during {what}{note}", ""
                    )
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as exc:
                    code = self._exit_code(r)
                    if r in may_exit:
                        results[r] = RankExited(r, code)
                        pending.discard(r)
                        continue
                    note = self._dumps()  # before close(), which removes an unnamed folder
                    self.close()
                    raise RankError(
                        r, f"the process died (exit code {code}) during {what}{note}", ""
                    ) from exc
                if status == "err":
                    message, tb, original = payload
                    note = self._dumps()  # before close(), which removes an unnamed folder
                    self.close()
                    error = RankError(r, message + note, tb)
                    cause = pickle.loads(original) if original else None
                    raise error from cause
                results[r] = payload
                pending.discard(r)
        return results

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return [int(p.pid) for p in self._procs]

    def threads(self) -> list[int]:
        """Each rank's thread count now (Linux ``/proc``; -1 where it cannot be read)."""
        counts = []
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    line = next(x for x in f if x.startswith("Threads:"))
                counts.append(int(line.split()[1]))
            except (OSError, StopIteration, ValueError):
                counts.append(-1)
        return counts

    def _dumps(self) -> str:
        """A sentence naming the flight-recorder dumps the ranks wrote, if any; a folder
        named in an error is kept for ``plait doctor``."""
        found = sorted(self.recorder_dir.glob("rank*.json")) if self.recorder_dir.is_dir() else []
        if not found:
            return ""
        self._named_dumps = True
        return (
            f". Flight-recorder dumps of {len(found)} rank(s) in {self.recorder_dir}: "
            f"`plait doctor {self.recorder_dir}` says what each rank was doing"
        )

    def _exit_code(self, rank: int) -> int | None:
        self._procs[rank].join(2.0)  # its pipe may close a moment before it is reaped
        return self._procs[rank].exitcode

    def close(self) -> None:
        """Stop every rank (gracefully if idle, by force after a moment)."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        if self._own_dumps and not self._named_dumps:  # nobody was told of it: nobody reads it
            shutil.rmtree(self.recorder_dir, ignore_errors=True)


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_RUN_TIMEOUT_S,
    collective_timeout: float | None = None,
    debug: bool | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return their results.

    Each rank has joined the process group (``plait.init``) before ``fn`` runs. Results
    come back in rank order. The first rank to fail is re-raised as :class:`RankError`
    (with its rank and traceback; the original exception is its ``__cause__``); ranks
    still running after ``timeout`` seconds are stopped and named in :class:`RankTimeout`.
    ``collective_timeout`` bounds each collective inside ``fn`` (default ``PLAIT_TIMEOUT``);
    ``debug`` checks every collective's signature (default ``PLAIT_DEBUG``): the ranks
    inherit this process's environment, so ``PLAIT_*`` settings reach them. ``fn`` must be
    importable by name: a top-level function of a module or of a script run as ``__main__``.
    """
    _check_picklable(fn)
    with RankPool(world_size, timeout=collective_timeout, debug=debug, backend=backend) as pool:
        return pool.run(fn, *args, timeout=timeout, **(kwargs or {}))
