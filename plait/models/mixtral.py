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
block runs on its stage; the load-balancing loss, when on, kept exactly through a
statistics pass (:func:`load_balancing_loss`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.models import llama
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.pipeline import PipelinePlan
from plait.strategies.pipeline.batch_loss import BatchLoss
from plait.strategies.tensor.plan import TensorPlan

_MASKED = (
    "Hugging Face's load-balancing loss weights the router logits by this rank's attention "
    "mask, while the logits it reads are gathered over the ranks (the global batch's)"
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


def load_balancing_loss(model: nn.Module, *, router: str) -> BatchLoss:
    """Hugging Face's load-balancing loss of a Mixtral-style model under a pipeline, as a
    :class:`~plait.strategies.pipeline.batch_loss.BatchLoss` over its routers (class
    ``router``, output ``(logits, top-k weights, indices)``).

    The model computes, over every router call ``l`` of the batch (rows ``t``, experts
    ``e``, ``k`` choices per row, ``N`` rows over all calls, ``p = softmax(logits)``)::

        aux = E * sum_e (c_e / N) * (P_e / N),   c_e = #{(l, t, j): topk(p_lt)_j = e},
                                                 P_e = sum_{l,t} p_lte

    and adds ``router_aux_loss_coef * aux``. ``c`` carries no gradient, so once the
    statistics pass has summed ``(c, P, N)`` over the batch, call ``l``'s share is
    ``coef * E * sum_e (c_e / N) * (sum_t p_lte / N)``, computed in float32 as the model
    computes its loss. Statistics per call: ``[c (E), P (E), rows]``."""
    config: Any = getattr(model, "config")  # noqa: B009
    coef = float(config.router_aux_loss_coef)
    k = int(config.num_experts_per_tok)
    routers = [m for m in model.modules() if type(m).__name__ == router]
    if not routers:
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: the load-balancing loss reads the "
            f"routers (class {router}), and the model has none"
        )
    E = int(getattr(routers[0], "num_experts"))  # noqa: B009

    def probabilities(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = output[0]
        p = torch.softmax(logits, dim=-1)
        return p, torch.topk(p, k, dim=-1).indices

    def statistics(output: Any) -> torch.Tensor:
        p, chosen = probabilities(output)
        counts = torch.bincount(chosen.reshape(-1), minlength=E).to(torch.float64)
        rows = torch.tensor([p.shape[0]], dtype=torch.float64, device=p.device)
        return torch.cat([counts, p.detach().to(torch.float64).sum(0), rows])

    def share(output: Any, totals: torch.Tensor) -> torch.Tensor:
        p, _ = probabilities(output)
        n = totals[2 * E].to(torch.float32)
        tokens = totals[:E].to(torch.float32) / n
        return coef * E * torch.sum(tokens * (p.float().sum(0) / n))

    def value(totals: torch.Tensor) -> torch.Tensor:
        n = totals[2 * E].to(torch.float32)
        tokens, probs = totals[:E].to(torch.float32) / n, totals[E : 2 * E].to(torch.float32) / n
        return coef * E * torch.sum(tokens * probs)

    return BatchLoss(
        modules=tuple(routers),
        size=2 * E + 1,
        statistics=statistics,
        share=share,
        value=value,
        carrier=1,  # the top-k weights: the block combines the experts' outputs with them
        name=f"{type(model).__name__}'s load-balancing loss",
    )


def moe_pipeline_plan(model: nn.Module, *, router: str) -> PipelinePlan:
    """The pipeline plan of a Llama-layout MoE causal LM handed over whole: the Llama plan
    (:func:`plait.models.llama.pipeline_plan`), each sparse block on its layer's stage.

    With ``config.output_router_logits=True`` the model's load-balancing loss is kept,
    exactly: it multiplies two means over every layer's router outputs of the whole batch,
    which no stage holds before the pipeline's first backward, so each step first runs the
    batch forward without autograd to sum the routers' statistics
    (:func:`load_balancing_loss`, :mod:`plait.strategies.pipeline.batch_loss`): one extra
    forward per step."""
    config: Any = getattr(model, "config", None)
    if not hasattr(model, "lm_head"):
        raise ValueError(
            f"pipeline plan for {type(model).__name__}: the pipeline trains a causal LM "
            f"(...ForCausalLM) handed over whole; the bare model has no head or loss"
        )
    plan = llama.pipeline_plan(model)
    if getattr(config, "output_router_logits", False):
        noisy = next((n for n, m in model.named_modules() if getattr(m, "jitter_noise", 0.0)), None)
        if noisy is not None:
            raise ValueError(
                f"pipeline plan for {type(model).__name__}: {noisy} draws router jitter noise "
                f"while the load-balancing loss is on; the pipeline computes that loss from "
                f"a first forward of the batch and needs the same routing in the second. "
                f"Set config.router_jitter_noise=0 or output_router_logits=False"
            )
        plan = replace(plan, batch_loss=load_balancing_loss(model, router=router))
    return plan  # type: ignore[no-any-return]


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TensorPlan:
    """Mixtral's tensor-parallel plan (module docstring)."""
    return moe_tp_plan(model, experts="MixtralExperts", sequence_parallel=sequence_parallel)


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """Mixtral's pipeline plan (module docstring)."""
    return moe_pipeline_plan(model, router="MixtralTopKRouter")
