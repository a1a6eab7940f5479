"""Start the ranks of a healing job on this machine, a replacement, and the store.

The rendezvous store must outlive every rank (a rank may die; the store may not), so it
lives in the launching process: :func:`start_store`. :meth:`Ranks.spawn` starts one rank
as a fresh process (``multiprocessing``'s forkserver method: no state of the launcher
inherited, killable on its own), running ``fn(slot=..., **kwargs)``;
:class:`Ranks` keeps them and ends every one it started (:meth:`Ranks.close`), so a test
or demo leaves no process behind.

A replacement by hand is the same script with ``PLAIT_HEAL_JOIN=1``: see docs/healing.md.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def start_store(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str]:
    """A TCPStore server in this process on ``port`` (0: a free one); returns it and
    ``host:port`` (``host``: the address the ranks reach it at). Keep the returned object
    alive as long as the job runs."""
    store = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    return store, f"{host}:{store.port}"


def connect_store(host: str, port: int, timeout: float = 300.0) -> Any:
    """A client of the job's store at ``host:port`` (another machine's launcher hosts it),
    waiting for it at most ``timeout`` s."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def environment() -> dict[str, Any]:
    """A healing rank's settings from the launcher's environment: ``RANK`` (its slot),
    ``WORLD_SIZE`` (the job's full size), ``MASTER_ADDR:MASTER_PORT`` (the store) and
    ``PLAIT_HEAL_JOIN=1`` for a replacement (``python -m plait.heal.run`` sets them; by
    hand: docs/healing.md). Raises naming the variables that are missing."""
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"healing: environment variables {missing} are not set; start the job with "
            f"`python -m plait.heal.run -n N script.py` (docs/healing.md)"
        )
    return {
        "world": int(os.environ["WORLD_SIZE"]),
        "address": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "slot": int(os.environ["RANK"]),
        "join": os.environ.get("PLAIT_HEAL_JOIN") == "1",
    }


def _entry(fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fn(**kwargs)


class Ranks:
    """The processes of one healing job on this machine, by slot (replacements too)."""

    def __init__(self, *, preload: tuple[str, ...] = ()) -> None:
        # forkserver: each rank is forked from a server that imported torch (and
        # ``preload``) once, before any thread or CUDA use: a fresh process in a fraction
        # of a second, where spawning one re-imports torch (seconds on a loaded machine)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "plait.heal.trainer", *preload])
        self.started: list[tuple[int, Any]] = []

    def spawn(self, fn: Callable[..., Any], *, slot: int, **kwargs: Any) -> Any:
        """Start ``fn(slot=slot, **kwargs)`` in a fresh process (``fn`` importable by
        name: defined at a module's top level)."""
        proc = self.ctx.Process(target=_entry, args=(fn, {"slot": slot, **kwargs}), daemon=True)
        proc.start()
        self.started.append((slot, proc))
        return proc

    def wait(self, timeout: float) -> dict[int, list[int | None]]:
        """Wait until every process ended (at most ``timeout`` s in all); exit codes per
        slot (``None``: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for _, proc in self.started:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes: dict[int, list[int | None]] = {}
        for slot, proc in self.started:
            codes.setdefault(slot, []).append(proc.exitcode)
        return codes

    def close(self) -> None:
        """Kill every process still running (SIGKILL after a SIGTERM grace) and reap it."""
        for _, proc in self.started:
            if proc.is_alive():
                proc.terminate()
        for _, proc in self.started:
            proc.join(2.0)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(2.0)
        self.started.clear()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
