"""Rank functions for tests/test_ptdp_context.py: plait's GPT under PTD-P with a cp
dimension (the sequence split in every pipeline stage) against one process on the whole
sequences, float64."""

from __future__ import annotations

from typing import Any

import torch

import plait
from plait import comm
from tests.context_fns import BATCH, STEPS, _gpt, _tokens


def run(mesh: dict[str, int], context: str, balanced: bool, microbatches: int) -> dict[str, Any]:
    """``plait.prepare(strategy="ptdp", mesh=Mesh(**mesh), context=...)``: STEPS Adam steps
    on the global batch of ``BATCH * dp`` rows (``ptdp.step`` cuts rows over dp and the
    sequence over cp itself)."""
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ptdp, popt = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(**mesh), context=context,
        balanced=balanced, microbatches=microbatches,
    )  # fmt: skip
    comm.reset_stats()
    losses = []
    for step in range(STEPS):
        ids, targets = _tokens(step, 23, BATCH * mesh["dp"])
        popt.zero_grad()
        losses.append(float(ptdp.step(ids, targets)))
        popt.step()
    cp_group = ptdp.mesh.group("cp").name
    sent = sum(v.bytes_sent for key, v in comm.group_stats().items() if key[0] == cp_group)
    # the micro-batch shapes the pipeline ran: (rows, tokens of this rank)
    shapes = [shape for shape, _ in ptdp.pipe.runtime.shapes]
    return {"losses": losses, "state": ptdp.full_state_dict(), "sent": sent, "shapes": shapes}


def refused(mesh: dict[str, int], **options: Any) -> str:
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        plait.prepare(model, opt, strategy="ptdp", mesh=plait.Mesh(**mesh), **options)
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"


def nonfinite(bad_rank: int) -> str:
    """plait's GPT on pp2 x cp2; after one step rank ``bad_rank`` puts a NaN into a weight
    of its stage: every rank's error (the non-finite check sums flags over cp too)."""
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ptdp, popt = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(pp=2, dp=1, tp=1, cp=2), microbatches=2
    )
    ids, targets = _tokens(0, 23, BATCH)
    for step in range(2):
        popt.zero_grad()
        if step == 1 and plait.world().rank == bad_rank:
            with torch.no_grad():
                next(iter(ptdp.parameters())).view(-1)[0] = float("nan")
        ptdp.step(ids, targets)
        try:
            popt.step()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"
