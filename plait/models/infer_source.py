"""A tensor-parallel plan as Python source (:func:`plan_source`): what
:func:`~plait.models.infer.infer_tp_plan` logs and a refusal shows, to copy, edit and pass
as ``plan=``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.strategies.tensor.plan import TensorPlan
from plait.strategies.tensor.style import Style


def short_style(style: Style | str) -> Style | str:
    """A style without options as its name (``"colwise"``): the plan prints as written."""
    return style.kind if isinstance(style, Style) and style == Style(style.kind) else style


def plan_source(plan: TensorPlan | Mapping[str, Any]) -> str:
    """``plan`` as Python source to copy, edit and pass as ``plan=``."""
    styles: Mapping[str, Any] = plan.styles if isinstance(plan, TensorPlan) else plan
    lines = ["TensorPlan(", "    styles={"]
    lines += [f"        {k!r}: {_style_source(v)}," for k, v in styles.items()]
    lines.append("    },")
    attention = getattr(plan, "attention", ())
    if attention:
        lines.append("    attention=(")
        for h in attention:
            fields = {
                "heads": h.heads,
                "kv_heads": h.kv_heads,
                "key_value": h.key_value,
                "attributes": dict(h.attributes),
                "head_dim": h.head_dim,
                "shared_kv": h.shared_kv or None,
                "head_params": h.head_params,
            }
            args = ", ".join(f"{k}={v!r}" for k, v in fields.items() if v not in (None, (), {}))
            lines.append(f"        AttentionHeads({h.modules!r}, {args}),")
        lines.append("    ),")
    return "\n".join([*lines, ")"])


def _style_source(style: Any) -> str:
    if not isinstance(style, Style):
        return repr(style)
    default = Style(style.kind)
    extra = [
        f"{f}={getattr(style, f)!r}"
        for f in ("input", "output", "transposed", "blocks", "tail")
        if getattr(style, f) != getattr(default, f)
    ]
    return f"Style({', '.join([repr(style.kind), *extra])})"
