"""Rank functions for tests/test_checkpoint_hf.py: ``plait.checkpoint.full_state_dict``,
``load_pretrained`` and ``save_pretrained`` under every layout, against one process.

Models (float64, tiny, dropout off): Hugging Face Llama (4 query / 2 key-value heads),
GPT-2 (Conv1D, fused ``c_attn``, tied head), a torchtitan-like Llama (``tests/titan_model``)
and Mixtral (4 stacked experts). A file's values are the seed-0 model's plus small seeded
noise (:func:`perturbed`), so loading one changes every tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint
from tests import hf_ep_fns, hf_tp_fns

BATCH, SEQ, VOCAB = 4, 8, 96
FAMILIES = ("llama", "gpt2", "titan", "mixtral")


def build(family: str) -> nn.Module:
    """The seed-0 model of ``family`` (the same on every rank)."""
    if family == "mixtral":
        model = hf_ep_fns.build("mixtral")
        model.config.output_router_logits = False  # logits only; no auxiliary loss
        return model
    if family in ("gpt2", "titan"):
        return hf_tp_fns.build(family, tied=family == "gpt2", kv_heads=2)
    return hf_tp_fns.llama(tied=False, kv_heads=2)


def perturbed(family: str) -> nn.Module:
    """The seed-0 model with every floating tensor moved by seeded noise: a file's values."""
    model = build(family)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(0.01 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return model


def ids() -> torch.Tensor:
    """Token ids below every family's vocabulary (96 and 99)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if not hasattr(model, "config") else model(input_ids=x)
    return (out if isinstance(out, torch.Tensor) else out.logits).detach()


def prepare(family: str, strategy: str) -> Any:
    """``family`` handed whole to ``plait.prepare(strategy=...)`` on the world."""
    model = build(family)
    w = plait.world().size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if strategy == "tp":
        out, opt = plait.prepare(model, opt, strategy="tp", mesh=plait.Mesh(tp=w))
    elif strategy == "pipeline":
        out, opt = plait.prepare(
            model, opt, strategy="pipeline", mesh=plait.Mesh(pp=w), schedule="1f1b",
            microbatches=2,
        )  # fmt: skip
    elif strategy == "ep":
        out, opt = plait.prepare(model, opt, strategy="ep", mesh=plait.Mesh(ep=w))
    elif strategy in ("ptdp", "ptdp-ep"):  # pp 2 x tp (or ep) w / 2
        other = {"tp": w // 2} if strategy == "ptdp" else {"ep": w // 2, "tp": 1}
        out, opt = plait.prepare(
            model, opt, strategy="ptdp", mesh=plait.Mesh(pp=2, dp=1, **other), microbatches=2
        )
    elif strategy == "fsdp":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        out, opt = plait.prepare(model, opt, strategy="fsdp", wrap={LlamaDecoderLayer})
    else:
        out, opt = plait.prepare(model, opt, strategy=strategy)
    return out, opt


def forward(family: str, strategy: str, model: Any, x: torch.Tensor) -> torch.Tensor:
    """The logits (the loss under a pipeline or PTD-P, whose step returns only that)."""
    if strategy in ("pipeline", "ptdp", "ptdp-ep"):
        return model.step(x, x).detach()
    return logits(model, x)


def full_states(cases: list[tuple[str, str]], out: str) -> dict[str, Any]:
    """Per case, ``full_state_dict`` on this rank; then ``save_pretrained`` of each case into
    ``out/<family>-<strategy>`` (rank 0 writes)."""
    res: dict[str, Any] = {}
    for family, strategy in cases:
        model, _ = prepare(family, strategy)
        res[f"{family}/{strategy}"] = checkpoint.full_state_dict(model)
        counts = checkpoint.parameter_counts(model)
        res[f"{family}/{strategy}/counts"] = (counts.model, counts.this_rank)
        config = build(family).config if strategy == "pipeline" else None
        written = checkpoint.save_pretrained(
            model, Path(out) / f"{family}-{strategy}", config=config,
            max_shard_bytes=20_000 if strategy == "pipeline" else None,
        )  # fmt: skip
        res[f"{family}/{strategy}/written"] = None if written is None else str(written)
    return res


def loads(cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Per case (family, strategy, files): prepare, ``load_pretrained``, the forward on a
    fixed batch, ``full_state_dict`` after the load and the bytes this rank read."""
    res: dict[str, Any] = {}
    x = ids()
    for family, strategy, path in cases:
        model, opt = prepare(family, strategy)
        got = checkpoint.load_pretrained(model, path, optimizer=opt)
        res[f"{family}/{strategy}"] = {
            "out": forward(family, strategy, model, x),
            "state": checkpoint.full_state_dict(model),
            "read": got.bytes_read,
            "total": got.file_bytes,
            "layout": got.layout,
        }
    return res


def refusals(files: dict[str, str]) -> dict[str, Any]:
    """Under tp: files with another shape, a missing key, an extra key: the message on
    every rank, and the parameters left as they were."""
    res: dict[str, Any] = {}
    for name, path in files.items():
        model, _ = prepare("llama", "tp")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            checkpoint.load_pretrained(model, path)
            res[name] = "NOT REFUSED"
        except ValueError as exc:
            res[name] = str(exc)
        after = model.state_dict()
        res[f"{name}/unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return res
