"""What the metrics tests run on every rank (importable by the spawned ranks)."""

from __future__ import annotations

import time
from typing import Any

import torch

import plait
from plait import comm
from plait.metrics import Metrics

NUMEL = 1000  # float32 elements all-reduced by ring on dp once a step: 4000 bytes on 2 ranks


def _world_all_reduces() -> int:
    return sum(
        s.calls for (g, c, _), s in comm.group_stats().items() if g == "world" and c == "all_reduce"
    )


def record_steps(log_dir: str, steps: int) -> dict[str, Any]:
    """``steps`` steps of a known size: 10 ms of data loading, one ring all-reduce on dp,
    a loss of rank + 1, 64 tokens; then the same with tokens that differ between ranks."""
    g = plait.world()
    mesh = plait.Mesh(dp=g.size)
    world_before = _world_all_reduces()
    with Metrics(
        mesh=mesh, log_dir=log_dir, tensorboard=True, flops_per_token=1e3, peak_flops=1e9,
        total=steps,
    ) as m:  # fmt: skip
        for step in range(steps):
            with m.data():
                time.sleep(0.01)
            comm.all_reduce(torch.ones(NUMEL), group=mesh.group("dp"), algorithm="ring")
            m.step(torch.tensor(float(g.rank + 1)), tokens=64, lr=0.1 * step)
    uncounted = _world_all_reduces() == world_before
    try:
        with Metrics(jsonl=False) as bad:
            bad.step(1.0, tokens=64 + g.rank)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    mesh.destroy()
    return {"records": m.records, "summary": m.summary(), "uncounted": uncounted,
            "refused": refused, "info": m.info}  # fmt: skip
