"""Rank functions for tests/test_moe_padded.py: the MoE layer's static-capacity dispatch
(``pad_to_capacity=True``) against the dropless one and its byte count."""

from __future__ import annotations

from typing import Any

import torch

import plait
from plait import comm
from plait.moe import MoE, expert_parallel
from tests.moe_fns import D, E, _loss, global_batch, layer_case

ROWS = 2  # sequences per rank


def padded_bytes() -> dict[str, Any]:
    """One forward/backward of the padded layer on the ring all-to-all: what was sent,
    which collectives ran, and what the layer's statistics say about the rows moved."""
    R = plait.world().size
    mesh = plait.Mesh(ep=R)
    torch.manual_seed(3)
    moe = MoE(D, **(layer_case("top2_random") | {"pad_to_capacity": True}))
    with torch.no_grad():
        moe.gate.weight[0] += 0.8
    expert_parallel(moe, mesh=mesh, algorithm="ring")
    r = mesh.rank("ep")
    first = {}
    for step in range(2):  # the first step agrees on (G, C); the second is measured
        x = global_batch(ROWS * R, step)[ROWS * r : ROWS * (r + 1)]
        comm.reset_stats()
        _loss(moe(x.requires_grad_(True))).backward()
        sent = {key: (s.calls, s.bytes_sent) for key, s in comm.stats().items() if s.calls}
        first = first or sent
    stats = moe.last_stats
    assert stats is not None
    return {
        "first": first,
        "sent": sent,
        "capacity": stats.capacity,
        "rows": (stats.rows_out, stats.rows_in),
        "dropped": stats.dropped,
    }


def uneven_groups() -> str:
    """Rank 0 routes 2 sequences, rank 1 one: refused on every rank before the all-to-all."""
    mesh = plait.Mesh(ep=plait.world().size)
    torch.manual_seed(3)
    moe = expert_parallel(MoE(D, **(layer_case("top1") | {"pad_to_capacity": True})), mesh=mesh)
    rows = 2 if mesh.rank("ep") == 0 else 1
    try:
        moe(global_batch(rows))
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"


__all__ = ["ROWS", "E", "padded_bytes", "uneven_groups"]
