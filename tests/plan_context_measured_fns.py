"""Rank functions for tests/test_plan_context_measured.py: one training forward of plait's
GPT or a tiny Hugging Face Llama (sdpa) under ``plait.prepare(strategy="cp")``, with what
autograd saves for the backward measured on this rank (``kept_bytes`` of
tests/test_plan_activations.py: each storage once, parameters and buffers left out, the
logits the loop keeps counted)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import plait
from plait.strategies.context import shard_sequence
from tests.test_plan_activations import kept_bytes

BATCH, SEQ, WIDTH, HEADS, KV_HEADS, VOCAB = 2, 64, 64, 4, 2, 256


def gpt_config(layers: int) -> Any:
    from plait.models.gpt import GPTConfig

    return GPTConfig(vocab=VOCAB, layers=layers, heads=HEADS, width=WIDTH, seq_len=SEQ)


def llama_config(layers: int) -> Any:
    """The shape of tests/test_plan_activations.py's Llama (heads of h / 4, 2 key/value
    heads, f = 2.75 h), sdpa attention, fp32."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=(11 * WIDTH) // 4,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=WIDTH // HEADS,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )


def _model(family: str, layers: int) -> Any:
    torch.manual_seed(0)
    if family == "gpt":
        from plait.models.gpt import GPT

        return GPT(gpt_config(layers)).train()
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(layers)).train()


def saved_per_rank(family: str, context: str) -> dict[str, int]:
    """This rank's saved bytes for a one-block and a two-block model (``one``, ``two``):
    the same global batch, sharded over a cp group of the world's size (load-balanced)."""
    mesh = plait.Mesh(cp=plait.world().size)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    ids, pos = shard_sequence(tokens[:, :-1], mesh)
    targets, _ = shard_sequence(tokens[:, 1:], mesh)
    out: dict[str, int] = {}
    for name, layers in (("one", 1), ("two", 2)):
        model = _model(family, layers)
        runner, _ = plait.prepare(model, None, strategy="cp", mesh=mesh, context=context)

        def forward(runner: Any = runner) -> tuple[torch.Tensor, torch.Tensor]:
            if family == "gpt":
                logits = runner(ids)
            else:
                logits = runner(input_ids=ids, position_ids=pos.expand(BATCH, -1)).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            return loss, logits

        out[name] = kept_bytes(model, forward)
    return out
