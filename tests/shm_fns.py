"""Functions run on ranks by tests/test_shm.py (the shared-memory transport)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from plait import comm
from plait.comm import ops


def links() -> dict[str, Any]:
    """Which peers the world group reaches through shared memory."""
    g = comm.world()
    link = g.shm
    return {
        "rank": g.rank,
        "peers": sorted(link.outs) if link is not None else [],
        "shared": ops.shared(g),
        "files": sorted(f for f in os.listdir("/dev/shm") if f.startswith("plait-shm-")),
    }


def ring_bytes(numel: int) -> tuple[int, int]:
    """A ring all-reduce's bytes sent and received by this rank."""
    g = comm.world()
    comm.reset_stats()
    t = torch.ones(numel)
    comm.all_reduce(t, algorithm="ring")
    stat = comm.stats()[("all_reduce", "ring")]
    assert torch.equal(t, torch.full((numel,), float(g.size)))
    return stat.bytes_sent, stat.bytes_received


def p2p_large(numel: int, tag: int) -> bool:
    """Rank 0 sends a message several rings long to rank 1, which sends it back doubled;
    tags out of order are matched by tag."""
    g = comm.world()
    x = torch.arange(numel, dtype=torch.float64)
    if g.rank == 0:
        comm.send(x, 1, tag=tag)
        back = torch.empty_like(x)
        comm.recv(back, 1, tag=tag + 1)
        return bool(torch.equal(back, 2 * x))
    if g.rank == 1:
        got = torch.empty_like(x)
        comm.recv(got, 0, tag=tag)
        comm.send(2 * got, 0, tag=tag + 1)
        return bool(torch.equal(got, x))
    return True


def size_mismatch() -> str:
    """Rank 0 sends 10 floats, rank 1 expects 12: named on rank 1, not a wrong result;
    rank 0's send (which returns only once received) fails naming rank 1."""
    g = comm.world()
    if g.rank == 0:
        try:
            comm.send(torch.ones(10), 1, tag=7)
        except comm.CollectiveError as exc:
            return str(exc)
        return "no error"
    try:
        comm.recv(torch.empty(12), 0, tag=7)
    except comm.CollectiveError as exc:
        return str(exc)
    return "no error"


def ring_tree_mixed(numel: int) -> dict[str, Any]:
    """ring_tree across simulated hosts (node_size 2): shared memory inside a node, gloo
    between nodes, against the local sum."""
    g = comm.world()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(g.rank), dtype=torch.float64)
    want = sum(
        torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(g.size)
    )
    got = x.clone()
    comm.all_reduce(got, algorithm="ring_tree")
    return {
        "peers": sorted(g.shm.outs) if g.shm is not None else [],
        "close": bool(torch.allclose(got, want)),
        "result": got,
        "auto_shared": ops.shared(g),
    }


def killed_mid_collective(algorithm: str) -> dict[str, Any]:
    """Rank 1 dies (SIGKILL) instead of joining an all-reduce; the others time it."""
    g = comm.world()
    t = torch.ones(1 << 16)
    comm.all_reduce(t, algorithm=algorithm)  # all healthy once
    if g.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(t, algorithm=algorithm)
    except comm.CollectiveError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": "", "seconds": time.monotonic() - start}


def stopped_mid_collective() -> dict[str, Any]:
    """Rank 1 stops (SIGSTOP) instead of joining; rank 0 is told within the heartbeat
    timeout, then resumes it (SIGCONT) so the pool can close."""
    g = comm.world()
    t = torch.ones(1024)
    comm.all_reduce(t, algorithm="shm")
    pid1 = g.shm.pids[1] if g.shm is not None and g.rank == 0 else 0
    if g.rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        comm.all_reduce(t, algorithm="shm")
        error = ""
    except comm.CollectiveError as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    if g.rank == 0 and pid1:
        os.kill(pid1, signal.SIGCONT)
    return {"error": error, "seconds": seconds}


def disagree() -> str:
    """Ranks all-reduce different sizes: the check names it; no bytes are matched."""
    g = comm.world()
    t = torch.ones(4 + g.rank)
    try:
        comm.all_reduce(t, algorithm="ring")
    except comm.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
