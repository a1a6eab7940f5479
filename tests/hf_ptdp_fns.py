"""Rank functions for tests/test_hf_ptdp.py: Hugging Face models handed whole to PTD-P
(``plait.prepare(strategy="ptdp")`` or ``compose(..., plans=plan_for)``) on a
(pp, dp, tp) mesh, and the same model trained in one process on the global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import plait
from plait.models.plans import plan_for
from plait.strategies.compose import compose
from tests.hf_pipeline_fns import MODELS, batch, optimizer

STEPS = 3
MAX_NORM = 0.05  # below every step's gradient norm: clipping is active


@dataclass(frozen=True)
class Case:
    """One model and layout; ``accumulate`` ``step`` calls per optimizer step."""

    family: str = "llama"
    tied: bool = False
    pp: int = 2
    dp: int = 1
    tp: int = 2
    ep: int = 1  # the model's own experts split over ep (carved out of data parallelism)
    schedule: str = "1f1b"
    microbatches: int = 2
    accumulate: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: bool = False  # every stage reruns its forward before its backward
    via_compose: bool = False  # compose(..., plans=plan_for) instead of plait.prepare
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    context: str = "ring"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp * self.ep * self.cp

    @property
    def name(self) -> str:
        dims = "x".join(f"{d}{n}" for d, n in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)))
        dims += f"xep{self.ep}" if self.ep > 1 else ""
        dims += f"xcp{self.cp}-{self.context}" if self.cp > 1 else ""
        extra = ["tied"] if self.tied else []
        extra += [f"acc{self.accumulate}"] if self.accumulate > 1 else []
        extra += [f"zero{self.zero}"] if self.zero else []
        extra += ["sp"] if self.sequence_parallel else []
        extra += ["recompute"] if self.recompute else []
        extra += ["compose"] if self.via_compose else []
        return "-".join([self.family, dims, self.schedule, *extra])


def oracle(case: Case) -> dict[str, Any]:
    """One process on the global batch: the model's own ``labels=`` loss, the mean over
    the ``accumulate`` batches of a step, torch's clipping, AdamW with two groups."""
    model = MODELS[case.family](case.tied)
    if case.cp > 1:  # eager attention's softmax runs in float32; cp's kernels in float64
        model.set_attn_implementation("sdpa")
    opt = optimizer(list(model.named_parameters()))
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(case.accumulate):
            ids, labels = batch(case.accumulate * step + micro, model.config.vocab_size)
            loss = model(input_ids=ids, labels=labels).loss
            (loss / case.accumulate).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return {
        "state": dict(model.state_dict()),
        "optimizer": opt.state_dict(),
        "losses": losses,
        "norms": norms,
    }


def train(case: Case) -> dict[str, Any]:
    """The same run under PTD-P; the dense state and, where the layout saves it, the dense
    optimizer state (or the refusal's text), assembled on every rank."""
    model = MODELS[case.family](case.tied)
    opt = optimizer(list(model.named_parameters()))
    cp = {"cp": case.cp} if case.cp > 1 else {}
    mesh = plait.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep, **cp)
    options: dict[str, Any] = {
        "schedule": case.schedule,
        "microbatches": case.microbatches,
        "zero": case.zero,
        "sequence_parallel": case.sequence_parallel,
        "recompute": case.recompute,
    }
    if case.cp > 1:
        options["context"] = case.context
    if case.via_compose:
        ptdp = compose(model, opt, mesh=mesh, plans=plan_for, **options)
        popt = ptdp.optimizer
    else:
        ptdp, popt = plait.prepare(model, opt, strategy="ptdp", mesh=mesh, **options)
    del model, opt
    groups = [{k: v for k, v in g.items() if k != "params"} for g in popt.param_groups]
    losses, norms = [], []
    for step in range(STEPS):
        popt.zero_grad()
        for micro in range(case.accumulate):
            ids, labels = batch(case.accumulate * step + micro, 97)
            losses.append(ptdp.step(ids, labels).item())
        norms.append(ptdp.clip_grad_norm_(MAX_NORM).item())
        popt.step()
    out: dict[str, Any] = {
        "losses": losses,
        "norms": norms,
        "groups": groups,
        "local": sum(p.numel() for p in ptdp.parameters()),
        "partition": str(ptdp.pipe.partition),
        "refused": None,
    }
    try:
        state = ptdp.state_dict()
        out["state"], out["optimizer"] = state["model"], state["optimizer"]
    except NotImplementedError as exc:
        out["refused"] = str(exc)
        out["state"] = ptdp.full_state_dict()
    return out


def llama_heads(heads: int, kv_heads: int) -> torch.nn.Module:
    """A tiny Llama with ``heads`` query and ``kv_heads`` key/value heads of width 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.float64)


def refused_on_ranks() -> str:
    """A Llama of 6 heads on tp=4: every rank's error, before any collective."""
    model = llama_heads(6, 2)
    opt = optimizer(list(model.named_parameters()))
    try:
        plait.prepare(model, opt, strategy="ptdp", mesh=plait.Mesh(pp=1, dp=1, tp=4))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NOT REFUSED"


def _layout(mesh: plait.Mesh, family: str = "llama") -> Any:
    model = MODELS[family](False)
    opt = optimizer(list(model.named_parameters()))
    ptdp, _ = plait.prepare(model, opt, strategy="ptdp", mesh=mesh, microbatches=2)
    return ptdp


def save_then_load(
    root: str,
    family: str = "llama",
    saved: dict[str, int] | None = None,
    loaded: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A model trained one step on the ``saved`` mesh (default pp2 x tp2) and saved through
    plait.checkpoint; loaded into a fresh layout on the ``loaded`` mesh (default dp2 x tp2).
    The largest difference between their dense states (model and AdamW's two groups), and
    the loaded layout's parameter groups."""
    saving = _layout(plait.Mesh(**(saved or {"pp": 2, "dp": 1, "tp": 2})), family)
    ids, labels = batch(0, 97)
    saving.step(ids, labels)
    saving.optimizer.step()
    saving.save(root, step=1)
    want = saving.state_dict()
    loading = _layout(plait.Mesh(**(loaded or {"pp": 1, "dp": 2, "tp": 2})), family)
    loading.load(root)
    got = loading.state_dict()
    diffs = [(got["model"][k] - v).abs().max().item() for k, v in want["model"].items()]
    for i, stats in want["optimizer"]["state"].items():
        for stat, value in stats.items():
            diffs.append((got["optimizer"]["state"][i][stat] - value).abs().max().item())
    return {
        "keys": list(got["model"]) == list(want["model"]),
        "optimizer entries": len(got["optimizer"]["state"]),
        "diff": max(diffs),
        "groups": [(g["lr"], g["weight_decay"]) for g in got["optimizer"]["param_groups"]],
    }
