"""Rank functions for tests/test_ptdp.py: the GPT trained under PTD-P on a (pp, dp, tp)
mesh, and the same GPT trained in one process on the global batch (the oracle)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.strategies.compose import compose

STEPS, BATCH, LR = 3, 4, 1e-2


@dataclass(frozen=True)
class Case:
    """One layout and its options; ``accumulate`` batches per optimizer step."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    moe: float | None = None  # MoE blocks with this capacity factor (None: dense MLPs)
    batch: int = BATCH
    microbatches: int = 2
    zero: int = 0
    sp: bool = False
    tied: bool = False
    clip: float | None = None
    accumulate: int = 1
    schedule: str = "1f1b"
    via_prepare: bool = False  # through prepare_ptdp (plait.prepare's "ptdp") instead
    pad_to_capacity: bool = False  # MoE dispatch padded to capacity (the oracle: dropless)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        dims = (("pp", self.pp), ("dp", self.dp), ("ep", self.ep), ("tp", self.tp))
        parts = [f"{d}{n}" for d, n in dims if n > 1]
        parts += [f"moe{self.moe}"] if self.moe is not None else []
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += ["sp"] if self.sp else []
        parts += ["tied"] if self.tied else []
        parts += [f"clip{self.clip}"] if self.clip is not None else []
        parts += [f"acc{self.accumulate}"] if self.accumulate > 1 else []
        parts += [self.schedule] if self.schedule != "1f1b" else []
        parts += ["padded"] if self.pad_to_capacity else []
        return "x".join(parts)


def config(tied: bool, moe: float | None = None, pad_to_capacity: bool = False) -> GPTConfig:
    # 2 blocks = 4 pipeline layers (pp <= 4); 4 heads, width 16, 8 tokens: tp 1, 2, 4;
    # vocab 13 is padded under tp. With moe: block 1 is a top-2 GShard MoE of 4 experts
    # (random second expert, auxiliary and z-losses on) with capacity factor ``moe``
    # (4.0: C = S, nothing dropped; 1.0: C = 4 of 8 tokens' 16 choices, some dropped)
    experts = None
    if moe is not None:
        experts = MoEConfig(
            num_experts=4,
            top_k=2,
            capacity_factor=moe,
            z_loss_weight=1e-3,
            seed=7,
            pad_to_capacity=pad_to_capacity,
        )
    return GPTConfig(
        vocab=13,
        layers=2,
        heads=4,
        width=16,
        seq_len=8,
        tied=tied,
        dtype=torch.float64,
        moe=experts,
    )


def mesh_of(case: Case) -> plait.Mesh:
    """``Mesh(pp, dp, tp)``, with ``ep`` when the case has MoE blocks."""
    if case.moe is None:
        return plait.Mesh(pp=case.pp, dp=case.dp, tp=case.tp)
    return plait.Mesh(pp=case.pp, dp=case.dp, ep=case.ep, tp=case.tp)


def batch(step: int, cfg: GPTConfig, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def oracle(case: Case) -> dict[str, Any]:
    """One process, the dense GPT, each optimizer step on the union of its batches."""
    cfg = config(case.tied, case.moe)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        parts = [batch(step * case.accumulate + a, cfg, case.batch) for a in range(case.accumulate)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        for a in range(case.accumulate):
            with torch.no_grad():
                rows = slice(a * case.batch, (a + 1) * case.batch)
                losses.append(
                    F.cross_entropy(logits[rows].reshape(-1, cfg.vocab), y[rows].reshape(-1)).item()
                )
        if case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip).item())
        opt.step()
    return {"state": model.state_dict(), "losses": losses, "norms": norms}


def train(case: Case) -> dict[str, Any]:
    """This rank's part of ``case`` for STEPS optimizer steps; the dense state at the end."""
    cfg = config(case.tied, case.moe, case.pad_to_capacity)
    mesh = mesh_of(case)
    model = GPT(cfg)

    def via_prepare(model: Any, optimizer: Any, **options: Any) -> Any:
        return plait.prepare(model, optimizer, strategy="ptdp", **options)

    build = via_prepare if case.via_prepare else compose
    built = build(
        model,
        torch.optim.Adam(model.parameters(), lr=LR),
        mesh=mesh,
        sequence_parallel=case.sp,
        schedule=case.schedule,
        microbatches=case.microbatches,
        zero=case.zero,
        **case.options,
    )
    ptdp = built[0] if isinstance(built, tuple) else built
    del model
    opt = ptdp.optimizer
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for a in range(case.accumulate):
            x, y = batch(step * case.accumulate + a, cfg, case.batch)
            losses.append(ptdp.step(x, y).item())
        if case.clip is not None:
            norms.append(ptdp.clip_grad_norm_(case.clip).item())
        opt.step()
    return {
        "state": ptdp.full_state_dict(),
        "losses": losses,
        "norms": norms,
        "local": sum(p.numel() for p in ptdp.parameters()),
    }


