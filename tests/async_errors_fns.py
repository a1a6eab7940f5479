"""Rank functions for tests/test_async_errors.py: every path of an asynchronous
collective or a send/recv carries a peer's failure to the caller as a CollectiveError."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch

from plait import comm
from plait.comm import Group

TIMEOUT_S = 1.0  # the sub-groups' collective timeout: the peer that "raises" never comes


def _handle_wait(g: Group) -> Any:
    comm.all_reduce(torch.ones(4), group=g, async_op=True).wait()  # type: ignore[union-attr]


def _future_wait(g: Group) -> Any:
    return comm.all_reduce(torch.ones(4), group=g, async_op=True).get_future().wait()  # type: ignore[union-attr]


def _future_then(g: Group) -> Any:
    h = comm.all_reduce(torch.ones(4), group=g, async_op=True)
    chained = h.get_future().then(lambda f: f.value())  # type: ignore[union-attr]
    return chained.wait()


def _native_async(g: Group) -> Any:
    h = comm.all_reduce(torch.ones(4), group=g, algorithm="native", async_op=True)
    return h.get_future().then(lambda f: f.value()).wait()  # type: ignore[union-attr]


def _native_fast_path(g: Group) -> Any:
    g.check = False  # the backend's own future (Group.start_native), unchecked
    h = comm.all_reduce(torch.ones(4), group=g, algorithm="native", async_op=True)
    assert h is not None and isinstance(h._future, torch._C.Future)
    return h.get_future().then(lambda f: f.value()).wait()


def _native_fast_path_wait(g: Group) -> Any:
    g.check = False
    h = comm.all_reduce(torch.ones(4), group=g, algorithm="native", async_op=True)
    h.wait()  # type: ignore[union-attr]


def _send(g: Group) -> Any:
    comm.send(torch.ones(4), 1, group=g)


def _recv(g: Group) -> Any:
    comm.recv(torch.ones(4), 1, group=g)


PATHS: dict[str, Callable[[Group], Any]] = {
    "handle_wait": _handle_wait,
    "future_wait": _future_wait,
    "future_then": _future_then,
    "native_async": _native_async,
    "native_fast_path": _native_fast_path,
    "native_fast_path_wait": _native_fast_path_wait,
    "send": _send,
    "recv": _recv,
}


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        value = fn()
    except comm.CollectiveError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # torch re-wraps errors raised inside .then callbacks
        return type(exc).__name__, str(exc)
    return "no error", repr(value)


def peer_raises(names: list[str]) -> dict[str, tuple[str, str]]:
    """Rank 1 raises instead of taking part (each path on a new sub-group). The
    backend's own future (``native_fast_path``) is bounded by the process group's timeout,
    not plait's, so it is tested with a peer that exits only."""
    out = {}
    for name in names:
        g = comm.new_group([0, 1], name=f"a-{name}", timeout=60)  # connecting takes time
        assert g is not None
        g.timeout, g.timeout_delta = TIMEOUT_S, datetime.timedelta(seconds=TIMEOUT_S)
        if g.rank == 1:
            try:
                raise RuntimeError("deliberate failure on rank 1")
            except RuntimeError:
                continue
        out[name] = _outcome(lambda g=g, name=name: PATHS[name](g))
    return out


def peer_exits(names: list[str]) -> dict[str, tuple[str, str]] | None:
    """Rank k (1..len(names)) exits the process while rank 0 runs ``names[k - 1]`` on
    the sub-group [0, k]."""
    groups = [comm.new_group([0, k], name=f"x-{n}") for k, n in enumerate(names, 1)]
    me = comm.world().rank
    if me > 0:
        os._exit(3)
    out = {}
    for name, g in zip(names, groups, strict=True):
        assert g is not None
        out[name] = _outcome(lambda g=g, name=name: PATHS[name](g))
    return out
