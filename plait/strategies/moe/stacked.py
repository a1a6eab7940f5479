"""Expert parallelism on a model's own MoE blocks whose experts are stored as stacked weights
(Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE), described by a
:class:`~plait.strategies.moe.plan.MoEPlan`.

The model's own block runs unchanged around its expert container: its router chooses the
top-k experts of every token and their weights (softmax, top-k, renormalisation as the model
does it), a shared expert and its gate are added by the block. Only the container's forward
is replaced by dispatch -> this rank's experts -> combine
(:func:`~plait.strategies.moe.dispatch.run_experts`): routing is dropless (every choice is
kept, as the models do), so the ranks first exchange how many rows each expert gets.

Communication contract, per expert container per forward, on the ``ep`` group ``P``:

=====================  =============================================  ====================
step                   forward                                        backward
=====================  =============================================  ====================
counts                 all-gather of ``E`` int64 per rank             none
dispatch               all-to-all (uneven) of the chosen rows         the reverse all-to-all
combine                the reverse all-to-all of the expert outputs   all-to-all (as dispatch)
=====================  =============================================  ====================

and, in training when the model's auxiliary loss is on, per router on the batch group ``B``
(``dp x ep``, every rank with its own data): an all-gather of the row counts and an uneven
all-to-all that gives every rank the router logits of all ranks in batch-slice order
(backward: the reverse all-to-all; the copies' gradients add up, which is the all-gather's
reduce-scatter), so the auxiliary loss is the global batch's.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.moe import dispatch as moe_dispatch
from plait.strategies.moe.plan import MoEPlan, matches


@dataclass
class StackedExperts:
    """What expert parallelism set on one expert container (``container.plait_ep``)."""

    name: str
    num_experts: int
    first: int
    local: int
    group: Group
    algorithm: str
    stacked: tuple[str, ...] = ()  # the container's tensors holding experts first..first+local


def containers(model: nn.Module, plan: MoEPlan) -> dict[str, nn.Module]:
    """The expert containers of ``model`` named by ``plan``, by module path."""
    return {n: m for n, m in model.named_modules() if matches(m, plan.experts)}


def split(
    model: nn.Module, plan: MoEPlan, *, group: Group, algorithm: str
) -> dict[int, nn.Parameter]:
    """Keep this rank's ``E/p`` experts of every container of ``plan`` (slices of the stacked
    weights, values kept) and route the container through ``group``. In place, local.
    Returns ``{id(old parameter): new parameter}`` (to rebuild optimizer groups)."""
    found = containers(model, plan)
    if not found:
        raise ValueError(
            f"expert_parallel: {type(model).__name__} has no module of class "
            f"{' / '.join(plan.experts)} (the expert containers its MoE plan names); pass "
            f"plan=MoEPlan(experts=(<your experts class name>,), ...) that matches the model"
        )
    p, r = group.size, group.rank
    replaced: dict[int, nn.Parameter] = {}
    for name, box in found.items():
        if hasattr(box, "plait_ep"):
            raise ValueError(f"expert_parallel: {name!r} is already expert-parallel")
        E = getattr(box, plan.num_experts, None)
        if not isinstance(E, int):
            raise ValueError(
                f"expert_parallel: {name!r} ({type(box).__name__}) has no integer attribute "
                f"{plan.num_experts!r} holding its number of experts; set MoEPlan(num_experts=...)"
            )
        if E % p:
            raise ValueError(
                f"expert_parallel: {name!r} has num_experts={E}, not divisible by the "
                f"expert-parallel size ep={p}; choose ep dividing {E}"
            )
        local = E // p
        for pname in plan.stacked:
            old = getattr(box, pname, None)
            if not isinstance(old, nn.Parameter) or old.dim() < 1 or old.shape[0] != E:
                got = tuple(old.shape) if isinstance(old, torch.Tensor) else type(old).__name__
                raise ValueError(
                    f"expert_parallel: {name}.{pname} must be a parameter stacking the {E} "
                    f"experts on dimension 0; got {got}"
                )
            new = nn.Parameter(
                old.detach()[r * local : (r + 1) * local].clone(), requires_grad=old.requires_grad
            )
            setattr(box, pname, new)
            replaced[id(old)] = new
        info = StackedExperts(name, E, r * local, local, group, algorithm, tuple(plan.stacked))
        object.__setattr__(box, "plait_ep", info)
        box.forward = types.MethodType(_forward_of(plan, info), box)  # type: ignore[method-assign]
    return replaced


def _forward_of(plan: MoEPlan, info: StackedExperts) -> Any:
    def forward(
        box: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        moe_dispatch.refuse_meta(hidden, f"expert parallelism on {type(box).__name__}")
        flat = hidden.reshape(-1, hidden.shape[-1])
        chosen = moe_dispatch.plan_top_k(
            top_k_index.reshape(flat.shape[0], -1),
            top_k_weights.reshape(flat.shape[0], -1),
            info.num_experts,
        )
        counts = moe_dispatch.gather_counts(chosen.counts, info.group)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return plan.run_expert(box, e - info.first, rows)

        out = moe_dispatch.run_experts(
            flat, chosen, expert, counts=counts, group=info.group, algorithm=info.algorithm
        )
        return out.reshape(hidden.shape)

    return forward


def gather_rows(x: torch.Tensor, group: Group, algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``x`` rows, concatenated in rank order (sizes may differ), on every rank
    of ``group``; differentiable (the copies' gradients add up on their owner). Collective:
    an all-gather of one count, then one uneven all-to-all."""
    n = group.size
    sizes = moe_dispatch.gather_counts([x.shape[0]], group)[:, 0].tolist()
    flat = x.reshape(x.shape[0], -1)
    out = moe_dispatch.all_to_all_rows(
        torch.cat([flat] * n), [x.shape[0]] * n, sizes, group=group, algorithm=algorithm
    )
    return out.reshape(sum(sizes), *x.shape[1:])


