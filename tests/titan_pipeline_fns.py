"""Rank functions for tests/test_titan_pipeline.py: a torchtitan-shaped Llama 3
(``tests/titan_model.py``: class ``Transformer``, complex rotary table, subclassed layers)
handed whole to the pipeline and to PTD-P, against one process."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from tests import hf_tp_fns
from tests.hf_pipeline_fns import optimizer

STEPS, MAX_NORM = 3, 0.05


def build() -> torch.nn.Module:
    return hf_tp_fns.titan(kv_heads=2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels shifted by the loader (torchtitan's convention), some ignored
    (-100) unevenly over the rows."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, hf_tp_fns.VOCAB, (4, 9), generator=g)
    labels = x[:, 1:].clone()
    labels[0, 2:6] = -100
    labels[3, 1] = -100
    return x[:, :-1], labels


def oracle() -> dict[str, Any]:
    """One process: torchtitan's loss (the mean over the labels kept), clipping, AdamW."""
    model = build()
    opt = optimizer(list(model.named_parameters()))
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return {"state": dict(model.state_dict()), "norms": norms}


def train(mesh: dict[str, int], strategy: str, context: str | None = None) -> dict[str, Any]:
    """The same run through plait.prepare(strategy=...) on ``Mesh(**mesh)``, 2 micro-batches
    (``context``: with a cp dimension, its kernel)."""
    model = build()
    opt = optimizer(list(model.named_parameters()))
    extra = {} if context is None else {"context": context}
    wrapped, popt = plait.prepare(
        model, opt, strategy=strategy, mesh=plait.Mesh(**mesh), microbatches=2, **extra
    )
    assert popt is not None
    norms = []
    for step in range(STEPS):
        popt.zero_grad()
        wrapped.step(*batch(step))
        if strategy == "ptdp":
            norms.append(float(wrapped.clip_grad_norm_(MAX_NORM)))
        else:
            norms.append(float(plait.clip_grad_norm_(wrapped.parameters(), MAX_NORM)))
        popt.step()
    return {"state": plait.checkpoint.full_state_dict(wrapped), "norms": norms}


def train_cp(context: str) -> dict[str, Any]:
    """``plait.prepare(strategy="cp", mesh=Mesh(cp=2))``: the rotary table's rows swapped for
    the rank's positions (its family's context plan: ``freqs_cis``); each rank's loss is its
    chunks' sum over the global batch's label count, times cp (gradients average over cp)."""
    from plait.strategies.context import shard_sequence

    model = build()
    opt = optimizer(list(model.named_parameters()))
    mesh = plait.Mesh(cp=2)
    runner, popt = plait.prepare(model, opt, strategy="cp", mesh=mesh, context=context)
    assert popt is not None
    norms, tokens = [], []
    for step in range(STEPS):
        popt.zero_grad()
        x, y = batch(step)
        count = int((y != -100).sum())
        x, _ = shard_sequence(x, mesh)
        y, _ = shard_sequence(y, mesh)
        tokens.append(x.shape[1])
        out = runner(x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        (loss * 2 / count).backward()
        norms.append(float(plait.clip_grad_norm_(runner.parameters(), MAX_NORM)))
        popt.step()
    return {"state": dict(model.state_dict()), "norms": norms, "tokens": tokens}
