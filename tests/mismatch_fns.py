"""Rank functions for tests/test_mismatch.py: ranks that disagree on a collective.

Each scenario runs on a fresh two-rank sub-group (a failed group cannot be used again),
so one world of two ranks runs them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import plait
from plait import comm
from plait.comm import Group


def _shape(g: Group) -> None:
    comm.all_reduce(torch.ones(5 if g.rank == 1 else 4), group=g)


def _shape_native(g: Group) -> None:
    comm.all_reduce(torch.ones(5 if g.rank == 1 else 4), group=g, algorithm="native")


def _shape_ring(g: Group) -> None:
    comm.all_reduce(torch.ones(1000 if g.rank == 1 else 1024), group=g, algorithm="ring")


def _dtype(g: Group) -> None:
    comm.all_reduce(torch.ones(4, dtype=torch.float64 if g.rank == 1 else torch.float32), group=g)


def _op(g: Group) -> None:
    comm.all_reduce(torch.ones(4), "max" if g.rank == 1 else "sum", group=g)


def _int_vs_float(g: Group) -> None:
    comm.all_reduce(torch.ones(4, dtype=torch.int32 if g.rank == 1 else torch.float32), group=g)


def _skip(g: Group) -> None:
    """Rank 1 skips the all-reduce and goes on to the next collective (a broadcast)."""
    t = torch.ones(4)
    if g.rank == 0:
        comm.all_reduce(t, group=g)
    comm.broadcast(t, 0, group=g)


def _barrier(g: Group) -> None:
    """Rank 1 waits in a barrier while rank 0 all-reduces."""
    if g.rank == 1:
        comm.barrier(group=g)
    else:
        comm.all_reduce(torch.ones(4), group=g)


def _zero_state_dict(g: Group) -> None:
    """A 2-rank ZeroOptimizer; one step on both; state_dict() on rank 0 only (as a
    script saving a checkpoint from rank 0 does); then a step on both."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    zero = plait.ZeroOptimizer(model.parameters(), torch.optim.Adam, group=g, lr=0.1)

    def step() -> None:
        zero.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        zero.step()

    step()
    _mark()  # detection is timed from here
    if g.rank == 0:
        zero.state_dict()
    step()


_started: list[float] = []


def _mark() -> None:
    _started.append(time.monotonic())


SCENARIOS: dict[str, Callable[[Group], None]] = {
    "shape": _shape,
    "shape_native": _shape_native,
    "shape_ring": _shape_ring,
    "dtype": _dtype,
    "op": _op,
    "int32_vs_float32": _int_vs_float,
    "skip": _skip,
    "barrier": _barrier,
    "zero_state_dict_on_rank0": _zero_state_dict,
}


def run(names: list[str]) -> dict[str, Any]:
    """Run each named scenario on a new sub-group; what each raised, and after how long."""
    out: dict[str, Any] = {}
    for name in names:
        g = comm.new_group([0, 1], name=f"m-{name}")
        assert g is not None
        _started[:] = [time.monotonic()]
        try:
            SCENARIOS[name](g)
            out[name] = ("no error", [], "", time.monotonic() - _started[-1])
        except comm.CollectiveError as exc:
            disagreeing = getattr(exc, "disagreeing", [])
            elapsed = time.monotonic() - _started[-1]
            out[name] = (type(exc).__name__, disagreeing, str(exc), elapsed)
    return out


def agree_after() -> float:
    """The world group still works after the sub-groups failed."""
    t = torch.ones(3)
    comm.all_reduce(t)
    return float(t.sum())
