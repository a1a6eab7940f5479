"""Plans for Hugging Face ``GPT2LMHeadModel``: ``transformer.wte`` + ``transformer.wpe``,
``transformer.h[i]`` (``Conv1D`` projections: a linear layer stored transposed),
``transformer.ln_f``, ``lm_head`` (tied to ``wte`` by default). Read by name, without
importing ``transformers`` here; the mask function is the model's own module's.

Tensor parallelism (:func:`tp_plan`): ``Conv1D`` is a linear whose weight is stored
transposed (``x @ W + b``, ``W`` of shape ``[in, out]``): it is split as that linear
(``Style(transposed=True)``), and ``full_state_dict`` gives it back in its own layout.
``c_attn`` is three projections fused: each of its parts is split on its own
(``blocks=3``), so a rank holds its heads' queries, keys and values. The attention splits
``c_attn``'s output with ``split_size`` (the query width), which becomes this rank's width.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.models.llama import causal_lm_items
from plait.strategies.pipeline import Layer, PipelinePlan
from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan


@dataclass(frozen=True)
class _StageContext:
    position_ids: torch.Tensor
    mask: Any


def pipeline_plan(model: Any) -> Any:
    """The pipeline plan of a Hugging Face GPT-2 causal LM handed over whole.

    Layers: ``embed`` (``wte(ids) + wpe(0..s-1)``, then the embedding dropout),
    ``transformer.h.<i>`` (contextual), ``head`` (``ln_f`` then ``lm_head``; tied to
    ``wte`` by default: the pipeline sums the two stages' gradients). Context, recomputed on
    each stage from the positions ``0..s-1`` and the micro-batch's rows of the
    ``attention_mask`` (a per-micro-batch input, sliced on each rank), never sent: the
    causal mask from the model's own ``create_causal_mask``, as ``GPT2Model.forward`` builds
    it (the mask viewed as ``[rows, -1]``; the positions ``0..s-1`` on every row, padded or
    not, as the model's forward without a cache). ``step(input_ids, labels)``: unpadded
    ids, or ``step(input_ids, labels, attention_mask=mask)`` padded ones; Hugging Face
    labels (unshifted, ``-100`` ignored; ``-100`` on the pads); the loss is
    ``model.loss_function`` with ``num_items_in_batch`` counted over the whole global batch.
    Refused: cross-attention (``add_cross_attention``).
    """

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

    def context(h: torch.Tensor, attention_mask: torch.Tensor | None = None) -> _StageContext:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(h.shape[0], -1)
        mask = make_mask(
            config=cfg, inputs_embeds=h, attention_mask=attention_mask, cache=None, position_ids=pos
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
        shifts_labels=True,
        items=causal_lm_items,
        context=context,
        inputs=("attention_mask",),
        name=type(model).__name__,
    )


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """The 1D tensor-parallel plan of a GPT-2: attention heads split (``c_attn``
    column-wise per q/k/v part, ``c_proj`` row-wise), the MLP column-then-row, the token
    embedding by vocabulary, ``lm_head`` by vocabulary with its output gathered (the
    model's forward returns the full logits; ``labels=`` works unchanged). Position
    embedding and LayerNorms stay whole on every rank."""
    if sequence_parallel:
        raise ValueError(
            f"{type(model).__name__}: sequence parallelism is not available for Hugging "
            f"Face GPT-2 yet; use sequence_parallel=False"
        )
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "n_head"):
        raise ValueError(f"{type(model).__name__}: a GPT-2 plan reads config.n_head, n_embd")
    prefix = "transformer." if isinstance(getattr(model, "transformer", None), nn.Module) else ""
    blocks = f"{prefix}h.*"
    conv = Style("colwise", transposed=True)
    styles: dict[str, Any] = {
        f"{prefix}wte": "vocab",
        f"{blocks}.attn.c_attn": Style("colwise", transposed=True, blocks=3),
        f"{blocks}.attn.c_proj": Style("rowwise", transposed=True),
        f"{blocks}.mlp.c_fc": conv,
        f"{blocks}.mlp.c_proj": Style("rowwise", transposed=True),
    }
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        styles["lm_head"] = Style("vocab", output="replicate")
    heads = AttentionHeads(
        f"{blocks}.attn",
        heads=config.n_head,
        head_dim=config.n_embd // config.n_head,
        attributes={"num_heads": "heads", "split_size": "width"},
    )
    return TensorPlan(styles=styles, attention=(heads,))
