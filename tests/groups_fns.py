"""Rank functions for tests/test_group_lifetime.py: groups that are made and destroyed."""

from __future__ import annotations

import os
from typing import Any

import torch

import plait
from plait import comm, runtime


def threads() -> int:
    """This process's thread count (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/task"))


def many_groups(n: int) -> int:
    """Make ``n`` groups over the whole world plus a 2-dimensional mesh, use each once, and
    leave them for the pool to destroy; the threads this rank held at the end."""
    groups = [plait.new_group(range(plait.world().size), name=f"many{i}") for i in range(n)]
    mesh = plait.Mesh(dp=1, tp=plait.world().size)
    for g in [*groups, mesh.group("tp"), mesh.group("dp")]:
        comm.all_reduce(torch.ones(8), group=g)
    comm.all_reduce(torch.ones(8), group=groups[0], async_op=True).wait()  # its worker thread
    return threads()


def destroyed_by_hand(n: int) -> dict[str, Any]:
    """Threads before, with ``n`` live groups, after destroy_group; the errors that using a
    destroyed group, a destroyed mesh and destroying the world give."""
    world = plait.world()
    before = threads()
    groups = [plait.new_group(range(world.size), name=f"hand{i}") for i in range(n)]
    for g in groups:
        comm.all_reduce(torch.ones(4), group=g)
    with_groups = threads()
    for g in groups:
        plait.destroy_group(g)
    plait.destroy_group(None)  # a rank outside a group holds None: nothing to do
    after_groups = threads()
    with plait.Mesh(dp=1, tp=world.size) as mesh:
        comm.all_reduce(torch.ones(4), group=mesh.group("tp"))
        sub = mesh.submesh("dp", "tp")  # a flattened group: the mesh destroys it too
        comm.all_reduce(torch.ones(4), group=sub.group("dp", "tp"))
        with_mesh = threads()
    errors = {}
    for what, call in {
        "group": lambda: comm.all_reduce(torch.ones(4), group=groups[0]),
        "mesh": lambda: mesh.group("tp"),
        "world": lambda: plait.destroy_group(world),
    }.items():
        try:
            call()
            errors[what] = "no error"
        except (RuntimeError, ValueError) as exc:
            errors[what] = str(exc)
    return {
        "before": before,
        "with_groups": with_groups,
        "after_groups": after_groups,
        "with_mesh": with_mesh,
        "after_mesh": threads(),
        "live": len(runtime.live_groups()),
        "errors": errors,
    }


def mismatched_all_reduce() -> None:
    """Rank 1 all-reduces another length than rank 0: both raise CollectiveMismatch, and
    the flight recorder dumps each rank's last collectives."""
    comm.all_reduce(torch.ones(8 + plait.world().rank))


def nothing() -> int:
    return plait.world().rank
