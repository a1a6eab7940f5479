"""Plans for Hugging Face ``LlamaForCausalLM`` and the families that share its layout
(``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): ``model.embed_tokens``,
``model.rotary_emb``, ``model.layers[i](hidden, attention_mask=, position_embeddings=,
position_ids=)``, ``model.norm``, ``lm_head``. Read by name, without importing
``transformers`` here; the mask functions are the model's own module's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
    device), never sent: the rotary ``(cos, sin)`` from ``model.rotary_emb`` and the causal
    mask(s) from the model's own ``create_causal_mask`` (and
    ``create_sliding_window_causal_mask`` for sliding-window layers: Mistral, Qwen2's
    ``layer_types``), exactly as ``model.model.forward`` builds them without padding. So
    ``step(input_ids, labels)`` takes unpadded ``input_ids`` (no ``attention_mask``) and
    Hugging Face ``labels`` (unshifted; ``-100`` ignored). Loss: ``model.loss_function``
    (Hugging Face's causal-LM loss, shift inside) with ``num_items_in_batch`` = the number
    of labels counted over the whole global batch, so the pipeline's loss is one process's
    mean even when ignored labels fall unevenly.
    """
    from plait.strategies.pipeline import Layer, PipelinePlan

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

    def context(h: torch.Tensor) -> _StageContext:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        kw = {
            "config": cfg,
            "inputs_embeds": h,
            "attention_mask": None,
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
        name=type(model).__name__,
    )


def causal_lm_items(labels: torch.Tensor) -> torch.Tensor:
    """Labels a Hugging Face causal-LM loss counts: all but each row's first (the shift)
    and the ignored ones."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()
