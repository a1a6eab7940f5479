"""Rank functions for tests/test_ptdp_agreement.py: ranks given different settings or
weights are named before any step; a dense state of another shape is refused."""

from __future__ import annotations

import dataclasses

import torch

import plait
from tests import ptdp_fns
from tests.ptdp_fns import LR, Case, build, config, mesh_of


def one_rank_on_another_schedule(odd: int, odd_schedule: str) -> str:
    case = Case(pp=2, tp=2, microbatches=2)
    if plait.runtime.world().rank == odd:
        case = dataclasses.replace(case, schedule=odd_schedule)
    try:
        build(case)
    except ValueError as exc:
        return str(exc)
    return "trained on"


def one_rank_seeded_differently(odd: int) -> str:
    case = Case(pp=2, tp=2, microbatches=2)
    cfg = config(case.tied)
    if plait.runtime.world().rank == odd:
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)
    model = ptdp_fns.GPT(cfg)
    try:
        plait.strategies.compose.compose(
            model, torch.optim.Adam(model.parameters(), lr=LR), mesh=mesh_of(case), microbatches=2
        )
    except ValueError as exc:
        return str(exc)
    return "trained on"


def load_another_vocabulary() -> str:
    case = Case(pp=2, tp=2, microbatches=2)
    ptdp = build(case)
    other = ptdp_fns.GPT(dataclasses.replace(config(case.tied), vocab=17))
    try:
        ptdp.load_state_dict({"model": other.state_dict()})
    except ValueError as exc:
        return str(exc)
    return "loaded"


def nan_on_one_rank(odd: int, mode: str) -> tuple[str, bool]:
    """pp2 x tp2: rank ``odd``'s gradient turns NaN after backward; the optimizer step
    raises (or is skipped) on every rank, naming it."""
    import warnings

    case = Case(pp=2, tp=2, microbatches=2)
    ptdp = build(case, check_finite=mode)
    x, y = ptdp_fns.batch(0, config(case.tied))
    ptdp.step(x, y)
    if plait.runtime.world().rank == odd:
        ptdp.counted[0].param.grad.fill_(float("nan"))
    before = [c.param.detach().clone() for c in ptdp.counted]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ptdp.optimizer.step()
    except FloatingPointError as exc:
        return str(exc), False
    unchanged = all(torch.equal(b, c.param) for b, c in zip(before, ptdp.counted, strict=True))
    return "; ".join(str(w.message) for w in caught), unchanged
