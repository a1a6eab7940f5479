"""An MoE-block plan inferred for models no family knows, where that is safe.

Hugging Face 5.x MoE families share one layout for their experts (Mixtral, Qwen-MoE, OLMoE,
DeepSeek-V3, ...): a container holding every expert's ``gate_up_proj [E, 2I, d]`` and
``down_proj [E, d, I]`` stacked on dimension 0, with an integer attribute holding ``E``,
called by its block as ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])``.
:func:`infer_moe_plan` finds such containers by their parameters, and proves on each class
of them, in float64 on random tokens and random choices, that the container's own forward
equals ``sum_k w_k * down_proj[e_k] (act(g) * u)`` with ``[g; u] = gate_up_proj[e_k] x``
(Mixtral's :func:`~plait.models.mixtral.run_stacked_expert`, which expert parallelism runs
on the rank holding each expert). The routers (a sibling of the container holding a
``[E, d]`` weight whose output is a tuple, the logits first) are named for the
load-balancing loss when the model computes one.

Not inferred (refused naming the container): experts that compute anything else (GPT-OSS:
biases, interleaved gate and up, a clamp, its own activation), experts as a list of modules
(Hugging Face 4.x), containers without their expert count.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from plait.models.infer import PlanInferenceError
from plait.models.mixtral import _MASKED, _aux_loss_on, run_stacked_expert
from plait.strategies.moe.plan import MoEPlan

STACKED = ("gate_up_proj", "down_proj")
COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")
TOLERANCE = 1e-9


def refuse(model: nn.Module, why: str) -> PlanInferenceError:
    return PlanInferenceError(
        f"strategy 'ep' needs an MoE plan for a {type(model).__name__}: none is known for its "
        f"family and none can be inferred safely: {why}. Write a "
        f"plait.strategies.moe.MoEPlan (experts=, stacked=, run_expert=, routers=) and give "
        f"the model a method plait_plan(kind, **options) returning it for kind 'moe'"
    )


def _count(module: nn.Module) -> str | None:
    """The attribute holding the number of experts of a stacked container, or None."""
    weight = getattr(module, STACKED[0], None)
    if not isinstance(weight, torch.Tensor):
        return None
    for name in COUNT_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and value == weight.shape[0]:
            return name
    return None


def containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding stacked experts (3-D ``gate_up_proj`` and ``down_proj``)."""
    out = []
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if all(k in params and params[k].dim() == 3 for k in STACKED):
            out.append((name, module))
    return out


def _prove(model: nn.Module, name: str, box: nn.Module) -> None:
    dense = copy.deepcopy(box).to(torch.float64)
    experts, two_i, d = dense.gate_up_proj.shape  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    tokens, k = 6, min(2, experts)
    x = torch.randn(tokens, d, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = dense(x, index, weights)
            want = torch.zeros_like(x)
            for t in range(tokens):
                for j in range(k):
                    row = run_stacked_expert(dense, int(index[t, j]), x[t : t + 1])
                    want[t] += weights[t, j] * row[0]
    except Exception as exc:  # noqa: BLE001 - any failure: not this layout
        raise refuse(
            model,
            f"experts '{name}' ({type(box).__name__}) do not run as "
            f"experts(hidden, top_k_index, top_k_weights) with gate_up_proj [E, 2I, d] and "
            f"down_proj [E, d, I] ({type(exc).__name__}: {exc})",
        ) from exc
    err = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    if err > TOLERANCE:
        raise refuse(
            model,
            f"experts '{name}' ({type(box).__name__}) compute something else than "
            f"down_proj[e] (act(gate) * up) with [gate; up] = gate_up_proj[e] x (relative "
            f"difference {err:.1e}: biases, interleaved gate and up, a clamp?)",
        )


def _router(model: nn.Module, name: str, box: nn.Module, count: int) -> str | None:
    """The class of the sibling router whose output is a tuple with the logits first."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    for child in parent.children():
        weight = getattr(child, "weight", None)
        if child is box or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if weight.shape[0] != count:
            continue
        x = torch.zeros(3, weight.shape[1], dtype=weight.dtype, device=weight.device)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = copy.deepcopy(child)(x)
        except Exception:  # noqa: BLE001 - not a router taking hidden states
            continue
        if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            if tuple(out[0].shape) == (3, count):
                return type(child).__name__
    return None


def infer_moe_plan(model: nn.Module) -> MoEPlan | None:
    """The MoE plan of ``model`` (module doc), None when it holds no stacked experts, or
    :class:`PlanInferenceError` naming the container that does not fit."""
    found = containers(model)
    if not found:
        return None
    classes: dict[str, str] = {}
    routers: set[str] = set()
    for name, box in found:
        count = _count(box)
        if count is None:
            raise refuse(
                model,
                f"experts '{name}' ({type(box).__name__}) hold no attribute naming their "
                f"number ({', '.join(COUNT_NAMES)})",
            )
        if type(box).__name__ not in classes:
            _prove(model, name, box)
        classes.setdefault(type(box).__name__, count)
        router = _router(model, name, box, getattr(box, count))
        if router is not None:
            routers.add(router)
    if len(set(classes.values())) != 1:
        raise refuse(model, f"its expert containers name their count differently: {classes}")
    return MoEPlan(
        experts=tuple(classes),
        stacked=STACKED,
        run_expert=run_stacked_expert,
        num_experts=next(iter(classes.values())),
        routers=tuple(sorted(routers)),
        logits_index=0,
        aux_loss_on=_aux_loss_on,
        refuse_kwargs=(("attention_mask", _MASKED),),
    )


__all__: list[Any] = ["infer_moe_plan", "containers"]
