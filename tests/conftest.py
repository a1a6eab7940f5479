"""Shared fixtures: one pool of ranks per world size, reused across tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from plait import RankPool

_pools: dict[tuple[int, str], RankPool] = {}


def _pool(world_size: int, env_key: str = "", env: dict[str, str] | None = None) -> RankPool:
    key = (world_size, env_key)
    pool = _pools.get(key)
    if pool is None or pool.closed:
        pool = RankPool(world_size, timeout=60, env=env)
        _pools[key] = pool
    return pool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[..., list[Any]]]:
    """``ranks(n, fn, *args, timeout=...)`` runs ``fn`` on a kept pool of n ranks."""

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any
    ) -> list[Any]:
        return _pool(world_size).run(fn, *args, timeout=timeout, **kwargs)

    yield run
    # close the pools side by side: each waits up to a few seconds for its ranks to leave
    with ThreadPoolExecutor(max_workers=max(1, len(_pools))) as closing:
        list(closing.map(RankPool.close, _pools.values()))
    _pools.clear()
