"""Rank functions for tests/test_plan_local.py: the reference GPT trained one Adam step
under a planner layout on real ranks (:func:`plait.plan.measure.execute.build`), and the
model-state bytes ``plait.plan.memory.measure`` reads there, with the rank's pipeline
coordinate (to pick the planner's matching rank)."""

from __future__ import annotations

from typing import Any

import torch

from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.plan import memory
from plait.plan.layout import Job, Layout
from plait.plan.measure import execute

BATCH = 8


def config(layers: int, experts: int = 0) -> GPTConfig:
    # vocab 96: a multiple of 4 and 8 (tp pads nothing); width 64, 8 heads; blocks 1, 3, ... MoE
    moe = MoEConfig(num_experts=experts) if experts else None
    return GPTConfig(vocab=96, layers=layers, heads=8, width=64, seq_len=16, moe=moe)


def job(batch: int = BATCH) -> Job:
    return Job(global_batch=batch, seq=16, precision="fp32", optimizer="adam")


def batch(cfg: GPTConfig, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def measured(fields: dict[str, Any], layers: int, experts: int = 0) -> dict[str, Any]:
    """One Adam step of the GPT under ``Layout(**fields)``; this rank's bytes and
    pipeline coordinate."""
    cfg = config(layers, experts)
    x, y = batch(cfg, BATCH)
    built = execute.build(GPT(cfg), Layout(**fields), job(), x, y)
    built.optimizer.zero_grad()
    built.step()
    built.optimizer.step()
    m = memory.measure(built.held(), built.optimizer)
    return {
        "bytes": {
            "params": m.params_bytes,
            "grads": m.grads_bytes,
            "optimizer": m.optimizer_bytes,
            "total": m.total_bytes,
        },
        "pp_rank": built.pp_rank,
        "strategy": built.strategy,
    }


def runtime_probes() -> dict[str, Any]:
    """On every rank: the strategies' own-work probes (plait.plan.measure.probe_runtime) with
    made-up collective lines (only the pipeline probe reads the p2p line)."""
    import plait
    from plait.plan.measure import probe_runtime
    from plait.plan.measure.calibrate import Calibration, Line

    torch.set_num_threads(1)
    line = Line(1e-4, 1e9, 2)
    base = Calibration(
        ranks=plait.world().size,
        cores=1,
        transport="",
        links={c: {2: line} for c in ("all_reduce", "all_gather", "reduce_scatter", "p2p")},
        adam=Line(1e-4, 1e8, 2),
    )
    fields, raw = probe_runtime.measure(base, plait.world(), iters=2)
    return {"fields": fields, "raw": raw}


def pipeline_probe() -> list[dict[str, Any]]:
    """On every rank: the calibration GPT through 1F1B and ZB-H1 and its plain step
    (plait.plan.measure.probe_pipeline), three rounds."""
    from plait.plan.measure import probe_pipeline

    return probe_pipeline.measure_rank(iters=3)


def tensor_probe() -> list[dict[str, Any]]:
    """On every rank: the calibration GPT's plain and tensor-parallel forward and backward
    (plait.plan.measure.probe_tensor), three rounds."""
    from plait.plan.measure import probe_tensor

    return probe_tensor.measure_rank(iters=3)
