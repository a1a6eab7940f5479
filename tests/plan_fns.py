"""Rank functions for tests/test_plan_local.py: the reference GPT trained one Adam step
under a layout on real ranks, and the model-state bytes ``plait.plan.memory.measure``
reads there (with the rank's coordinates, to pick the planner's matching rank)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig, tp_plan
from plait.plan import memory
from plait.strategies.pipeline.parallel import prepare_pipeline
from plait.strategies.tensor import loss_fn, parallelize

BATCH = 8


def config(layers: int, experts: int = 0) -> GPTConfig:
    # vocab 96: a multiple of 4 (tp pads nothing); width 64, 4 heads; blocks 1, 3, ... MoE
    moe = MoEConfig(num_experts=experts) if experts else None
    return GPTConfig(vocab=96, layers=layers, heads=4, width=64, seq_len=16, moe=moe)


def _batch(cfg: GPTConfig, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _bytes(model: Any, opt: Any) -> dict[str, float]:
    m = memory.measure(model, opt)
    return {
        "params": m.params_bytes,
        "grads": m.grads_bytes,
        "optimizer": m.optimizer_bytes,
        "total": m.total_bytes,
    }


def measured(kind: str, layers: int) -> dict[str, Any]:
    """One Adam step of the GPT under ``kind``; this rank's bytes and coordinates.

    ``kind``: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` (every rank data-parallel),
    ``"tp"`` (every rank tensor-parallel), ``"dp2tp2"`` (tp inside, plait's DDP over dp),
    ``"pp"`` (every rank a 1F1B pipeline stage), ``"ep4"`` / ``"dp2ep2"`` (the MoE GPT with
    4 experts under ``strategy="ep"``)."""
    cfg = config(layers, experts=4 if kind in ("ep4", "dp2ep2") else 0)
    world = plait.world()
    x, y = _batch(cfg, BATCH)
    model = GPT(cfg)
    if kind in ("ddp", "zero1", "zero2", "fsdp"):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        extra = {"wrap": {type(model.blocks[0])}} if kind == "fsdp" else {}
        wrapped, opt2 = plait.prepare(model, opt, strategy=kind, **extra)
        assert opt2 is not None
        share = BATCH // world.size
        xs, ys = x[world.rank * share :][:share], y[world.rank * share :][:share]
        F.cross_entropy(wrapped(xs).reshape(-1, cfg.vocab), ys.reshape(-1)).backward()
        opt2.step()
        return {"bytes": _bytes(wrapped, opt2), "pp_rank": 0}
    if kind == "tp":
        mesh = plait.Mesh(tp=world.size)
        wrapped, opt2 = plait.prepare(
            model, torch.optim.Adam(model.parameters(), lr=1e-3), strategy="tp", mesh=mesh
        )
        assert opt2 is not None
        loss_fn(wrapped)(wrapped(x), y).backward()
        opt2.step()
        return {"bytes": _bytes(wrapped, opt2), "pp_rank": 0}
    if kind == "dp2tp2":
        mesh = plait.Mesh(dp=2, tp=2)
        tp_model = parallelize(model, mesh, tp_plan(layers=cfg.layers))
        ddp = plait.DistributedDataParallel(tp_model, group=mesh.group("dp"))
        opt = torch.optim.Adam(tp_model.parameters(), lr=1e-3)
        d = mesh.rank("dp")
        half = BATCH // 2
        loss_fn(tp_model)(
            ddp(x[d * half : (d + 1) * half]), y[d * half : (d + 1) * half]
        ).backward()
        opt.step()
        return {"bytes": _bytes(tp_model, opt), "pp_rank": 0}
    if kind == "pp":
        mesh = plait.Mesh(pp=world.size)
        pipe, opt2 = prepare_pipeline(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            mesh=mesh,
            schedule="1f1b",
            microbatches=4,
        )
        assert opt2 is not None
        pipe.step(x, y)
        opt2.step()
        stage_params = [p for st in pipe.stages.values() for p in st.parameters()]
        stage_state = [
            t
            for p in stage_params
            for t in opt2.state.get(p, {}).values()
            if isinstance(t, torch.Tensor)
        ]
        grads = [p.grad for p in stage_params if p.grad is not None]

        class _Held:
            def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
                return {"params": stage_params, "grads": grads, "optimizer_state": stage_state}

        return {
            "bytes": _bytes(_Held(), None),
            "pp_rank": mesh.rank("pp"),
            "partition": str(pipe.partition),
        }
    if kind in ("ep4", "dp2ep2"):
        mesh = plait.Mesh(ep=4) if kind == "ep4" else plait.Mesh(ep=2, dp=2)
        wrapped, opt2 = plait.prepare(
            model, torch.optim.Adam(model.parameters(), lr=1e-3), strategy="ep", mesh=mesh
        )
        assert opt2 is not None
        b = wrapped.plait_expert_parallel.batch_rank
        share = BATCH // world.size
        xs, ys = x[b * share : (b + 1) * share], y[b * share : (b + 1) * share]
        F.cross_entropy(wrapped(xs).reshape(-1, cfg.vocab), ys.reshape(-1)).backward()
        opt2.step()
        return {"bytes": _bytes(wrapped, opt2), "pp_rank": 0}
    raise ValueError(f"unknown layout kind {kind!r}")
