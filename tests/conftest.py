"""Shared fixtures: one pool of ranks per world size, reused across tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from plait import RankPool

_pools: dict[tuple[int, str], RankPool] = {}
_started_with: dict[int, list[int]] = {}  # id(pool) -> each rank's threads once started

# A kept rank's threads after any run: what it started with (its main thread, gloo's three
# for the world group, plait's progress and watch threads, torch's intra-op pool) plus
# THREAD_SLACK for service threads that start on first use and stay (torch's inter-op pool,
# one per core; a test that raises torch.set_num_threads; the world group's worker thread
# after an asynchronous collective). What must not grow is what every group costs: gloo
# keeps three threads (a TCP loop and two run loops) per group until it is destroyed, so
# the suite's ~4,000 groups left alive held ~250 threads per rank. The pool destroys a
# run's groups before it answers (plait/launch/pool.py); this checks it after every run.
THREAD_SLACK = 12


def check_threads(pool: RankPool, what: str) -> None:
    """Fail the test whose run left a kept rank with more threads than the bound."""
    now = pool.threads()
    start = _started_with.setdefault(id(pool), now)
    pairs = enumerate(zip(now, start, strict=True))
    over = [(r, n, s) for r, (n, s) in pairs if n > s + THREAD_SLACK]
    if over:
        pool.close()  # the next test gets a fresh pool
        text = ", ".join(f"rank {r}: {n} threads (started with {s})" for r, n, s in over)
        raise AssertionError(
            f"after {what}, kept ranks hold more than their start + {THREAD_SLACK} "
            f"threads: {text}; something the run made (a group, a thread pool) outlived it"
        )


def _pool(world_size: int, env_key: str = "", env: dict[str, str] | None = None) -> RankPool:
    key = (world_size, env_key)
    pool = _pools.get(key)
    if pool is None or pool.closed:
        pool = RankPool(world_size, timeout=60, env=env)
        _pools[key] = pool
        _started_with[id(pool)] = pool.threads()
    return pool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[..., list[Any]]]:
    """``ranks(n, fn, *args, timeout=...)`` runs ``fn`` on a kept pool of n ranks."""

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any
    ) -> list[Any]:
        pool = _pool(world_size)
        results = pool.run(fn, *args, timeout=timeout, **kwargs)
        check_threads(pool, getattr(fn, "__qualname__", repr(fn)))
        return results

    yield run
    # close the pools side by side: each waits up to a few seconds for its ranks to leave
    with ThreadPoolExecutor(max_workers=max(1, len(_pools))) as closing:
        list(closing.map(RankPool.close, _pools.values()))
    _pools.clear()
