"""Rank functions for tests/test_pipeline.py: the GPT under pipeline parallelism against the
single-process oracle, the measured in-flight micro-batches, and failing stages."""

from __future__ import annotations

import os
from typing import Any

import torch

import plait
from plait import comm
from plait.models import GPT, GPTConfig
from plait.models.gpt import loss as gpt_loss
from plait.models.gpt import pipeline_plan
from plait.strategies.pipeline import PipelineParallel
from plait.trace import Tracer

STEPS = 3


def config(tied: bool, layers: int) -> GPTConfig:
    return GPTConfig(
        vocab=13, layers=layers, heads=2, width=16, seq_len=6, tied=tied, dtype=torch.float64
    )


def batch(step: int, cfg: GPTConfig, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def oracle(tied: bool, layers: int, size: int) -> dict[str, Any]:
    """One process, the dense GPT, the same global batches: first-step gradients, losses
    and the parameters after STEPS Adam steps."""
    cfg = config(tied, layers)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step, cfg, size)
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        losses.append(loss.item())
    return {"state": model.state_dict(), "losses": losses, "grads": grads}


def train(
    schedule: str, m: int, tied: bool, layers: int, recompute: bool, size: int
) -> dict[str, Any]:
    """Every rank is one pipeline rank; train STEPS Adam steps through plait.prepare's
    pipeline entry point."""
    cfg = config(tied, layers)
    mesh = plait.Mesh(pp=plait.world().size)
    model = GPT(cfg)
    pipe, opt = plait.prepare(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        strategy="pipeline",
        mesh=mesh,
        schedule=schedule,
        microbatches=m,
        recompute=recompute,
    )
    assert opt is not None
    losses, grads = [], {}
    sent: dict[str, int] = {}
    for step in range(STEPS):
        x, y = batch(step, cfg, size)
        opt.zero_grad()
        comm.group_stats(reset=True)
        losses.append(pipe.step(x, y).item())
        if step == 1:  # after the first step's shape agreement
            name = mesh.group("pp").name
            for (group, collective, _), st in comm.group_stats().items():
                if group == name:
                    sent[collective] = sent.get(collective, 0) + st.bytes_sent
        if step == 0:
            grads = {
                n: p.grad.clone()
                for stage in pipe.stages.values()
                for n, p in stage.named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        opt.step()
    return {
        "state": pipe.dense_state_dict(),
        "losses": losses,
        "grads": grads,
        "peak": pipe.peak_in_flight,
        "sent": sent,
        "partition": str(pipe.partition),
    }


def traced(schedule: str, m: int, layers: int, steps: int) -> dict[str, Any]:
    """Train with a tracer; return this rank's spans of the last step."""
    cfg = config(False, layers)
    mesh = plait.Mesh(pp=plait.world().size)
    tracer = Tracer(rank=plait.world().rank)
    model = GPT(cfg)
    pipe = PipelineParallel(
        model,
        group=mesh,
        schedule=schedule,
        microbatches=m,
        plan=pipeline_plan(model),
        tracer=tracer,
    )
    for step in range(steps):
        tracer.clear()
        x, y = batch(step, cfg, 2 * m)
        pipe.step(x, y)
    return {"spans": tracer.spans()}


class _Boom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in this stage")


def failing(how: str, bad_rank: int, timeout: float) -> str:
    """One stage raises (``how="raise"``) or its process dies (``"die"``) in its forward;
    every other rank must fail too, naming it. Returns this rank's error message."""
    world = plait.world()
    mesh = plait.Mesh(pp=world.size, timeout=timeout)
    layers = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(world.size)]
    model = torch.nn.Sequential(*layers)
    pipe = PipelineParallel(
        model,
        group=mesh,
        schedule="1f1b",
        microbatches=2,
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
    )
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, x)  # shapes agreed, one good step
    if world.rank == bad_rank:
        stage = pipe.stages[str(bad_rank)]
        if how == "die":
            stage._runs[0] = _die  # type: ignore[index]
        else:
            stage._runs[0] = _Boom()  # type: ignore[index]
    try:
        pipe.step(x, x)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _die(x: torch.Tensor) -> torch.Tensor:
    os._exit(3)


def refusals() -> dict[str, str]:
    """Bad configurations on a pipeline group of 2; the error of each."""
    mesh = plait.Mesh(pp=plait.world().size)
    cfg = config(False, 2)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    gpt = GPT(cfg)
    plan = pipeline_plan(gpt)

    def batch_split() -> None:
        pipe = PipelineParallel(gpt, group=mesh, schedule="1f1b", microbatches=3, plan=plan)
        pipe.step(*batch(0, cfg, 4))

    cases: dict[str, Any] = {
        "interleaved": lambda: PipelineParallel(
            gpt, group=mesh, schedule="interleaved", microbatches=3, plan=plan
        ),
        "zbv_chunks": lambda: PipelineParallel(
            gpt, group=mesh, schedule="zbv", microbatches=4, chunks=3, plan=plan
        ),
        "too_many_stages": lambda: PipelineParallel(
            seq, group=mesh, schedule="zbv", microbatches=4, loss_fn=torch.nn.MSELoss()
        ),
        "no_loss": lambda: PipelineParallel(seq, group=mesh, microbatches=2),
        "no_m": lambda: PipelineParallel(gpt, group=mesh, plan=plan),
        "batch": batch_split,
        "stage_list": lambda: PipelineParallel(
            [torch.nn.Linear(2, 2)] * 3, group=mesh, microbatches=2, loss_fn=torch.nn.MSELoss()
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


def stage_list() -> float:
    """Stages cut by hand: a list of modules, one per stage; returns the loss."""
    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(plait.world().size)]
    mesh = plait.Mesh(pp=plait.world().size)
    pipe = PipelineParallel(
        stages, group=mesh, microbatches=2, loss_fn=lambda o, t: ((o - t) ** 2).mean()
    )
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = pipe.step(x, x)
    assert list(pipe.dense_state_dict()) == [
        f"{plait.world().rank}.weight",
        f"{plait.world().rank}.bias",
    ]
    return float(loss)
