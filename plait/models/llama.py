"""Plans for Hugging Face ``LlamaForCausalLM`` and the families that share its layout
(``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): ``model.embed_tokens``,
``model.rotary_emb``, ``model.layers[i](hidden, attention_mask=, position_embeddings=,
position_ids=)``, ``model.norm``, ``lm_head``. Read by name, without importing
``transformers`` here; the mask functions are the model's own module's.

Tensor parallelism (:func:`tp_plan`) reads this layout::

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

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.strategies.pipeline import Layer, PipelinePlan
from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


@dataclass(frozen=True)
class _StageContext:
    """What every decoder layer of a stage reads besides the hidden states."""

    position_ids: torch.Tensor
    masks: dict[str, Any]
    rope: tuple[torch.Tensor, torch.Tensor]


def pipeline_plan(model: Any) -> Any:
    """The pipeline plan of a Hugging Face Llama-layout causal LM handed over whole.

    Layers: ``embed`` (``model.embed_tokens``), ``model.layers.<i>`` (contextual), ``head``
    (``model.norm`` then ``lm_head``; a tied ``lm_head`` is the embedding's weight, summed
    between the first and last stage by the pipeline). Context, **recomputed on each
    stage** from the micro-batch's positions ``0..s-1`` (the hidden state's shape, dtype and
    device) and its rows of the ``attention_mask`` (a per-micro-batch input, sliced on each
    rank), never sent: the rotary ``(cos, sin)`` from ``model.rotary_emb`` and the causal
    mask(s) from the model's own ``create_causal_mask`` (and
    ``create_sliding_window_causal_mask`` for sliding-window layers: Mistral, Qwen2's
    ``layer_types``), exactly as ``model.model.forward`` builds them: the padding mask
    passed through, the positions ``0..s-1`` on every row, padded or not (the model's own
    forward without a cache does the same). So ``step(input_ids, labels)`` takes unpadded
    ``input_ids``, ``step(input_ids, labels, attention_mask=mask)`` a padded batch (its
    ``labels`` ``-100`` on the pads), with Hugging Face ``labels`` (unshifted; ``-100``
    ignored). Loss: ``model.loss_function``
    (Hugging Face's causal-LM loss, shift inside) with ``num_items_in_batch`` = the number
    of labels counted over the whole global batch, so the pipeline's loss is one process's
    mean even when ignored labels fall unevenly. Under context parallelism (PTD-P with a
    ``cp`` dimension) each stage reads the rank's global ``position_ids`` (a per-micro-batch
    input) instead of ``0..s-1``, the attention builds no mask (the ring or Ulysses kernel
    is causal on global positions) and ``shifted_loss`` reads the labels PTD-P shifted over
    the whole sequence before cutting it.
    """

    base: Any = model.model
    cfg: Any = model.config
    source = sys.modules[type(base).__module__]
    full_mask = source.create_causal_mask
    sliding_mask = getattr(source, "create_sliding_window_causal_mask", None)
    n = len(base.layers)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if not layer_types:
        sliding = getattr(cfg, "sliding_window", None) is not None and sliding_mask is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * n
    needed = sorted(set(layer_types[:n]))
    unknown = [t for t in needed if t not in ("full_attention", "sliding_attention")]
    if unknown or ("sliding_attention" in needed and sliding_mask is None):
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: attention layer types {needed} "
            f"(config.layer_types); plait builds masks for 'full_attention' and "
            f"'sliding_attention' only. Write the model's pipeline plan (see "
            f"plait.strategies.pipeline.plan)"
        )

    def context(
        h: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> _StageContext:
        pos = (
            torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            if position_ids is None
            else position_ids
        )
        kw = {
            "config": cfg,
            "inputs_embeds": h,
            "attention_mask": attention_mask,
            "cache": None,
            "position_ids": pos,
        }
        masks: dict[str, Any] = {}
        if "full_attention" in needed:
            masks["full_attention"] = full_mask(**kw)
        if "sliding_attention" in needed:
            assert sliding_mask is not None
            masks["sliding_attention"] = sliding_mask(**kw)
        return _StageContext(pos, masks, base.rotary_emb(h, pos))

    def decoder(layer: nn.Module, kind: str) -> Any:
        def run(x: torch.Tensor, ctx: _StageContext) -> torch.Tensor:
            return layer(  # type: ignore[no-any-return]
                x,
                attention_mask=ctx.masks[kind],
                position_embeddings=ctx.rope,
                position_ids=ctx.position_ids,
                cache=None,
                use_cache=False,
            )

        return run

    def head(x: torch.Tensor) -> torch.Tensor:
        return model.lm_head(base.norm(x))  # type: ignore[no-any-return]

    def loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any) -> torch.Tensor:
        return model.loss_function(  # type: ignore[no-any-return]
            logits=logits, labels=labels, vocab_size=cfg.vocab_size, num_items_in_batch=num_items
        )

    def shifted_loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any) -> torch.Tensor:
        return model.loss_function(  # type: ignore[no-any-return]
            logits=logits,
            labels=None,
            shift_labels=labels,
            vocab_size=cfg.vocab_size,
            num_items_in_batch=num_items,
        )

    layers = [Layer("embed", (("model.embed_tokens", base.embed_tokens),), base.embed_tokens)]
    for i, layer in enumerate(base.layers):
        layers.append(
            Layer(
                f"model.layers.{i}",
                ((f"model.layers.{i}", layer),),
                decoder(layer, layer_types[i]),
                contextual=True,
            )
        )
    layers.append(Layer("head", (("model.norm", base.norm), ("lm_head", model.lm_head)), head))
    return PipelinePlan(
        layers=tuple(layers),
        loss=loss,
        reduction="items",
        items=causal_lm_items,
        context=context,
        context_modules=(("model.rotary_emb", base.rotary_emb),),
        inputs=("attention_mask", "position_ids"),
        shifts_labels=True,
        shifted_loss=shifted_loss,
        name=type(model).__name__,
    )


def causal_lm_items(labels: torch.Tensor) -> torch.Tensor:
    """Labels a Hugging Face causal-LM loss counts: all but each row's first (the shift)
    and the ignored ones."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


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
    prefix = "model." if isinstance(getattr(model, "model", None), nn.Module) else ""
    return decoder_tp_plan(
        model, sequence_parallel=sequence_parallel, dense_mlps=(f"{prefix}layers.*.mlp",)
    )


def decoder_tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool,
    dense_mlps: tuple[str, ...],
    whole: tuple[str, ...] = (),
) -> TensorPlan:
    """The Llama-layout plan (:func:`tp_plan`) with the gated MLPs at ``dense_mlps``
    (patterns) split and the modules at ``whole`` (an MoE block) kept whole on every
    rank: their input is replicated, so each rank computes the same output and the same
    gradients (under sequence parallelism each rank runs them on its slice of the
    sequence and their gradients are summed over the group, style ``"sequence"``)."""
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
    }
    for mlp in dense_mlps:
        styles |= {
            mlp: "gather",
            f"{mlp}.gate_proj": gathered,
            f"{mlp}.up_proj": gathered,
            f"{mlp}.down_proj": "rowwise",
        }
    for block in whole:
        styles[block] = "sequence" if sequence_parallel else "replicate"
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
