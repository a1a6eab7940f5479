"""Plans for torchtitan's Llama 3 (``torchtitan.models.llama3.model.model.Transformer``).

Recognised by class name (``Transformer``, in ``plait.models.plans.FAMILIES``); the plan
first checks the layout below, so another class of that name is refused by name rather
than split by a wrong plan. torchtitan is never imported here. The layout read::

    tok_embeddings                         nn.Embedding (or a subclass keeping its forward)
    layers.<i>.attention.{wq,wk,wv,wo}     nn.Linear (or subclasses); n_heads, n_kv_heads,
                                           n_rep (query heads per key/value head)
    layers.<i>.attention.{q_norm,k_norm}   RMSNorm over each head (use_qk_norm) or Identity
    layers.<i>.feed_forward.{w1,w2,w3}     nn.Linear: w2(silu(w1(x)) * w3(x))
    layers.<i>.{attention_norm,ffn_norm}, norm    RMSNorm
    output                                 nn.Linear
    freqs_cis                              complex RoPE buffer, left as it is

The attention infers its local head count from the widths (``view(bs, seqlen, -1,
head_dim)``) and repeats key/value heads ``n_rep`` times.

``pipeline_plan(model)``: ``tok_embeddings``, each ``layers.<i>(h, freqs_cis)``, then
``norm`` and ``output``; every stage reads the model's rotary table (``freqs_cis``, rows
``0..s-1``, never sent). The model returns logits and has no loss of its own: the plan's is
torchtitan's, cross-entropy of the logits (16-bit ones upcast to float32) against labels already
shifted by the data loader, ``-100`` ignored, its sum divided by the number of labels in the
whole global batch (equal to the mean when none is ignored).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.pipeline import Layer, PipelinePlan
from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

LAYOUT = ("tok_embeddings", "layers", "norm", "output")


def _check_layout(model: nn.Module) -> None:
    missing = [n for n in LAYOUT if not isinstance(getattr(model, n, None), nn.Module)]
    if missing or not isinstance(getattr(model, "freqs_cis", None), torch.Tensor):
        raise ValueError(
            f"{type(model).__name__} is taken for torchtitan's Llama 3 by its class name, but "
            f"it has no {missing or ['freqs_cis']}; pass plan= to plait.prepare (a "
            f"TensorPlan or a PipelinePlan written for it)"
        )


def _loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any) -> torch.Tensor:
    """torchtitan's cross-entropy on pre-shifted labels, summed, over the batch's items."""
    wide = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(wide, labels.flatten(0, 1), ignore_index=-100, reduction="sum")
    return total / num_items


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The pipeline plan of torchtitan's Llama 3 (module docstring)."""
    _check_layout(model)
    blocks: Any = getattr(model, "layers")  # noqa: B009
    embed: Any = getattr(model, "tok_embeddings")  # noqa: B009
    layers = [Layer("embed", (("tok_embeddings", embed),), embed)]
    for name, block in blocks.items():
        layers.append(
            Layer(
                f"layers.{name}",
                ((f"layers.{name}", block),),
                lambda x, table, b=block: b(x, table),
                contextual=True,
            )
        )
    norm: Any = getattr(model, "norm")  # noqa: B009
    output: Any = getattr(model, "output")  # noqa: B009
    layers.append(Layer("head", (("norm", norm), ("output", output)), lambda x: output(norm(x))))

    def table(x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The rotary rows the blocks slice (their first ``s``): under context parallelism
        the rows of the rank's global positions (``position_ids``, the same on every row)."""
        freqs: torch.Tensor = getattr(model, "freqs_cis")  # noqa: B009
        if position_ids is not None:
            freqs = freqs.index_select(0, position_ids[0].to(freqs.device))
        return freqs.to(x.device)

    return PipelinePlan(
        layers=tuple(layers),
        loss=_loss,
        reduction="items",
        items=lambda labels: (labels != -100).sum(),
        context=table,
        inputs=("position_ids",),
        name=type(model).__name__,
    )


def context_plan(model: nn.Module) -> str:
    """Context parallelism's plan: the rotary table ``freqs_cis``, indexed by position
    (the blocks read its first ``s`` rows for ``s`` tokens), whose rows
    :func:`plait.strategies.context.context_parallel` swaps for the rank's global
    positions around each forward."""
    _check_layout(model)
    return "freqs_cis"


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """The 1D tensor-parallel plan of torchtitan's Llama 3 (the one its ``apply_tp`` uses,
    with the output's logits gathered so the forward returns the full logits): ``wq/wk/wv``
    and ``w1/w3`` column-wise, ``wo`` and ``w2`` row-wise, the token embedding and the
    output by vocabulary; per-head ``q_norm``/``k_norm`` with their gradients summed."""
    _check_layout(model)
    if sequence_parallel:
        raise ValueError(
            "torchtitan Llama 3: sequence parallelism is not available yet; use "
            "sequence_parallel=False"
        )
    attention: Any = next(m for n, m in model.named_modules() if n.endswith(".attention"))
    styles: dict[str, Any] = {
        "tok_embeddings": "vocab",
        # one entry into the tensor-parallel region per block (one backward all-reduce)
        "layers.*.attention": "gather",
        "layers.*.attention.wq": Style("colwise", input="gathered"),
        "layers.*.attention.wk": Style("colwise", input="gathered"),
        "layers.*.attention.wv": Style("colwise", input="gathered"),
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward": "gather",
        "layers.*.feed_forward.w1": Style("colwise", input="gathered"),
        "layers.*.feed_forward.w3": Style("colwise", input="gathered"),
        "layers.*.feed_forward.w2": "rowwise",
        "output": Style("vocab", output="replicate"),
    }
    for norm in ("q_norm", "k_norm"):
        if list(getattr(attention, norm, nn.Identity()).parameters()):
            styles[f"layers.*.attention.{norm}"] = "per_head"
    heads = AttentionHeads(
        "layers.*.attention",
        heads=attention.n_heads,
        kv_heads=attention.n_kv_heads,
        key_value=("wk", "wv"),
        attributes={"n_rep": "groups"},
    )
    return TensorPlan(styles=styles, attention=(heads,))
