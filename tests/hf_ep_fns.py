"""Rank functions for tests/test_hf_ep.py: Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE
handed whole to ``plait.prepare(strategy="ep")`` and the one-process oracle they must match.

Every run: float64, dropout off, eager attention, 3 AdamW steps with two parameter groups
(decay / no decay), 2 accumulation micro-steps (each ``loss / 2``), the model's own
``labels=`` loss with its load-balancing loss on (``output_router_logits=True``), and
``plait.clip_grad_norm_`` active (the norm is above ``MAX_NORM`` every step).

The oracle is one process on the global batch, accumulating over the same 2 micro-batches:
micro-batch ``m`` is the ``m``-th micro-slice of every rank, in batch-slice order, which is
what the expert-parallel run sees in its ``m``-th backward (the load-balancing loss is a
function of the whole micro-batch, so accumulation is over the same micro-batches).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import plait

STEPS, ACC, PER_RANK, SEQ, VOCAB, MAX_NORM = 3, 2, 2, 8, 96, 0.05


def build(family: str) -> nn.Module:
    """A tiny random-init model of ``family`` in float64 (the same on every rank)."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.1,
        "output_router_logits": True,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }
    if family == "mixtral":
        config = tf.MixtralConfig(
            **common, intermediate_size=48, num_local_experts=4, router_jitter_noise=0.0
        )
        cls: Any = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        )
        cls = tf.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the loop over experts: float64 works
    torch.manual_seed(0)
    model: nn.Module = cls(config).to(torch.float64)
    model.train()
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
    )


def ids(step: int, slices: int) -> torch.Tensor:
    """The global batch of ``step``: ``[slices, ACC, PER_RANK, SEQ]`` token ids."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (slices, ACC, PER_RANK, SEQ), generator=g)


def oracle(family: str, slices: int) -> dict[str, Any]:
    """One process on the global batch, 2 accumulation micro-steps, STEPS steps."""
    model = build(family)
    opt = optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        batch = ids(step, slices)
        opt.zero_grad()
        total = 0.0
        for m in range(ACC):
            x = batch[:, m].reshape(-1, SEQ)
            loss = model(input_ids=x, labels=x).loss / ACC
            loss.backward()
            total += float(loss.detach())
        norms.append(float(plait.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(total)
    return {"state": dict(model.named_parameters()), "losses": losses, "norms": norms}


def run_ep(family: str, dp: int, checkpointing: bool = False) -> dict[str, Any]:
    """plait.prepare(model, opt, strategy='ep', mesh=Mesh(ep=world/dp[, dp])), the same loop
    on this rank's batch slice; with ``checkpointing``, Hugging Face gradient checkpointing
    on (every decoder layer recomputed in backward, its all-to-alls with it)."""
    w = plait.world().size
    mesh = plait.Mesh(ep=w // dp, dp=dp) if dp > 1 else plait.Mesh(ep=w)
    model = build(family)
    if checkpointing:
        model.gradient_checkpointing_enable()  # type: ignore[operator]
    model, opt = plait.prepare(model, optimizer(model), strategy="ep", mesh=mesh)
    assert opt is not None
    info = model.plait_expert_parallel  # type: ignore[union-attr]
    b = info.batch_rank
    losses, norms = [], []
    for step in range(STEPS):
        batch = ids(step, w)[b]
        opt.zero_grad()
        total = 0.0
        for m in range(ACC):
            x = batch[m]
            loss = model(input_ids=x, labels=x).loss / ACC
            loss.backward()
            total += float(loss.detach())
        norms.append(float(plait.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(total)
    return {
        "state": {k: v.detach().clone() for k, v in model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "ep_rank": info.ep_group.rank,
        "ep": info.ep_group.size,
        "groups": [len(g["params"]) for g in opt.param_groups],
        "weight_decay": [g["weight_decay"] for g in opt.param_groups],
    }


def refusals() -> dict[str, str]:
    """What strategy 'ep' says to bad input on a Hugging Face MoE model."""
    out: dict[str, str] = {}
    w = plait.world().size

    def odd_experts() -> None:
        import transformers as tf

        config = tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
        )  # fmt: skip
        torch.manual_seed(0)
        plait.prepare(tf.MixtralForCausalLM(config), strategy="ep", mesh=plait.Mesh(ep=w))

    def masked() -> None:
        model, _ = plait.prepare(build("mixtral"), strategy="ep", mesh=plait.Mesh(ep=w))
        x = ids(0, w)[0, 0]
        model(input_ids=x, labels=x, attention_mask=torch.ones_like(x))

    def no_plan() -> None:
        plait.prepare(nn.Sequential(nn.Linear(2, 2)), strategy="ep", mesh=plait.Mesh(ep=w))

    for name, fn in {"odd": odd_experts, "masked": masked, "no_plan": no_plan}.items():
        try:
            fn()
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"
    return out


def snapshot(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: copy.deepcopy(v.detach()) for k, v in d.items()}
