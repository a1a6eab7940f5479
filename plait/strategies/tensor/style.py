"""A tensor-parallel plan's entries: the styles (:data:`KINDS`, :class:`Style`) and their
resolution against a model's module paths (``fnmatch`` patterns to modules, the attention
heads of a :class:`~plait.strategies.tensor.plan.TensorPlan` checked against the group's
size). Pure bookkeeping: nothing here communicates or changes the model."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

# the 2D / 2.5D / 3D styles, handled by parallelize_nd
ND_KINDS = ("2d", "2.5d", "3d")

KINDS = (
    "colwise",
    "rowwise",
    "vocab",
    "sequence",
    "per_head",
    "scatter",
    "gather",
    "replicate",
    *ND_KINDS,
)
# styles that only move activations at a module's entry: they split no parameter
HOOKS = ("scatter", "gather")


@dataclass(frozen=True)
class Style:
    """A plan entry. ``kind`` is one of :data:`KINDS`; ``input``/``output`` override the
    layouts the mode implies (``"replicate"``, ``"sequence"``, or for a row-parallel
    input ``"sharded"``). ``Style("sequence", input="replicate")`` slices a whole input
    along the sequence on entry (the position embedding's ids).

    ``transposed``: the module stores its weight as ``[in, out]`` and computes
    ``x @ weight + bias`` (Hugging Face's ``Conv1D`` in GPT-2); it is split as the linear it
    is and ``full_state_dict`` gives its weight back in its own layout. ``blocks``: a fused
    column-parallel projection whose output is ``blocks`` equal parts (GPT-2's ``c_attn``:
    queries, keys, values): each part is split separately, so every rank holds its slice
    of each. ``tail``: a fused multi-query projection whose last ``tail`` outputs (the one
    shared key and value head) stay whole on every rank while the query rows are split
    (:class:`~plait.strategies.tensor.multi_query.MultiQueryLinear`)."""

    kind: str
    input: str | None = None
    output: str | None = None
    transposed: bool = False
    blocks: int = 1
    tail: int = 0

    def __post_init__(self) -> None:
        if self.tail and (self.kind != "colwise" or self.blocks != 1 or self.transposed):
            raise ValueError(
                f"Style({self.kind!r}, tail={self.tail}): a whole tail (multi-query key and "
                f"value) is for a plain 'colwise' linear without blocks"
            )
        if self.kind not in KINDS:
            raise ValueError(f"unknown tensor-parallel style {self.kind!r}; use one of {KINDS}")
        if self.blocks < 1 or (self.blocks > 1 and self.kind != "colwise"):
            raise ValueError(
                f"Style({self.kind!r}, blocks={self.blocks}): blocks (a fused projection's "
                f"parts) is for 'colwise' only, at least 1"
            )
        if self.transposed and self.kind not in ("colwise", "rowwise"):
            raise ValueError(f"Style({self.kind!r}, transposed=True): for linears only")


def resolve_styles(model: nn.Module, plan: Mapping[str, str | Style]) -> dict[str, Style]:
    """Module path -> style, every pattern matching at least one module."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Style] = {}
    for pattern, value in plan.items():
        style = Style(value) if isinstance(value, str) else value
        if not isinstance(style, Style):
            raise TypeError(f"plan[{pattern!r}]: expected a style name or Style, got {value!r}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"plan entry {pattern!r} matches no module of {type(model).__name__}; module "
                f"paths look like {names[:6]}"
            )
        for n in hits:
            if n in out and out[n] != style:
                raise ValueError(f"module {n!r} is given two styles: {out[n]} and {style}")
            out[n] = style
    return out


def resolve_attention(
    model: nn.Module, plan: TensorPlan, styles: dict[str, Style], t: int
) -> tuple[dict[str, tuple[int, int]], list[tuple[nn.Module, dict[str, int], AttentionHeads]]]:
    """Check every :class:`AttentionHeads` entry against ``t`` (naming the module); return
    the key/value projections to keep whole (path -> ``(head_dim, replicas)``) and the
    attention modules whose head-count attributes become this rank's."""
    keep_whole: dict[str, tuple[int, int]] = {}
    counted: list[tuple[nn.Module, dict[str, int], AttentionHeads]] = []
    names = [n for n, _ in model.named_modules() if n]
    for heads in plan.attention:
        hits = [n for n in names if fnmatch.fnmatchcase(n, heads.modules)]
        if not hits:
            raise ValueError(
                f"AttentionHeads pattern {heads.modules!r} matches no module of "
                f"{type(model).__name__}; module paths look like {names[:6]}"
            )
        local = heads.local(t)
        for n in hits:
            module = model.get_submodule(n)
            counted.append((module, local, heads))
            if local["replicas"] == 1:
                continue
            for child in heads.key_value:
                path = f"{n}.{child}"
                proj = module.get_submodule(child)
                if styles.get(path, Style("replicate")).kind != "colwise":
                    raise ValueError(
                        f"attention {n!r}: key/value projection {path!r} must have the style "
                        f"'colwise' (it is kept whole and each rank computes its own head)"
                    )
                kv = heads.kv_heads or heads.heads
                out = getattr(proj, "out_features", 0)
                if out % kv:
                    raise ValueError(f"attention {n!r}: {path!r} has {out} outputs, not {kv} heads")
                keep_whole[path] = (out // kv, local["replicas"])
    return keep_whole, counted
