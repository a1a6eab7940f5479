"""Rank functions for tests/test_hf_fsdp.py: Hugging Face Llama with one FSDP unit per
decoder layer and Hugging Face's own gradient checkpointing, against one process."""

from __future__ import annotations

from typing import Any

import torch

import plait

STEPS, BATCH, SEQ, CLIP = 3, 4, 8, 0.5


def build() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).double()
    model.train()
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def oracle() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build()
    opt = _optimizer(model)
    norms = []
    for step in range(STEPS):
        x = _batch(step)
        model(input_ids=x, labels=x).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(checkpointing: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    world = plait.runtime.world()
    model = build()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped, opt = plait.prepare(
        model, _optimizer(model), strategy="fsdp", wrap={LlamaDecoderLayer}
    )
    assert opt is not None
    rows = BATCH // world.size
    norms = []
    for step in range(STEPS):
        x = _batch(step)[world.rank * rows : (world.rank + 1) * rows]
        wrapped(input_ids=x, labels=x).loss.backward()
        norms.append(float(plait.clip_grad_norm_(wrapped, CLIP)))
        opt.step()
        opt.zero_grad()
    state = plait.checkpoint.full_state_dict(wrapped)
    return {k: v.detach().clone() for k, v in state.items()}, norms
