"""Plans for Hugging Face ``GPT2LMHeadModel``: ``transformer.wte`` + ``transformer.wpe``,
``transformer.h[i]`` (``Conv1D`` projections: a linear layer stored transposed),
``transformer.ln_f``, ``lm_head`` (tied to ``wte`` by default). Read by name, without
importing ``transformers`` here; the mask function is the model's own module's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from plait.models.llama import causal_lm_items


@dataclass(frozen=True)
class _StageContext:
    position_ids: torch.Tensor
    mask: Any


def pipeline_plan(model: Any) -> Any:
    """The pipeline plan of a Hugging Face GPT-2 causal LM handed over whole.

    Layers: ``embed`` (``wte(ids) + wpe(0..s-1)``, then the embedding dropout),
    ``transformer.h.<i>`` (contextual), ``head`` (``ln_f`` then ``lm_head``; tied to
    ``wte`` by default: the pipeline sums the two stages' gradients). Context, recomputed on
    each stage from the positions ``0..s-1``, never sent: the causal mask from the model's
    own ``create_causal_mask``, as ``GPT2Model.forward`` builds it without padding.
    ``step(input_ids, labels)``: unpadded ids, Hugging Face labels (unshifted, ``-100``
    ignored); the loss is ``model.loss_function`` with ``num_items_in_batch`` counted over
    the whole global batch. Refused: cross-attention (``add_cross_attention``).
    """
    from plait.strategies.pipeline import Layer, PipelinePlan

    base: Any = model.transformer
    cfg: Any = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: add_cross_attention=True needs the "
            f"encoder's hidden states on every stage; plait's GPT-2 plan covers the decoder "
            f"only. Build the model with add_cross_attention=False or write its plan"
        )
    make_mask = sys.modules[type(base).__module__].create_causal_mask

    def embed(ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return base.drop(base.wte(ids) + base.wpe(pos))  # type: ignore[no-any-return]

    def context(h: torch.Tensor) -> _StageContext:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = make_mask(
            config=cfg, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )
        return _StageContext(pos, mask)

    def block(layer: Any) -> Any:
        def run(x: torch.Tensor, ctx: _StageContext) -> torch.Tensor:
            return layer(  # type: ignore[no-any-return]
                x, None, ctx.mask, None, use_cache=False, position_ids=ctx.position_ids
            )

        return run

    def head(x: torch.Tensor) -> torch.Tensor:
        return model.lm_head(base.ln_f(x))  # type: ignore[no-any-return]

    def loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any) -> torch.Tensor:
        return model.loss_function(  # type: ignore[no-any-return]
            logits=logits, labels=labels, vocab_size=cfg.vocab_size, num_items_in_batch=num_items
        )

    layers = [Layer("embed", (("transformer.wte", base.wte), ("transformer.wpe", base.wpe)), embed)]
    for i, layer in enumerate(base.h):
        name = f"transformer.h.{i}"
        layers.append(Layer(name, ((name, layer),), block(layer), contextual=True))
    layers.append(
        Layer("head", (("transformer.ln_f", base.ln_f), ("lm_head", model.lm_head)), head)
    )
    return PipelinePlan(
        layers=tuple(layers),
        loss=loss,
        reduction="items",
        items=causal_lm_items,
        context=context,
        name=type(model).__name__,
    )
