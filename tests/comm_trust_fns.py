"""Rank functions for the collectives' and transports' trust tests (importable by the
spawned ranks)."""

from __future__ import annotations

import torch

from plait import comm
from plait.comm import SUPPORTED
from plait.comm.ops import shared


def _algorithms(collective: str) -> list[str]:
    g = comm.world()
    return [a for a in SUPPORTED[collective] if a != "shm" or shared(g)]


def half_values(rank: int) -> torch.Tensor:
    """Rank ``rank``'s random float16 values, up to 65000 in magnitude."""
    gen = torch.Generator().manual_seed(11 + rank)
    return ((torch.rand(37, generator=gen, dtype=torch.float64) * 2 - 1) * 65000).half()


def half_avg() -> dict[str, list[float]]:
    """fp16 ``avg`` of large and of random values by every algorithm of all_reduce, reduce
    and reduce_scatter, sync and async; every result as a list of floats."""
    g = comm.world()
    out: dict[str, list[float]] = {}
    big = torch.full((5,), 60000.0, dtype=torch.float16)
    for name, value in (("big", big), ("random", half_values(g.rank))):
        for algo in _algorithms("all_reduce"):
            t = value.clone()
            comm.all_reduce(t, "avg", algorithm=algo)
            out[f"all_reduce {algo} {name}"] = t.tolist()
            t = value.clone()
            h = comm.all_reduce(t, "avg", algorithm=algo, async_op=True)
            assert h is not None
            h.wait()
            out[f"all_reduce async {algo} {name}"] = t.tolist()
        for algo in _algorithms("reduce"):
            t = value.clone()
            comm.reduce(t, 0, "avg", algorithm=algo)
            out[f"reduce {algo} {name}"] = t.tolist()
        whole = value[: (value.numel() // g.size) * g.size]
        for algo in _algorithms("reduce_scatter"):
            o = torch.empty(whole.numel() // g.size, dtype=torch.float16)
            kept = whole.clone()
            comm.reduce_scatter(o, whole, "avg", algorithm=algo)
            assert torch.equal(kept, whole), "reduce_scatter modified its input"
            out[f"reduce_scatter {algo} {name}"] = o.tolist()
    return out
