"""Plans for Hugging Face GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``).

Recognised by class name (``plait.models.plans.FAMILIES``); ``transformers`` is never
imported here. The layout read::

    transformer.wte, transformer.wpe        nn.Embedding (tokens, positions)
    transformer.h.<i>.attn.c_attn           Conv1D [n_embd, 3 n_embd]: queries | keys | values
    transformer.h.<i>.attn.c_proj           Conv1D [n_embd, n_embd]
    transformer.h.<i>.mlp.c_fc, .c_proj     Conv1D [n_embd, inner], [inner, n_embd]
    transformer.h.<i>.ln_1, .ln_2, transformer.ln_f    nn.LayerNorm
    lm_head                                 nn.Linear, tied to wte by default

``Conv1D`` is a linear whose weight is stored transposed (``x @ W + b``, ``W`` of shape
``[in, out]``): it is split as that linear (``Style(transposed=True)``), and
``full_state_dict`` gives it back in its own layout. ``c_attn`` is three projections fused:
each of its parts is split on its own (``blocks=3``), so a rank holds its heads' queries,
keys and values. The attention splits ``c_attn``'s output with ``split_size`` (the query
width), which becomes this rank's width.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan


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
