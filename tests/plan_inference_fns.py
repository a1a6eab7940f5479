"""Rank functions for tests/test_plan_inference.py: Hugging Face families plait has no plan
for (OPT, GPT-NeoX, StableLM, Gemma) and Llama's layers under a class of one's own, handed
whole to ``plait.prepare(strategy="tp")``, which infers their plans
(:func:`plait.models.infer.infer_tp_plan`). Same runs as tests/hf_tp_fns.py: float64,
dropout off, 3 AdamW steps with two parameter groups, 2 accumulation micro-steps, clipping
active, the model's own ``labels=`` loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint
from tests.hf_tp_fns import MAX_NORM, SEQ, VOCAB, _train, optimizer

FAMILIES = ("opt", "neox", "stablelm", "gemma", "tiny_llama")


def opt() -> nn.Module:
    """q/k/v/out_proj; fc1, fc2 on the decoder layer itself; head tied to the embedding;
    learned positions (an nn.Embedding subclass with its own forward: left whole)."""
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=2 * SEQ,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            pad_token_id=1,
            attn_implementation="eager",
        )
    )


def neox() -> nn.Module:
    """One fused query_key_value, interleaved per head (split as one run of heads), an
    untied output head, parallel residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            max_position_embeddings=2 * SEQ,
            attn_implementation="eager",
        )
    )


def stablelm() -> nn.Module:
    """Grouped-query attention whose forward reads num_heads and num_key_value_heads."""
    from transformers import StableLmConfig, StableLmForCausalLM

    return StableLmForCausalLM(
        StableLmConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * SEQ,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            attn_implementation="eager",
        )
    )


def gemma() -> nn.Module:
    """A scaled embedding (its own forward) tied to the head: both left whole."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(
        GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=2 * SEQ,
            attn_implementation="eager",
        )
    )


class TinyLM(nn.Module):
    """Hugging Face Llama layers under a class no family knows; returns the logits."""

    def __init__(self, config: Any) -> None:
        from transformers import LlamaModel

        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids, use_cache=False).last_hidden_state
        return self.lm_head(hidden)  # type: ignore[no-any-return]


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQ,
        "pad_token_id": 0,
        "attention_dropout": 0.0,
        "attn_implementation": "eager",
    }
    return LlamaConfig(**(fields | overrides))


def tiny_llama() -> nn.Module:
    return TinyLM(llama_config())


def build(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return globals()[family]().to(torch.float64)  # type: ignore[no-any-return]


def oracle(family: str) -> dict[str, Any]:
    """One process, the dense model, the same batches."""
    model = build(family)
    out = _train(model, optimizer(model), torch.nn.utils.clip_grad_norm_)
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def train(families: tuple[str, ...] = FAMILIES) -> dict[str, dict[str, Any]]:
    """Every rank of the world is one tensor-parallel rank; each model handed over whole."""
    out = {}
    for family in families:
        model = build(family)
        dense = {n: p.numel() for n, p in model.named_parameters()}
        model, opt = plait.prepare(
            model, optimizer(model), strategy="tp", mesh=plait.Mesh(tp=plait.world().size)
        )
        assert opt is not None
        res = _train(model, opt, plait.clip_grad_norm_)
        info = model.plait_tensor_parallel  # type: ignore[union-attr]
        out[family] = res | {
            "state": checkpoint.full_state_dict(model),
            "split": sorted(n for n, p in model.named_parameters() if p.numel() < dense[n]),
            "styles": {n: s.kind for n, s in info.styles.items()},
        }
    return out


__all__ = ["MAX_NORM", "FAMILIES", "build", "oracle", "train", "TinyLM", "llama_config"]
