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
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

LAYOUT = ("tok_embeddings", "layers", "norm", "output")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """The 1D tensor-parallel plan of torchtitan's Llama 3 (the one its ``apply_tp`` uses,
    with the output's logits gathered so the forward returns the full logits): ``wq/wk/wv``
    and ``w1/w3`` column-wise, ``wo`` and ``w2`` row-wise, the token embedding and the
    output by vocabulary; per-head ``q_norm``/``k_norm`` with their gradients summed."""
    missing = [n for n in LAYOUT if not isinstance(getattr(model, n, None), nn.Module)]
    if missing:
        raise ValueError(
            f"{type(model).__name__} is taken for torchtitan's Llama 3 by its class name, but "
            f"it has no {missing}; pass plan= to plait.prepare (module paths -> 'colwise' / "
            f"'rowwise' / 'vocab')"
        )
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
