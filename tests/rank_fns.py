"""Functions the tests run on every rank (importable by the spawned ranks)."""

from __future__ import annotations

import datetime
import os
import time

import torch

import plait
from plait import comm
from plait.comm import progress


def bytes_of(collective: str, algorithm: str, numel: int, root: int = 0) -> tuple[int, int]:
    """Run one collective of ``numel`` float32 elements; return (sent, received) bytes."""
    g = comm.world()
    comm.reset_stats()
    t = torch.ones(numel)
    if collective == "all_reduce":
        comm.all_reduce(t, algorithm=algorithm)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(torch.empty(numel // g.size), t, algorithm=algorithm)
    elif collective == "all_gather":
        comm.all_gather(torch.empty(numel), torch.ones(numel // g.size), algorithm=algorithm)
    elif collective == "broadcast":
        comm.broadcast(t, root, algorithm=algorithm)
    stat = comm.stats()[(collective, algorithm)]
    assert stat.calls == 1
    return stat.bytes_sent, stat.bytes_received


def async_many(count: int, numel: int, algorithm: str) -> list[torch.Tensor]:
    """Issue ``count`` asynchronous all-reduces, then a synchronous one, then wait."""
    g = comm.world()
    tensors = [torch.full((numel,), float(g.rank + i)) for i in range(count)]
    handles = [comm.all_reduce(t, algorithm=algorithm, async_op=True) for t in tensors]
    last = torch.full((numel,), 1.0)
    comm.all_reduce(last, algorithm=algorithm)  # must queue behind the async ones
    futures = [h.get_future() for h in handles]
    for h in handles:
        h.wait()
    torch.futures.wait_all(futures)
    assert all(h.is_completed() for h in handles)
    return tensors + [last]


def subgroups() -> dict[str, list[float]]:
    """Collectives on overlapping sub-groups of 4 ranks, in the same order on every rank."""
    w = comm.world()
    pairs = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    odd = comm.new_group([1, 3], name="odd")
    out: dict[str, list[float]] = {}
    mine = next(g for g in pairs if g is not None)
    t = torch.tensor([float(w.rank)])
    comm.all_reduce(t, group=mine, algorithm="ring")
    out["pair"] = t.tolist()
    if odd is not None:
        t = torch.tensor([float(w.rank)])
        comm.all_reduce(t, group=odd, algorithm="tree")
        b = torch.tensor([float(w.rank)])
        comm.broadcast(b, 1, group=odd, algorithm="ring")  # group rank 1 = global rank 3
        out["odd"] = t.tolist() + b.tolist()
    return out


def hierarchical(node_size: int, numel: int) -> tuple[list[float], list[float], dict]:
    """Hierarchical all-reduce and broadcast with ranks grouped in nodes of ``node_size``."""
    w = comm.world()
    g = comm.new_group(range(w.size), node_size=node_size)
    assert g is not None
    comm.reset_stats()
    t = torch.arange(numel, dtype=torch.float64) * (w.rank + 1)
    comm.all_reduce(t, group=g, algorithm="hierarchical")
    b = torch.full((numel,), float(w.rank))
    comm.broadcast(b, w.size - 1, group=g, algorithm="hierarchical")
    s = comm.stats()[("all_reduce", "hierarchical")]
    return t.tolist(), b.tolist(), {"sent": s.bytes_sent}


def bad_arguments() -> list[str]:
    """Each bad call raises before sending anything; the group still works afterwards."""
    g = comm.world()
    errors = []
    attempts = [
        lambda: comm.broadcast(torch.ones(3), g.size),
        lambda: comm.reduce(torch.ones(3), -1),
        lambda: comm.reduce_scatter(torch.empty(3), torch.ones(7)),
        lambda: comm.all_gather(torch.empty(5), torch.ones(3)),
        lambda: comm.all_gather(torch.empty(3 * g.size, dtype=torch.float64), torch.ones(3)),
        lambda: comm.all_reduce(torch.ones(3, device="meta")),
        lambda: comm.all_reduce(torch.ones(3, dtype=torch.int64), "avg"),
        lambda: comm.all_reduce(torch.ones(3), "median"),
        lambda: comm.all_reduce(torch.ones(3), algorithm="butterfly"),
        lambda: comm.all_to_all(torch.empty(4), torch.ones(4), algorithm="tree"),
        lambda: comm.all_reduce([1, 2, 3]),  # type: ignore[arg-type]
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool)),
        lambda: comm.all_to_all(torch.empty(3), torch.ones(3)),
        lambda: comm.send(torch.ones(1), g.rank),
        lambda: comm.reduce_scatter(torch.empty(1), [torch.ones(1)]),
    ]
    for attempt in attempts:
        try:
            attempt()
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("no error")
    t = torch.ones(4)
    comm.all_reduce(t, algorithm="ring")
    assert torch.equal(t, torch.full((4,), float(g.size))), t
    return errors


def skip_collective(
    skipper: int, algorithm: str, timeout_s: float = 3.0
) -> tuple[str, list[int], str] | str:
    """Every rank but ``skipper`` calls an all-reduce; they must time out naming it, after
    the world group's timeout, set to ``timeout_s`` here (the ranks joined with the default:
    on a loaded machine one rank may start seconds after the others)."""
    g = comm.world()
    t = torch.ones(8)
    # every rank has started (imported this module) before the short collective timeout
    # counts
    store = progress.store()
    started = "test/skip_collective/started"
    store.add(started, 1)
    deadline = time.monotonic() + 60
    while int(store.add(started, 0)) < g.size and time.monotonic() < deadline:
        time.sleep(0.05)
    comm.all_reduce(t, algorithm="ring")  # #1: everyone
    g.timeout, g.timeout_delta = timeout_s, datetime.timedelta(seconds=timeout_s)
    result: tuple[str, list[int], str] | str = "skipped"
    if g.rank != skipper:
        try:
            comm.all_reduce(t, algorithm=algorithm)  # #2: the skipper never comes
            result = "no error"
        except comm.CollectiveTimeout as exc:
            result = type(exc).__name__, exc.missing, str(exc)
        except comm.CollectiveError as exc:  # a peer that timed out first aborted the call
            result = type(exc).__name__, [], str(exc)
    # No rank leaves before every rank has its verdict: a waiting rank whose peer already
    # timed out and exited would see that peer's closed connection instead of its own timeout
    # (a race under load, not the behaviour under test).
    store.add("test/skip_collective/done", 1)
    deadline = time.monotonic() + 30
    while int(store.add("test/skip_collective/done", 0)) < g.size and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


def mismatched_shape(odd_rank: int) -> tuple[str, list[int], str] | str:
    """Debug mode: one rank passes a different shape; every rank must raise."""
    g = comm.world()
    t = torch.ones(5 if g.rank == odd_rank else 4)
    try:
        comm.all_reduce(t, algorithm="ring")
    except comm.CollectiveMismatch as exc:
        return type(exc).__name__, exc.disagreeing, str(exc)
    return "no error"


def p2p_ring(numel: int) -> list[float]:
    """Pass a tensor around the ring with send/recv, each rank adding its rank."""
    g = comm.world()
    t = torch.zeros(numel)
    if g.rank == 0:
        comm.send(t + 1, 1, tag=5)
        comm.recv(t, g.size - 1, tag=5)
    else:
        comm.recv(t, g.rank - 1, tag=5)
        comm.send(t + 1, (g.rank + 1) % g.size, tag=5)
    return t.tolist()


def rank_and_env() -> tuple[int, int, str, str]:
    w = plait.world()
    return w.rank, w.size, os.environ["LOCAL_RANK"], w.backend


def fail_on(rank: int) -> int:
    if plait.world().rank == rank:
        raise KeyError("deliberate failure")
    return rank


def die_on(rank: int) -> int:
    if plait.world().rank == rank:
        os._exit(3)
    time.sleep(30)
    return rank


def sleep_on(rank: int, seconds: float) -> int:
    if plait.world().rank == rank:
        time.sleep(seconds)
    return plait.world().rank


def debug_setting() -> tuple[bool, str | None]:
    """This rank's world group's debug flag and the PLAIT_DEBUG it sees."""
    return plait.world().debug, os.environ.get("PLAIT_DEBUG")
