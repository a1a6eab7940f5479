"""Hugging Face Qwen2-MoE and Qwen3-MoE (``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` and
their base models): their plans.

``moe_plan(model)``: the same fused-experts layout as Mixtral
(:func:`plait.models.mixtral.stacked_experts_plan`). The differences stay in the model's own
code, which expert parallelism keeps: the router renormalises the top-k weights only with
``norm_topk_prob`` (casting them back to the model's dtype); Qwen2-MoE's block adds a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``, which every rank computes on its own
tokens (its parameters are dense: averaged over every rank); layers listed in
``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP.
"""

from __future__ import annotations

from torch import nn

from plait.models.mixtral import stacked_experts_plan
from plait.strategies.moe.plan import MoEPlan


def moe_plan(model: nn.Module) -> MoEPlan:
    """The MoE-block plan of a Qwen2-MoE or Qwen3-MoE model (module docstring)."""
    for cls in type(model).__mro__:
        if cls.__name__.startswith("Qwen3Moe"):
            return stacked_experts_plan(
                model, experts="Qwen3MoeExperts", router="Qwen3MoeTopKRouter"
            )
        if cls.__name__.startswith("Qwen2Moe"):
            return stacked_experts_plan(
                model, experts="Qwen2MoeExperts", router="Qwen2MoeTopKRouter"
            )
    raise ValueError(
        f"moe plan: {type(model).__name__} is neither a Qwen2-MoE nor a Qwen3-MoE model"
    )
