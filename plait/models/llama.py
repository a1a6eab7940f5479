"""Plans for Hugging Face Llama and the families that share its layout (Mistral, Qwen2,
Qwen3).

Recognised by class name (``plait.models.plans.FAMILIES``), so ``transformers`` is never
imported here. The layout read::

    model.embed_tokens                      nn.Embedding (padding_idx = pad_token_id)
    model.layers.<i>.self_attn.{q,k,v}_proj nn.Linear (k, v: num_key_value_heads heads)
    model.layers.<i>.self_attn.o_proj       nn.Linear
    model.layers.<i>.self_attn.{q,k}_norm   RMSNorm over each head (Qwen3 only)
    model.layers.<i>.mlp.{gate,up}_proj     nn.Linear
    model.layers.<i>.mlp.down_proj          nn.Linear
    model.layers.<i>.{input,post_attention}_layernorm, model.norm    RMSNorm
    lm_head                                 nn.Linear (may share embed_tokens' weight)

The attention reshapes its projections with ``view(*shape, -1, head_dim)`` (the local head
count follows from the width it receives) and reads ``num_key_value_groups`` (query heads
per key/value head) for grouped-query attention; the plan names it (and the
``num_heads``/``num_key_value_heads`` attributes older versions read) so each rank's counts
are set.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

# attention attributes holding head counts, in the transformers versions that have them
HEAD_ATTRIBUTES = {
    "num_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "num_key_value_groups": "groups",
}


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_attention_heads"):
        raise ValueError(
            f"{type(model).__name__}: a Llama-family plan reads the model's config "
            f"(num_attention_heads, num_key_value_heads); this model has none"
        )
    return config


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """The 1D tensor-parallel plan of a Llama-layout model (``...ForCausalLM`` or the bare
    ``...Model``).

    Each attention and MLP block enters the tensor-parallel region once (``"gather"``: one
    backward all-reduce for its column-parallel layers together). Attention: ``q/k/v_proj``
    column-wise (each rank computes ``heads/t`` query heads and
    ``kv_heads/t`` key/value heads; with fewer key/value heads than ranks, ``k/v_proj`` stay
    whole and each rank computes the one its queries read), ``o_proj`` row-wise. MLP:
    ``gate/up_proj`` column-wise, ``down_proj`` row-wise. The token embedding is split by
    vocabulary (``padding_idx`` kept); ``lm_head`` by vocabulary with its output gathered,
    so the model's forward returns the full logits and Hugging Face's ``labels=`` loss works
    unchanged (one all-gather of ``b * s * V`` per call). RMSNorms and the rotary embedding
    stay whole on every rank; Qwen3's per-head ``q_norm``/``k_norm`` too, their gradients
    summed over the group (``"per_head"``: each rank's covers its heads only).

    ``sequence_parallel``: between the attention and MLP blocks each rank holds ``1/t`` of
    the sequence (the RMSNorms run on it, their gradients summed over the group). The
    embedding's output stays whole (the rotary embedding and the causal mask are built
    from it) and the first decoder layer slices it; each attention all-gathers its input
    (its reshape reads the input's length), as does each MLP, ``o_proj``/``down_proj``
    reduce-scatter, ``lm_head`` all-gathers the sequence and its
    logits (full logits returned, as without it).
    """
    config = _config(model)
    prefix = "model." if isinstance(getattr(model, "model", None), nn.Module) else ""
    layers = f"{prefix}layers.*"
    gathered = Style("colwise", input="gathered")
    styles: dict[str, Any] = {
        f"{prefix}embed_tokens": "vocab",
        # one entry into the tensor-parallel region per block: one backward all-reduce
        # (or, with sequence parallelism, one all-gather) for q, k and v together
        f"{layers}.self_attn": "gather",
        f"{layers}.self_attn.q_proj": gathered,
        f"{layers}.self_attn.k_proj": gathered,
        f"{layers}.self_attn.v_proj": gathered,
        f"{layers}.self_attn.o_proj": "rowwise",
        f"{layers}.mlp": "gather",
        f"{layers}.mlp.gate_proj": gathered,
        f"{layers}.mlp.up_proj": gathered,
        f"{layers}.mlp.down_proj": "rowwise",
    }
    names = {n for n, _ in model.named_modules()}
    for norm in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over each head's vector
        if f"{prefix}layers.0.self_attn.{norm}" in names:
            styles[f"{layers}.self_attn.{norm}"] = "per_head"
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        styles["lm_head"] = Style("vocab", output="replicate")
    if sequence_parallel:
        styles |= {
            # the rotary embedding and the causal mask are built from the embedding's
            # output, so it stays whole; the first layer slices it
            f"{prefix}embed_tokens": Style("vocab", output="replicate"),
            f"{prefix}layers.0": "scatter",
            f"{layers}.input_layernorm": "sequence",
            f"{layers}.post_attention_layernorm": "sequence",
            f"{prefix}norm": "sequence",
        }
    heads = AttentionHeads(
        f"{layers}.self_attn",
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        key_value=("k_proj", "v_proj"),
        attributes=HEAD_ATTRIBUTES,
    )
    return TensorPlan(styles=styles, attention=(heads,))
