"""A tensor-parallel plan inferred for a model no family knows, where that is safe.

:func:`infer_tp_plan` reads the model's structure the way DeepSpeed's AutoTP does, then
proves what it read by running it (:mod:`plait.models.verify_plan`):

1. **Blocks**: the longest ``nn.ModuleList`` / ``nn.ModuleDict`` of modules of one class that
   hold linears (the decoder layers). Every block must hold the same linears (names,
   classes, shapes) as the first.
2. **Linears of a block**, grouped by the module that holds them:

   - an *attention* module holds ``q/k/v`` projections (``q_proj``, ``query``, ``wq``, ...)
     or one fused ``qkv`` (``query_key_value``, ``qkv_proj``, ``c_attn``, ...), and one
     output projection (``o_proj``, ``out_proj``, ``dense``, ``c_proj``, ...): the input
     side is ``"colwise"``, the output ``"rowwise"``;
   - an *MLP* holds one or two input linears (``up_proj``, ``gate_proj``, ``fc1``,
     ``c_fc``, ``gate_up_proj``, ...) and one output linear (``down_proj``, ``fc2``,
     ``c_proj``, ...): ``"colwise"`` then ``"rowwise"``; a sparse block (stacked experts,
     3-D weights) has none or only its shared expert's, and its router and experts stay
     whole on every rank, which runs them on the replicated input.

   A linear these names do not classify is refused by name.
3. **Heads**: the query and key/value head counts come from the model's ``config``
   (``num_attention_heads``, ``num_key_value_heads``, ``n_head``, ``multi_query``...) or the
   attention module's attributes, the head width from the projections' shapes (a fused
   ``qkv`` must have ``(heads + 2 * kv_heads) * head_dim`` outputs). The attention module's
   integer attributes named like head counts (``num_heads``, ``num_key_value_heads``,
   ``num_key_value_groups``) or widths (``embed_dim``, ``hidden_size``, ``split_size``)
   holding those values are the candidates to set to each rank's counts.
4. **Proof** (:mod:`plait.models.verify_plan`): the blocks are cut into ``t`` simulated
   ranks in one process, in float64, their collectives run as the layers run them, and
   compared with the whole blocks on the activations the model itself feeds them. Whether a
   fused projection splits as one run of heads or per part (``Style(blocks=3)``: queries,
   keys, values; ``blocks=2``: gate and up) and which candidate attributes the forward reads
   are decided on the first block: the largest set of attributes that reproduces it is
   kept. Then every kind of block (sliding and global attention, dense and sparse, the
   last block) is run forward and backward: outputs, input gradients and every parameter's
   gradient must be the whole block's; a norm inside the attention whose gradient is right
   only summed over the ranks gets the ``"per_head"`` style. Nothing is guessed: a plan that
   reproduces no block, or fails a later kind, is refused, naming the block, how it differs
   from the first and what was tried.

Embedding and head: split by vocabulary only when recognisable, the token embedding being a
plain ``nn.Embedding`` (Hugging Face's ``get_input_embeddings()``, or one whose weight a
plain ``nn.Linear`` head shares) and the head a plain ``nn.Linear`` with one output per token
(``get_output_embeddings()`` or that tied linear), gathered (``Style("vocab",
output="replicate")``), so the model's forward still returns the full logits and its own
loss works. Anything else (a scaled embedding subclass, learned positions, a head with its
own forward) stays replicated on every rank: safe, only not split.

Not inferred (refused with an example plan to write): sequence parallelism, 2D/2.5D/3D
modes, fused ``qkv`` with grouped-query heads whose split the proof cannot confirm, forwards
that read head counts from a shared config, per-head parameters (GPT-OSS's attention sinks),
blocks that hold other linears (dense and MoE layers alternating), models the example token
ids cannot run (pass ``example=``). The inferred plan leaves out the hand-written plans'
``"gather"`` entries (one backward all-reduce per block instead of one per column-parallel
projection): the same result, a little more communication. The plan is logged at info as
Python source (:func:`plan_source`) to copy, edit and pass as ``plan=``.

The parts: :mod:`~plait.models.infer_find` (steps 1-3 and the refusal),
:mod:`~plait.models.verify_plan` (step 4), :mod:`~plait.models.infer_source` (the plan as
source); this module puts them together with the embedding and head.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch import nn

from plait.models.infer_find import (
    Found,
    PlanInferenceError,
    example_input,
    find,
    refuse,
    repeated_blocks,
)
from plait.models.infer_source import plan_source, short_style
from plait.models.verify_plan import prove
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan
from plait.strategies.tensor.style import Style

log = logging.getLogger("plait")


def _vocab_styles(model: nn.Module) -> dict[str, Style]:
    """The token embedding and head split by vocabulary where recognisable (module doc)."""
    names = {id(m): n for n, m in model.named_modules()}
    embed = head = None
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embed = getter() if callable(getter) else None
        getter = getattr(model, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        embed = head = None
    if embed is None:  # a plain model: an embedding whose weight a linear head shares
        linears = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear)}
        for m in model.modules():
            if isinstance(m, nn.Embedding) and id(m.weight) in linears:
                embed, head = m, linears[id(m.weight)]
    out: dict[str, Style] = {}
    plain = (
        isinstance(embed, nn.Embedding)
        and type(embed).forward is nn.Embedding.forward
        and embed.max_norm is None
        and not embed.sparse
        and id(embed) in names
    )
    if plain:
        assert embed is not None
        out[names[id(embed)]] = Style("vocab")
    plain_head = (
        isinstance(head, nn.Linear)
        and type(head).forward is nn.Linear.forward
        and id(head) in names
        and (not plain or head.out_features == embed.num_embeddings)  # type: ignore[union-attr]
    )
    # a head sharing the weight of an embedding left whole stays whole with it
    tied = embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    if plain_head and (plain or not tied):
        assert head is not None
        out[names[id(head)]] = Style("vocab", output="replicate")
    return out


def infer_tp_plan(model: nn.Module, *, tp: int | None = None, example: Any = None) -> TensorPlan:
    """The 1D tensor-parallel plan of ``model``, inferred and proven (module doc), or
    :class:`PlanInferenceError` naming what could not be and the plan to write.

    ``tp``: the tensor-parallel size to prove the plan at (default: the smallest that splits
    both the query and key/value heads); a size the heads do not fit is refused naming the
    module. ``example``: the model's input for the proof (default: token ids ``(2, 5)``
    below the embedding's vocabulary, ``use_cache=False`` where the forward takes it).
    Cost: one forward of the model on the example; ``t`` threaded forwards of a float64 copy
    of the first block per candidate (a few dozen at most); one forward and backward of a
    float64 copy of each kind of block (and the last) on ``t`` threads; no collective.
    """

    found = find(model)
    if tp is None:
        common = math.gcd(found.heads, found.kv_heads)
        tp = _smallest_factor(common if common > 1 else found.heads)
    if tp < 2:
        raise refuse(model, f"attention has {found.heads} head: nothing to split")
    block_styles, heads = prove(model, found, tp=tp, example=example, refuse=refuse)
    styles: dict[str, Style | str] = {k: v for k, v in _vocab_styles(model).items()}
    for path, style in block_styles.items():
        styles[f"{found.blocks}.*.{path}"] = style
    pattern = f"{found.blocks}.*" + (f".{found.attention}" if found.attention else "")
    plan = TensorPlan(
        styles={k: short_style(v) for k, v in styles.items()},
        attention=(AttentionHeads(pattern, **heads),),
    )
    log.info("inferred tensor-parallel plan for %s:\n%s", type(model).__name__, plan_source(plan))
    return plan


def _smallest_factor(n: int) -> int:
    return next((p for p in range(2, n + 1) if n % p == 0), 1)


# what callers import from here; each lives in the module named above
__all__ = [
    "Found",
    "PlanInferenceError",
    "example_input",
    "find",
    "infer_tp_plan",
    "plan_source",
    "refuse",
    "repeated_blocks",
]