@dataclass
class _AuxState:
    gather: bool = False


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def gather_router_logits(
    model: nn.Module,
    plan: MoEPlan,
    *,
    group: Group,
    algorithm: str,
    replicated_loss: bool = False,
    gradient_scale: float | None = None,
    who: str = "expert parallelism",
) -> None:
    """Make the router logits that ``model``'s auxiliary loss reads those of the global
    batch (module docstring), in training forwards where ``plan.aux_loss_on`` says the loss
    is computed. Registers hooks; collective in every such forward.

    ``replicated_loss``: every rank of ``group`` computes the same loss from the gathered
    logits (tensor parallelism with sequence parallelism, each rank's router seeing its
    slice of the sequence), so the ``n`` copies of a rank's logits' gradient are averaged,
    not summed. ``gradient_scale``: the factor on each copy's gradient in general (default
    1, or ``1/n`` with ``replicated_loss``; context parallelism with tensor and sequence
    parallelism gathers over ``tp x cp x dp`` and scales by ``1/tp``:
    :mod:`plait.strategies.context.moe`). ``who``: the strategy named in refusals. The
    auxiliary losses these models compute are means over the rows, so the gathered rows'
    order (rank-major, not one process's row-major) does not change them."""
    if gradient_scale is None:
        gradient_scale = 1.0 / group.size if replicated_loss else 1.0
    if not plan.routers or group.size == 1:
        return
    state = _AuxState()
    signature = inspect.signature(model.forward)

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            named = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            named = dict(kwargs)
        extra = named.pop("kwargs", None)
        if isinstance(extra, dict):
            named.update(extra)
        on = plan.aux_loss_on(module, named) if plan.aux_loss_on is not None else True
        state.gather = bool(on) and module.training and torch.is_grad_enabled()
        if not state.gather:
            return
        for key, why in plan.refuse_kwargs:
            if named.get(key) is not None:
                raise ValueError(
                    f"{who} on {type(module).__name__}: {key}= is not supported "
                    f"while the auxiliary loss is on ({why}); drop {key} (train on unpadded "
                    f"sequences) or turn the auxiliary loss off (output_router_logits=False)"
                )

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        state.gather = False

    def swap(module: nn.Module, args: Any, output: Any) -> Any:
        if not state.gather:
            return None

        def gathered(x: torch.Tensor) -> torch.Tensor:
            if gradient_scale != 1.0:
                x = _ScaleGradient.apply(x, gradient_scale)
            return gather_rows(x, group, algorithm)

        i = plan.logits_index
        if not isinstance(output, tuple):
            return gathered(output)
        return (*output[:i], gathered(output[i]), *output[i + 1 :])

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    for m in model.modules():
        if matches(m, plan.routers):
            m.register_forward_hook(swap, prepend=True)


__all__ = ["StackedExperts", "containers", "gather_router_logits", "gather_rows", "split"]
