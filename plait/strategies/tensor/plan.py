"""What 1D tensor parallelism needs to know about a model: a :class:`TensorPlan`.

A plan is data, written once per model family (``plait/models/<family>.py`` defines
``tp_plan(model, **options)``) and read by :func:`~plait.strategies.tensor.parallelize`:

- ``styles``: module path patterns (``fnmatch``: ``"model.layers.*.self_attn.q_proj"``) ->
  style (``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"sequence"``, ``"replicate"`` or a
  :class:`~plait.strategies.tensor.style.Style`);
- ``attention``: one :class:`AttentionHeads` per kind of attention module, saying how many
  query and key/value heads it has, which children project keys and values, and which of
  its attributes hold head counts that must become this rank's counts.

A plain mapping (``{"blocks.*.attn.qkv": "colwise", ...}``) is a plan without ``attention``
entries. For example, a Llama-shaped model of one's own::

    TensorPlan(
        styles={
            "embed": "vocab",
            "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
            "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise",
            "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
            "head": Style("vocab", output="replicate"),   # full logits
        },
        attention=(AttentionHeads("layers.*.attn", heads=8, kv_heads=2, key_value=("k", "v"),
                                  attributes={"n_local_heads": "heads"}),),
    )
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# what an AttentionHeads attribute may hold: this rank's query heads, key/value heads,
# query heads per key/value head, or query width (heads * head_dim)
HEAD_COUNTS = ("heads", "kv_heads", "groups", "width")


@dataclass(frozen=True)
class AttentionHeads:
    """The heads of the attention modules matching ``modules`` (an ``fnmatch`` pattern).

    ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query attention; None:
    as many as ``heads``). Under tensor parallelism over ``t`` ranks each rank computes
    ``heads / t`` query heads (``t`` must divide ``heads``). Key/value heads are split the
    same way when ``t`` divides ``kv_heads``; when ``kv_heads`` divides ``t`` instead, the
    projections named in ``key_value`` (children of the attention module) are kept whole on
    every rank and each rank computes the one key/value head its query heads read
    (:class:`~plait.strategies.tensor.layers.HeadSelectLinear`); otherwise the plan is
    refused naming the module. ``attributes`` maps attribute names of the attention module
    to :data:`HEAD_COUNTS` (``"heads"``, ``"kv_heads"``, ``"groups"``); each attribute the
    module has is set to this rank's count (an attribute it lacks is skipped, so one plan
    serves several versions of a library); ``"width"`` is this rank's ``heads * head_dim``
    (GPT-2's ``split_size``). ``shared_kv``: the key/value heads are the whole tail of a
    fused projection (``Style("colwise", tail=...)``: multi-query attention), kept whole on
    every rank, so ``t`` may exceed ``kv_heads`` without naming ``key_value``.
    ``head_params``: parameters of the attention module itself holding one entry per query
    head on dimension 0 (GPT-OSS's attention ``sinks``), split with the heads.
    """

    modules: str
    heads: int
    kv_heads: int | None = None
    key_value: tuple[str, ...] = ()
    attributes: Mapping[str, str] = field(default_factory=dict)
    head_dim: int | None = None  # needed by a "width" attribute
    shared_kv: bool = False  # kv heads in a fused projection's whole tail (Style(tail=))
    head_params: tuple[str, ...] = ()  # own parameters with one entry per query head

    def __post_init__(self) -> None:
        if "width" in self.attributes.values() and self.head_dim is None:
            raise ValueError(
                f"AttentionHeads({self.modules!r}): a 'width' attribute needs head_dim="
            )
        bad = {k: v for k, v in self.attributes.items() if v not in HEAD_COUNTS}
        if bad:
            raise ValueError(
                f"AttentionHeads({self.modules!r}): attributes {bad} must map to one of "
                f"{HEAD_COUNTS}"
            )

    def local(self, t: int) -> dict[str, int]:
        """This rank's ``heads``, ``kv_heads`` and ``groups`` over ``t`` ranks, and
        ``replicas`` (ranks sharing one key/value head; 1 when they are split). Raises
        ``ValueError`` naming the module and the counts when ``t`` fits neither way."""
        kv = self.kv_heads or self.heads
        if self.heads % t:
            raise ValueError(
                f"attention {self.modules!r} has {self.heads} query heads, not divisible by "
                f"the tensor-parallel size {t}; choose a tensor-parallel size that divides "
                f"{self.heads}"
            )
        if kv % t == 0:
            local_kv, replicas = kv // t, 1
        elif t % kv == 0 and (self.key_value or self.shared_kv):
            local_kv, replicas = 1, t // kv
        else:
            how = (
                "name its key/value projections in AttentionHeads(key_value=...) to keep them "
                "whole on every rank"
                if t % kv == 0
                else f"choose a tensor-parallel size that divides {kv} or that {kv} divides"
            )
            raise ValueError(
                f"attention {self.modules!r} has {kv} key/value heads and the tensor-parallel "
                f"size is {t}: {t} does not divide {kv}; {how}"
            )
        heads = self.heads // t
        return {
            "heads": heads,
            "kv_heads": local_kv,
            "groups": heads // local_kv,
            "width": heads * (self.head_dim or 0),
            "replicas": replicas,
        }


@dataclass(frozen=True)
class TensorPlan:
    """A model's 1D tensor-parallel plan (module doc): ``styles`` and ``attention``."""

    styles: Mapping[str, Any]
    attention: tuple[AttentionHeads, ...] = ()


def as_plan(plan: TensorPlan | Mapping[str, Any]) -> TensorPlan:
    """A :class:`TensorPlan` from a plan or a plain ``{pattern: style}`` mapping."""
    if isinstance(plan, TensorPlan):
        return plan
    if isinstance(plan, Mapping):
        return TensorPlan(styles=dict(plan))
    raise TypeError(
        f"a tensor-parallel plan is a TensorPlan or a mapping of module patterns to styles, "
        f"got {type(plan).__name__}"
    )
