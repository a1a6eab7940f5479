"""Hugging Face Qwen2-MoE and Qwen3-MoE (``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` and
their base models): their plans.

``moe_plan(model)``: the same fused-experts layout as Mixtral
(:func:`plait.models.mixtral.stacked_experts_plan`). The differences stay in the model's own
code, which expert parallelism keeps: the router renormalises the top-k weights only with
``norm_topk_prob`` (casting them back to the model's dtype); Qwen2-MoE's block adds a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``, which every rank computes on its own
tokens (its parameters are dense: averaged over every rank); layers listed in
``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP.

``tp_plan`` / ``pipeline_plan``: Mixtral's (:func:`plait.models.mixtral.moe_tp_plan`,
:func:`~plait.models.mixtral.moe_pipeline_plan`): attention and the dense MLPs split, each
sparse block (with its shared expert) whole on every tensor-parallel rank; the pipeline
keeps the load-balancing loss through a statistics pass.
"""

from __future__ import annotations

from torch import nn

from plait.models.mixtral import moe_pipeline_plan, moe_tp_plan, stacked_experts_plan
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.pipeline import PipelinePlan
from plait.strategies.tensor.plan import TensorPlan


def _kind(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__name__.startswith("Qwen3Moe"):
            return "Qwen3Moe"
        if cls.__name__.startswith("Qwen2Moe"):
            return "Qwen2Moe"
    raise ValueError(
        f"moe plan: {type(model).__name__} is neither a Qwen2-MoE nor a Qwen3-MoE model"
    )


def moe_plan(model: nn.Module) -> MoEPlan:
    """The MoE-block plan of a Qwen2-MoE or Qwen3-MoE model (module docstring)."""
    kind = _kind(model)
    return stacked_experts_plan(model, experts=f"{kind}Experts", router=f"{kind}TopKRouter")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """The tensor-parallel plan of a Qwen2-MoE or Qwen3-MoE model (module docstring)."""
    return moe_tp_plan(model, experts=f"{_kind(model)}Experts", sequence_parallel=sequence_parallel)


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The pipeline plan of a Qwen2-MoE or Qwen3-MoE causal LM (module docstring)."""
    return moe_pipeline_plan(model, router=f"{_kind(model)}TopKRouter")
