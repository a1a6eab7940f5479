"""Rank functions for tests/test_mesh.py."""

from __future__ import annotations

import time
from typing import Any

import torch

import plait
from plait import comm


def two_meshes() -> dict[str, Any]:
    """Build two meshes in one process; reduce along each dimension of both."""
    a = plait.Mesh(dp=2, tp=2)
    b = plait.Mesh(tp=4)
    out: dict[str, Any] = {"a": {}, "b": {}}
    for name, mesh in (("a", a), ("b", b)):
        for dim in mesh.names:
            g = mesh.group(dim)
            t = torch.tensor([float(plait.world().rank)])
            comm.all_reduce(t, group=g)
            out[name][dim] = (list(g.ranks), mesh.rank(dim), mesh.size(dim), float(t))
    sub = a.submesh("dp", "tp")
    t = torch.ones(1)
    comm.all_reduce(t, group=sub.group("dp", "tp"))
    out["flat"] = (list(sub.group("dp", "tp").ranks), float(t))
    out["text"] = str(a)
    return out


def another_mesh_on_rank(odd: int, timeout: float) -> tuple[str, float]:
    """Rank ``odd`` builds Mesh(pp=4) where the others build Mesh(pp=2, tp=2), each mesh
    with ``timeout`` (its agreement and group creation wait at most that); the error and
    the seconds until it was raised."""
    start = time.monotonic()
    try:
        if plait.world().rank == odd:
            plait.Mesh(pp=4, timeout=timeout)
        else:
            plait.Mesh(pp=2, tp=2, timeout=timeout)
    except ValueError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start
