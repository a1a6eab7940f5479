"""Mixture-of-experts models under context parallelism: what stays exact, what is refused.

A Hugging Face MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE: described by the family's
:class:`~plait.strategies.moe.MoEPlan`) routes every token on its own (dropless top-k), so
its output and the cross-entropy are exact when a cp rank holds only some tokens of each
sequence. Its load-balancing loss is not per token::

    aux = E * sum_e (c_e / N) * (P_e / N)     (c_e: top-k choices of expert e, P_e: the sum
                                               of its router probabilities, N: the rows of
                                               every router call of the batch)

a product of two means over the whole batch: computed by each cp rank on its own tokens and
averaged, it is a different number. So the routers' logits are gathered
(:func:`~plait.strategies.moe.stacked.gather_router_logits`: forward, an all-gather of one
row count and one uneven all-to-all per router call; backward, the reverse all-to-all) over
the ranks that average gradients, ``G = cp x dp`` (``n = c * d`` ranks, each with its own
tokens, together the global batch as one process sees it). Every rank then computes the
same ``aux``, the global batch's.

Why no gradient scale: rank ``r``'s loss is ``L_r = CE_r + coef * aux``; the gradients are
averaged over ``G``. In backward each of the ``n`` copies of ``aux`` sends its gradient for
rank ``s``'s logits home, so ``s`` gets ``n * d aux / d logits_s``; the average over ``G``
divides by ``n``: ``(1/n) sum_r grad CE_r + sum_s d aux / d logits_s * d logits_s / d theta``,
the gradient of one process's ``mean CE + coef * aux``.

With a ``tp`` dimension each sparse block is whole on every tp rank
(:func:`plait.models.mixtral.moe_tp_plan`). Without sequence parallelism the tp ranks route
the same rows: gathering over ``G`` is enough. With it each tp rank routes a slice of its
cp chunk, so the logits are gathered over the whole ``tp x cp x dp`` mesh and each copy's
gradient scaled by ``1/t``: the block's gradients are summed over tp (the sequence region's
rule) before the average over ``G``, which would count the ``t`` slices' copies ``t`` times.

Refused, by name, when :func:`~plait.strategies.context.prepare_cp` runs (before any step):
plait's own :class:`~plait.strategies.moe.MoE` layer (its GShard groups, capacity and
auxiliary loss are per call over the tokens a rank holds: under cp a group is a chunk of a
sequence, not the sequence), and a Hugging Face-style model with a load-balancing loss but
no MoE plan (its routers are unknown, so its loss could not be made global). Expert
parallelism (a mesh with ``ep``) is another strategy (``"ep"``, or ``"ptdp"``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.comm.group import Group
from plait.strategies.context.layout import WHO
from plait.strategies.moe.layer import moe_layers
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.moe.stacked import gather_router_logits


def _whole_mesh(mesh: Any) -> Group:
    sub = mesh.submesh(*mesh.names)
    group: Group = sub.group(*sub.names)
    return group


def prepare_moe(
    model: nn.Module,
    *,
    mesh: Any,
    gradient_group: Group,
    moe_plan: MoEPlan | None,
    algorithm: str,
) -> None:
    """Refuse what cp cannot make exact in ``model``'s MoE blocks; for a model whose MoE
    plan names routers, gather their logits for its auxiliary loss (module docstring).
    Local: registers hooks (their collectives run in training forwards with the loss on)."""
    own = moe_layers(model)
    if own:
        name = next(iter(own))
        raise ValueError(
            f"{WHO}: {name!r} is plait's MoE layer, whose GShard groups, capacity and "
            f"auxiliary loss are computed over the tokens one call sees (under cp a chunk of "
            f"each sequence, not the sequence), so it would train on different numbers; use "
            f"strategy 'ep' for it, or a Hugging Face MoE model (Mixtral, Qwen-MoE) under cp"
        )
    if moe_plan is None or not moe_plan.routers:
        loss_coef = next(
            (n for n, m in model.named_modules() if hasattr(m, "router_aux_loss_coef")), None
        )
        if loss_coef is not None:
            raise ValueError(
                f"{WHO}: {type(model).__name__} has a router auxiliary loss "
                f"(router_aux_loss_coef) but no MoE plan naming its routers, so that loss "
                f"would be each rank's, not the batch's; pass "
                f"moe_plan=plait.models.plans.plan_for(model, 'moe') (or your MoEPlan with "
                f"routers=...), or use plait.prepare(strategy='cp'), which does"
            )
        return
    tp = mesh.size("tp") if "tp" in getattr(mesh, "names", ()) else 1
    tensor = getattr(model, "plait_tensor_parallel", None)  # what prepare_tp set
    if tp > 1 and tensor is not None and tensor.sequence_parallel:
        gather_router_logits(
            model,
            moe_plan,
            group=_whole_mesh(mesh),
            algorithm=algorithm,
            gradient_scale=1.0 / tp,
            who=WHO,
        )
    else:
        gather_router_logits(model, moe_plan, group=gradient_group, algorithm=algorithm, who=WHO)


__all__ = ["prepare_moe"]
