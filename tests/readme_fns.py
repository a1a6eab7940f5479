"""Rank functions for tests/test_readme_snippets.py: the README's Python blocks run as
written, and the PTD-P line's mesh without a ``dp`` dimension."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.models import GPT
from tests.ptdp_fns import batch, config

STEPS, LR = 2, 1e-2


def run_blocks(blocks: list[tuple[str, str]]) -> dict[str, Any]:
    """Run the README's blocks in order in one namespace (each continues the one before,
    as the README says), as ``__main__`` would; what the last ones computed."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    seconds = []
    for where, code in blocks:
        start = time.perf_counter()
        exec(compile(code, where, "exec"), namespace)
        seconds.append(round(time.perf_counter() - start, 1))
    return {
        "ptdp_loss": float(namespace["loss"]),
        "names": sorted(k for k in namespace if not k.startswith("__")),
        "cp_logits": list(namespace["logits"].shape),
        "world": plait.world().size,
        "seconds": seconds,
    }


def ptdp_mesh(full: bool) -> dict[str, Any]:
    """plait's GPT in float64 under ``prepare(strategy="ptdp")`` on ``Mesh(pp=2, tp=2)``
    (``full``: ``Mesh(pp=2, dp=1, tp=2)``), STEPS Adam steps; the dense state at the end."""
    cfg = config(tied=False)
    mesh = plait.Mesh(pp=2, dp=1, tp=2) if full else plait.Mesh(pp=2, tp=2)
    model = GPT(cfg)
    ptdp, opt = plait.prepare(
        model, torch.optim.Adam(model.parameters(), lr=LR), strategy="ptdp", mesh=mesh
    )
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, cfg)
        losses.append(ptdp.step(x, y).item())
        opt.step()
    return {"state": ptdp.full_state_dict(), "losses": losses, "shape": ptdp.mesh.shape}


def ptdp_oracle() -> dict[str, Any]:
    """One process, the dense GPT, the same batches."""
    cfg = config(tied=False)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, cfg)
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(math.isfinite(v) for v in losses)
    return {"state": model.state_dict(), "losses": losses}
