"""Rank functions for tests/test_tensor_gpt.py: the GPT under tensor (and sequence)
parallelism against the single-process oracle, and plans that must be refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint
from plait.models import GPT, MLP, GPTConfig
from plait.models.gpt import tp_plan
from plait.strategies.tensor import loss_fn, parallelize

STEPS, BATCH = 3, 2


def config(tied: bool) -> GPTConfig:
    # vocab 13 is padded at t = 2 and 4; width 16, 4 heads, 8 tokens: divisible by 1, 2, 4
    return GPTConfig(
        vocab=13, layers=2, heads=4, width=16, seq_len=8, tied=tied, dtype=torch.float64
    )


def batch(step: int, cfg: GPTConfig, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def oracle(tied: bool, size: int = BATCH) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the dense GPT, the same (global) batches."""
    cfg = config(tied)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, cfg, size)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def train(tied: bool, sequence_parallel: bool) -> dict[str, Any]:
    """Every rank of the world is one tensor-parallel rank; train STEPS Adam steps."""
    cfg = config(tied)
    mesh = plait.Mesh(tp=plait.world().size)
    model = GPT(cfg)
    dense_numel = {n: p.numel() for n, p in model.named_parameters()}
    model, opt = plait.prepare(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        strategy="tp",
        mesh=mesh,
        sequence_parallel=sequence_parallel,
    )
    assert opt is not None
    loss_of = loss_fn(model)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, cfg)
        opt.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    local_numel = {n: p.numel() for n, p in model.named_parameters()}
    return {
        "state": checkpoint.full_state_dict(model),
        "losses": losses,
        "dense_numel": dense_numel,
        "local_numel": local_numel,
        "tied": model.head.weight is model.tok.weight,
    }


def train_dp_tp(sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """4 ranks as Mesh(dp=2, tp=2): the GPT split over tp, replicated over dp under plait's
    DDP on the dp group; each dp rank trains on its half of a global batch of 4."""
    cfg = config(tied=False)
    mesh = plait.Mesh(dp=2, tp=2)
    model = parallelize(GPT(cfg), mesh, tp_plan(cfg, sequence_parallel=sequence_parallel))
    ddp = plait.DistributedDataParallel(model, group=mesh.group("dp"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of = loss_fn(model)
    d = mesh.rank("dp")
    for step in range(STEPS):
        x, y = batch(step, cfg, 2 * BATCH)
        opt.zero_grad()
        loss_of(ddp(x[d * BATCH : (d + 1) * BATCH]), y[d * BATCH : (d + 1) * BATCH]).backward()
        opt.step()
    return checkpoint.full_state_dict(model)


def refusals() -> dict[str, str]:
    """Bad plans and sizes on a tensor-parallel group of 2; the error of each."""
    mesh = plait.Mesh(tp=plait.world().size)
    cases: dict[str, Any] = {
        "heads": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=3, width=12, layers=1)),
            mesh,
            tp_plan(GPTConfig(vocab=16, heads=3, width=12, layers=1)),
        ),
        "width": lambda: parallelize(MLP((4, 5, 2), seed=0), mesh, {"layers.0": "colwise"}),
        "unknown": lambda: parallelize(MLP((4, 6, 2), seed=0), mesh, {"layer.0": "colwise"}),
        "style": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=8, layers=1)), mesh, {"tok": "colwise"}
        ),
        "uncovered": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=8, layers=1)),
            mesh,
            {
                k: v
                for k, v in tp_plan(GPTConfig(layers=1), sequence_parallel=True).items()
                if k != "ln_f"
            },
        ),
        "half_tied": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=8, layers=1, tied=True)), mesh, {"tok": "vocab"}
        ),
        "mha": lambda: parallelize(_WithMHA(), mesh, {"mha.out_proj": "rowwise"}),
        "no_plan": lambda: plait.prepare(MLP((4, 6, 2)), strategy="tp", mesh=mesh),
        "dropout": lambda: parallelize(
            GPT(GPTConfig(vocab=16, heads=2, width=8, layers=1, dropout=0.1)),
            mesh,
            tp_plan(GPTConfig(layers=1)),
        ),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"
    return out


class _WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2)
