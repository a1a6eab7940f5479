"""Rank functions for tests/test_plan_inference_pipeline.py: Hugging Face causal LMs no
plait family knows, in the Llama layout, handed to the pipeline with an inferred plan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import hf_pipeline_fns as pipe_fns


def build(family: str, **extra: Any) -> nn.Module:
    """A tiny random-init model of ``family`` in float64 (the same on every rank)."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    families = {
        "olmo2": (hf.Olmo2Config, hf.Olmo2ForCausalLM),
        "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM),
        "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM),
        "stablelm": (hf.StableLmConfig, hf.StableLmForCausalLM),
        "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM),
        "cohere": (hf.CohereConfig, hf.CohereForCausalLM),
        "granite": (hf.GraniteConfig, hf.GraniteForCausalLM),
    }
    config_class, model_class = families[family]
    if family in ("gemma", "gemma2"):
        common["head_dim"] = 8
    config = config_class(**(common | extra))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_class(config).to(torch.float64)  # type: ignore[no-any-return]


def oracle(family: str) -> dict[str, Any]:
    return pipe_fns.one_process(build(family))


def train(family: str, schedule: str) -> dict[str, Any]:
    out = pipe_fns.run(build(family), schedule, 2)
    out["plan"] = out.pop("partition")
    return out
