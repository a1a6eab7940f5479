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

``tp_plan(model)``: attention split as in the Llama plan (:func:`plait.models.llama.tp_plan`:
heads, grouped-query key/value heads, vocabulary-split embedding and head); every sparse
block (router and experts) stays whole on each rank, which runs it on the replicated input
(under sequence parallelism on its slice of the sequence, the block's gradients summed
over the group). Splitting the experts is expert parallelism's job (``strategy="ep"``).

``pipeline_plan(model)``: the Llama plan's layers (the layout is the same); each sparse
block runs on its stage. The load-balancing loss is refused (module docstring of
:func:`pipeline_plan`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.models import llama
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.pipeline import PipelinePlan
from plait.strategies.tensor.plan import TensorPlan

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


def sparse_blocks(model: nn.Module, *, experts: str) -> list[str]:
    """The paths of the MoE blocks: the parents of the expert containers of class
    ``experts`` (the module that also holds the router)."""
    return [n.rpartition(".")[0] for n, m in model.named_modules() if type(m).__name__ == experts]


def moe_tp_plan(model: nn.Module, *, experts: str, sequence_parallel: bool = False) -> TensorPlan:
    """The tensor-parallel plan of a Llama-layout MoE model whose sparse blocks hold an
    expert container of class ``experts``: attention split, each sparse block whole, the
    dense MLPs of the layers without experts (Qwen-MoE's ``mlp_only_layers``) split as
    Llama's. Refuses router jitter (every rank draws the same noise)."""
    blocks = sparse_blocks(model, experts=experts)
    if not blocks:
        raise ValueError(
            f"tp plan for {type(model).__name__}: no module of class {experts} (the experts "
            f"this family's plan expects); write a TensorPlan for this model"
        )
    for name in blocks:
        noise = getattr(model.get_submodule(name), "jitter_noise", 0.0)
        if noise:
            raise ValueError(
                f"tp plan for {type(model).__name__}: {name} multiplies its input by router "
                f"jitter noise {noise} in training; every tensor-parallel rank would draw the "
                f"same noise (plait has no per-rank RNG streams); set "
                f"config.router_jitter_noise=0"
            )
    prefix = "model." if isinstance(getattr(model, "model", None), nn.Module) else ""
    base = model.get_submodule(prefix.rstrip(".")) if prefix else model
    layers = getattr(base, "layers")  # noqa: B009
    dense = tuple(
        f"{prefix}layers.{i}.mlp"
        for i in range(len(layers))
        if f"{prefix}layers.{i}.mlp" not in blocks
    )
    return llama.decoder_tp_plan(
        model, sequence_parallel=sequence_parallel, dense_mlps=dense, whole=tuple(blocks)
    )


def moe_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The pipeline plan of a Llama-layout MoE causal LM handed over whole: the Llama plan
    (:func:`plait.models.llama.pipeline_plan`), each sparse block on its layer's stage.

    Refused: the load-balancing loss (``config.output_router_logits=True``). Hugging Face's
    loss concatenates the router logits of every layer of the whole batch and multiplies
    two means over them (the tokens each expert got, the probability it was given), so no
    stage can compute its share before the batch's last layer has run, while the pipeline
    starts backward passes before then. Pipeline training of these models drops it (set
    ``output_router_logits=False``) or trains with ``strategy="ep"``, ``"ddp"`` or
    ``"fsdp"``, which keep it."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: config.output_router_logits=True "
            f"(the load-balancing loss) is refused: it multiplies means over every layer's "
            f"router logits of the whole batch, which no pipeline stage holds before the "
            f"backward passes start. Set model.config.output_router_logits=False for "
            f"strategy 'pipeline'/'ptdp', or keep it with strategy 'ep', 'ddp' or 'fsdp'"
        )
    if not hasattr(model, "lm_head"):
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: the pipeline trains a causal LM "
            f"(...ForCausalLM) handed over whole; the bare model has no head or loss"
        )
    return llama.pipeline_plan(model)  # type: ignore[no-any-return]


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """Mixtral's tensor-parallel plan (module docstring)."""
    return moe_tp_plan(model, experts="MixtralExperts", sequence_parallel=sequence_parallel)


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """Mixtral's pipeline plan (module docstring)."""
    return moe_pipeline_plan(model)