def refused(case: Case, *, size: int = BATCH) -> str:
    """The error compose (or the first step) raises for ``case``, or 'NOT REFUSED'."""
    cfg = config(case.tied)
    mesh = plait.Mesh(pp=case.pp, dp=case.dp, tp=case.tp)
    model = GPT(cfg)
    try:
        ptdp = compose(
            model,
            torch.optim.Adam(model.parameters(), lr=LR),
            mesh=mesh,
            sequence_parallel=case.sp,
            microbatches=case.microbatches,
            zero=case.zero,
            **case.options,
        )
        ptdp.step(*batch(0, cfg, size))
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"


def evaluate_then_train(evaluate: bool) -> dict[str, torch.Tensor]:
    """Mesh(pp=2, dp=2, tp=1): optionally one step on another batch whose gradients are
    zeroed (an evaluation), then one training step; the dense state after it."""
    cfg = config(tied=False)
    model = GPT(cfg)
    ptdp = compose(
        model,
        torch.optim.Adam(model.parameters(), lr=LR),
        mesh=plait.Mesh(pp=2, dp=2, tp=1),
        microbatches=2,
    )
    opt = ptdp.optimizer
    if evaluate:
        ptdp.step(*batch(99, cfg))
        opt.zero_grad()
    ptdp.step(*batch(0, cfg))
    opt.step()
    return ptdp.full_state_dict()


def build(case: Case, **options: Any) -> Any:
    """The PTDP of ``case`` on a fresh GPT (Adam, LR)."""
    model = GPT(config(case.tied, case.moe))
    return compose(
        model,
        torch.optim.Adam(model.parameters(), lr=LR),
        mesh=mesh_of(case),
        sequence_parallel=case.sp,
        schedule=case.schedule,
        microbatches=case.microbatches,
        zero=case.zero,
        **options,
    )


def train_scaled(case: Case, inject: tuple[int, int] | None) -> dict[str, Any]:
    """``case`` under plait.amp's DynamicLossScaler (scale 2**10) for STEPS steps;
    ``inject = (global rank, step)``: that rank writes inf into one of its gradients after
    that step's backward. Returns the dense state, the losses, norms, which steps were
    taken, and the scale after each."""
    from plait.amp import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0**10)
    ptdp = build(case, scaler=scaler)
    cfg = config(case.tied, case.moe)
    opt = ptdp.optimizer
    losses, norms, stepped, scales = [], [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(ptdp.step(*batch(step, cfg, case.batch)).item())
        if inject is not None and inject == (plait.world().global_rank, step):
            grad = ptdp.parameters()[-1].grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")
        if case.clip is not None:
            norms.append(ptdp.clip_grad_norm_(case.clip).item())
        stepped.append(scaler.step(opt))
        scales.append(scaler.scale_value)
    return {
        "state": ptdp.full_state_dict(),
        "losses": losses,
        "norms": norms,
        "stepped": stepped,
        "scales": scales,
    }


def oracle_skipping(case: Case, skip: int | None) -> dict[str, Any]:
    """One process, the dense GPT, optimizer step ``skip`` not taken (its gradients
    dropped), as a loss scaler does after an overflow."""
    cfg = config(case.tied, case.moe)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, cfg, case.batch)
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        if step == skip:
            if case.clip is not None:
                norms.append(float("nan"))
            continue
        if case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip).item())
        opt.step()
    return {"state": model.state_dict(), "losses": losses, "norms": norms}


def train_and_save(case: Case, root: str) -> dict[str, Any]:
    """``case`` for STEPS steps, saved to ``root`` through plait.checkpoint; the dense
    state (model and Adam) as :meth:`PTDP.state_dict` assembles it."""
    ptdp = build(case)
    cfg = config(case.tied, case.moe)
    for step in range(STEPS):
        ptdp.optimizer.zero_grad()
        ptdp.step(*batch(step, cfg, case.batch))
        ptdp.optimizer.step()
    ptdp.save(root, step=STEPS)
    return ptdp.state_dict()


def load_into(case: Case, root: str) -> dict[str, Any]:
    """A fresh PTDP of ``case`` loaded from ``root``; its dense state, then the dense
    model after one more step (to compare with the saving layout's continuation)."""
    ptdp = build(case)
    ptdp.load(root)
    state = ptdp.state_dict()
    cfg = config(case.tied, case.moe)
    ptdp.optimizer.zero_grad()
    ptdp.step(*batch(STEPS, cfg, case.batch))
    ptdp.optimizer.step()
    return {**state, "next": ptdp.full_state_dict()}


def load_one_process(tied: bool, moe: float | None, root: str) -> dict[str, Any]:
    """The dense GPT and a plain Adam loaded from ``root`` with plait.checkpoint.load, and
    the model after one more step on the global batch."""
    from plait import checkpoint

    cfg = config(tied, moe)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    checkpoint.load(root, model=model, optimizer=opt)
    state = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
    }
    opt.zero_grad()
    x, y = batch(STEPS, cfg)
    F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1)).backward()
    opt.step()
    return {**state, "next": model.state_dict()}
