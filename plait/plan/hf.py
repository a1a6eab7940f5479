"""A planner :class:`~plait.plan.model.ModelSpec` from a Hugging Face config, or a preset.

``plait plan layouts --model PATH/config.json`` (or ``--model llama3-8b``) plans the model a
user trains, read from what they have: a ``config.json`` (or a ``transformers`` config
object; nothing is downloaded, nothing of ``transformers`` is imported). Families:

==============================  ==============================================================
``model_type``                  read as
==============================  ==============================================================
llama, mistral, qwen2, qwen3    RoPE, RMSNorm, SwiGLU MLP of ``intermediate_size``, grouped-
                                query attention (``num_key_value_heads``); q/k/v biases for
                                qwen2 (and ``attention_bias``), per-head q/k RMSNorm for qwen3
mixtral                         every layer a mixture of ``num_local_experts`` SwiGLU experts,
                                top ``num_experts_per_tok``
qwen2_moe, qwen3_moe            ``num_experts`` experts of ``moe_intermediate_size`` every
                                ``decoder_sparse_step`` layers, but the ``mlp_only_layers``
                                (a dense MLP of ``intermediate_size``); qwen2_moe's shared
                                expert (``shared_expert_intermediate_size``) and its gate;
                                ``norm_topk_prob`` (what the router keeps)
gpt2                            learned positions, LayerNorm, GELU MLP of ``n_inner`` (4 h),
                                biases everywhere, tied head
==============================  ==============================================================

The parameter count equals ``sum(p.numel() for p in model.parameters())`` of the
``transformers`` model built from the same config (tests/test_plan_hf.py checks every family
and every preset). What is not modelled is refused by name, or said: per-layer sliding
windows change no parameter count but are not timed differently; DeepSeek-style MLA
attention is refused (``deepseek_v2``/``v3`` are not read, so neither are their
``first_k_dense_replace`` and ``moe_layer_freq``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plait.plan.model import ModelSpec

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES = (*LLAMA_LIKE, *MOE, "gpt2")

# Well-known sizes (the configs their authors published), so that a user can plan without a
# file: ``--model llama3-8b``.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        model_type="llama",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama3-405b": dict(
        model_type="llama",
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # Llama 2 (Touvron et al. 2023, Table 1 and the released config.json files): 4096 tokens
    "llama2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama2-13b": dict(
        model_type="llama",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama2-70b": dict(
        model_type="llama",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen2-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257
    ),
    "gpt2-xl": dict(
        model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257
    ),
}


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def from_hf_config(config: Mapping[str, Any] | Any, *, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face config (a ``config.json``'s dict or a
    ``transformers`` config object). Refuses a ``model_type`` it does not know, naming the
    families it does."""
    cfg: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(
            f"plan: model_type {kind!r} is not one plait plans; known: {', '.join(FAMILIES)} "
            f"(or describe the model with --layers/--hidden/--heads/--vocab)"
        )
    label = name or str(cfg.get("_name_or_path") or kind)
    if kind == "gpt2":
        h = int(cfg["n_embd"])
        return ModelSpec(
            layers=int(cfg["n_layer"]),
            hidden=h,
            heads=int(cfg["n_head"]),
            vocab=int(cfg["vocab_size"]),
            seq_len=int(cfg["n_positions"]),
            ffn_hidden=int(_get(cfg, "n_inner", default=4 * h)),
            tied=bool(cfg.get("tie_word_embeddings", True)),
            activation=str(cfg.get("activation_function", "gelu_new")),
            hugging_face=True,
            name=label,
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    common: dict[str, Any] = dict(
        layers=int(cfg["num_hidden_layers"]),
        hidden=hidden,
        heads=heads,
        kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        vocab=int(cfg["vocab_size"]),
        seq_len=int(_get(cfg, "max_position_embeddings", default=4096)),
        ffn_hidden=int(cfg["intermediate_size"]),
        gated=True,
        fused_qkv=False,
        norm="rmsnorm",
        positions="rope",
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=kind in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        activation=str(cfg.get("hidden_act", "silu")),
        softmax_fp32=True,  # eager_attention_forward: softmax(..., dtype=torch.float32)
        hugging_face=True,
        name=label,
    )
    if kind in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        # Llama's attention_bias puts a bias on o_proj too; plait's spec has one flag for
        # "other" biases, which also covers the MLP: refuse rather than miscount
        if not cfg.get("mlp_bias"):
            raise ValueError(
                f"plan: {kind} with attention_bias=True and mlp_bias=False is not modelled "
                f"(the output projection's bias alone); plan it without attention_bias"
            )
    if kind == "mixtral":
        return ModelSpec(
            **common,
            experts=int(_get(cfg, "num_local_experts", "num_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            moe_every=1,
        )
    if kind in ("qwen2_moe", "qwen3_moe"):
        return ModelSpec(
            **common,
            experts=int(_get(cfg, "num_experts", "num_local_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            moe_every=int(_get(cfg, "decoder_sparse_step", default=1)),
            expert_ffn=int(cfg["moe_intermediate_size"]),
            shared_ffn=int(_get(cfg, "shared_expert_intermediate_size", default=0)),
            dense_at=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            norm_topk=bool(cfg.get("norm_topk_prob", False)),
        )
    return ModelSpec(**common)


def load(model: str) -> ModelSpec:
    """``model``: a preset name (:data:`PRESETS`), a ``config.json`` file, or a directory
    holding one."""
    if model in PRESETS:
        return from_hf_config(PRESETS[model], name=model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"plan: --model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
            f"config.json file"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"plan: {path} is not JSON ({e})") from e
    # a directory's config.json is named by its directory, another file by its own name
    label = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return from_hf_config(cfg, name=label)


__all__ = ["FAMILIES", "PRESETS", "from_hf_config", "load"]
