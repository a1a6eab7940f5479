"""Hugging Face Mixtral (``MixtralForCausalLM``, ``MixtralModel``): its plans.

``moe_plan(model)``: the sparse blocks' expert containers (``MixtralExperts``: every expert's
``gate_up_proj [E, 2I, d]`` and ``down_proj [E, d, I]`` stacked on dimension 0, expert
``e`` computing ``down_proj[e] @ (act(gate) * up)`` with ``gate, up = gate_up_proj[e] @ x``
split in halves) and the routers (``MixtralTopKRouter``: softmax over the logits, top-k,
the top-k weights renormalised to sum to 1), whose logits the model's load-balancing loss
reads when ``output_router_logits`` is on. Expert parallelism keeps the model's router and
block and replaces only the experts' computation (:mod:`plait.strategies.moe.stacked`).

Hugging Face 5.x layout is required (stacked experts, not the 4.x ``ModuleList`` of
``MixtralBlockSparseTop2MLP``); a transposed or biased layout is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.moe.plan import MoEPlan

_MASKED = (
    "Hugging Face's load-balancing loss weights the router logits by this rank's attention "
    "mask, while under expert parallelism the logits are the global batch's"
)


def run_stacked_expert(box: nn.Module, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a Hugging Face 5.x fused experts module on ``rows [n, d]``: the
    gated MLP ``down_proj[e] (act(g) * u)`` with ``[g; u] = gate_up_proj[e] rows``."""
    gate_up: torch.Tensor = getattr(box, "gate_up_proj")  # noqa: B009 (typed access)
    down: torch.Tensor = getattr(box, "down_proj")  # noqa: B009
    act: Any = getattr(box, "act_fn")  # noqa: B009
    gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down[e])


def _aux_loss_on(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    if not hasattr(model, "router_aux_loss_coef"):
        return False  # the base model returns the logits but computes no loss
    flag = kwargs.get("output_router_logits")
    if flag is None:
        flag = getattr(getattr(model, "config", None), "output_router_logits", False)
    return bool(flag)


def stacked_experts_plan(model: nn.Module, *, experts: str, router: str) -> MoEPlan:
    """The plan of a Hugging Face 5.x MoE model whose blocks hold a router of class
    ``router`` and fused experts of class ``experts`` (gate_up_proj / down_proj)."""
    for name, m in model.named_modules():
        if type(m).__name__ != experts:
            continue
        if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False):
            raise ValueError(
                f"moe plan: {name} ({experts}) stores transposed or biased expert weights; "
                f"plait's plan for it expects gate_up_proj [E, 2I, d] and down_proj [E, d, I] "
                f"without bias: write a MoEPlan with your own run_expert"
            )
        if not getattr(m, "is_concatenated", True):
            raise ValueError(
                f"moe plan: {name} ({experts}) interleaves gate and up rows; plait's plan "
                f"expects them concatenated: write a MoEPlan with your own run_expert"
            )
    return MoEPlan(
        experts=(experts,),
        stacked=("gate_up_proj", "down_proj"),
        run_expert=run_stacked_expert,
        num_experts="num_experts",
        routers=(router,),
        logits_index=0,
        aux_loss_on=_aux_loss_on,
        refuse_kwargs=(("attention_mask", _MASKED),),
    )


def moe_plan(model: nn.Module) -> MoEPlan:
    """Mixtral's MoE-block plan (module docstring)."""
    return stacked_experts_plan(model, experts="MixtralExperts", router="MixtralTopKRouter")
