"""Every path of an async collective or a send/recv raises a CollectiveError naming the
collective (and the peer) when a peer raises or exits: Handle.wait, get_future().then,
the backend's own async collective, posting a send or receive."""

from __future__ import annotations

from plait import RankPool
from tests import async_errors_fns

PATHS = [p for p in async_errors_fns.PATHS if not p.startswith("native_fast_path")]


def test_peer_that_raises_reaches_every_path():
    with RankPool(2, timeout=60) as pool:
        results = pool.run(async_errors_fns.peer_raises, PATHS, timeout=240)
    for name in PATHS:
        kind, message = results[0][name]
        if name in ("future_then", "native_async"):
            # torch turns an error raised in a .then callback into a RuntimeError carrying
            # its text: the chained future carries the CollectiveTimeout, not a value
            assert kind == "RuntimeError" and "CollectiveTimeout" in message, (name, message)
        else:
            assert kind == "CollectiveTimeout", (name, kind, message)
        assert f"'a-{name}'" in message and "rank 1" in message, (name, message)
        collective = name if name in ("send", "recv") else "all_reduce"
        assert collective in message, (name, message)


def test_peer_that_exits_reaches_the_caller():
    exits = ["handle_wait", "native_fast_path", "native_fast_path_wait", "send"]
    world = len(exits) + 1
    with RankPool(world, timeout=60) as pool:
        results = pool.run(
            async_errors_fns.peer_exits, exits, timeout=120, may_exit=set(range(1, world))
        )
    for k, path in enumerate(exits, 1):
        kind, message = results[0][path]
        if path == "native_fast_path":  # through a .then callback: torch re-wraps it
            assert kind == "RuntimeError" and "CollectiveError" in message, (kind, message)
        else:
            assert kind in ("CollectiveError", "CollectiveTimeout"), (kind, message)
        assert f"rank {k}" in message and f"'x-{path}'" in message, message
