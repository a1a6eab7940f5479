"""Rank functions for tests/test_heartbeat.py: a peer stopped (SIGSTOP) mid-collective."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from plait import comm
from plait.comm import watchdog


def pid() -> int:
    return os.getpid()


def wait_on_rank1(delay_s: float, marker: str | None = None) -> dict[str, Any]:
    """Rank 0 enters an all-reduce at once; rank 1 only after ``delay_s`` (the test
    stops it meanwhile). What happened, with the wall-clock time it happened. A rank whose
    all-reduce raised creates the file ``marker`` (if given) at once: the test, which sees
    results only once every rank has answered, learns there when to resume a stopped rank."""
    g = comm.world()
    if g.rank == 1:
        time.sleep(delay_s)
    t = torch.full((4,), float(g.rank + 1))
    try:
        comm.all_reduce(t, algorithm="naive")
    except comm.CollectiveError as exc:
        at = time.time()
        if marker is not None:
            with open(marker, "a") as f:
                f.write(f"{g.rank}\n")
        ranks = getattr(exc, "ranks", None)
        return {"error": type(exc).__name__, "ranks": ranks, "message": str(exc), "at": at}
    return {"error": None, "result": t.tolist(), "at": time.time()}


def stalls() -> list[tuple[int, float]]:
    """The peer stalls this rank logged (after the stalled peer beat again)."""
    time.sleep(0.5)
    return watchdog.stalls()
