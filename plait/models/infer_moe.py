"""An MoE-block plan inferred for models no family knows, where that is safe.

Hugging Face 5.x MoE families share one layout for their experts (Mixtral, Qwen-MoE, OLMoE,
DeepSeek-V3, GPT-OSS, ...): a container holding every expert's weights stacked on dimension
0 (3-D ``gate_up_proj``, ``down_proj``, and biases where the family has them), with an
integer attribute holding ``E``, called by its block as
``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``.
:func:`infer_moe_plan` finds such containers by their parameters, and proves on each class
of them, in float64 on random tokens and random choices, that the container's own forward
is ``sum_k w_k * expert_{e_k}(x)`` for one of two ways to run expert ``e`` alone:

- Mixtral's :func:`~plait.models.mixtral.run_stacked_expert` (``down_proj[e] (act(g) * u)``
  with ``[g; u] = gate_up_proj[e] x``), the fast one;
- the container's own class forward with every row routed to ``e`` at weight 1
  (:func:`run_own_expert`: GPT-OSS's biases, interleaved gate and up, clamp and activation
  kept as the family wrote them).

Expert parallelism runs it on the rank holding expert ``e``, over the stacked weights it
keeps (every parameter of the container, sliced on dimension 0). The routers (a sibling of
the container holding an ``[E, d]`` weight whose output is a tuple, the logits first) are
named for the load-balancing loss when the model computes one.

Not inferred (refused naming the container): experts whose forward is not such a weighted
sum (a capacity, a shared state across experts), parameters not stacked by expert, experts
as a list of modules (Hugging Face 4.x), containers without their expert count.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from plait.models.infer import PlanInferenceError
from plait.models.mixtral import _MASKED, _aux_loss_on, run_stacked_expert
from plait.strategies.moe.plan import MoEPlan

COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")
TOLERANCE = 1e-9


def refuse(model: nn.Module, why: str) -> PlanInferenceError:
    return PlanInferenceError(
        f"strategy 'ep' needs an MoE plan for a {type(model).__name__}: none is known for its "
        f"family and none can be inferred safely: {why}. Write a "
        f"plait.strategies.moe.MoEPlan (experts=, stacked=, run_expert=, routers=) and give "
        f"the model a method plait_plan(kind, **options) returning it for kind 'moe'"
    )


def run_own_expert(box: nn.Module, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a stacked container on ``rows [n, d]``, by the container's own class
    forward (not the expert-parallel one set on the instance) with every row routed to
    ``e`` at weight 1."""
    index = torch.full((rows.shape[0], 1), e, dtype=torch.long, device=rows.device)
    weights = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return type(box).forward(box, rows, index, weights)  # type: ignore[no-any-return]


def _count(module: nn.Module) -> str | None:
    """The attribute holding the number of experts of a stacked container, or None."""
    stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    for name in COUNT_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and stacked and value == stacked[0].shape[0]:
            return name
    return None


def containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding stacked experts: at least two 3-D parameters of their own."""
    out = []
    for name, module in model.named_modules():
        if sum(p.dim() == 3 for p in module.parameters(recurse=False)) >= 2:
            out.append((name, module))
    return out


def _error(model: nn.Module, name: str, box: nn.Module, run: Any) -> float:
    """How far ``run`` (expert ``e`` alone) summed by the routing is from the container's
    own forward, relative to its largest value (inf: it does not run)."""
    dense = copy.deepcopy(box).to(torch.float64)
    experts = getattr(dense, _count(box) or "")
    # the hidden width is one of the stacked weights' other dimensions: each is tried
    cubes = [p for p in dense.parameters(recurse=False) if p.dim() == 3]
    widths = sorted({int(n) for p in cubes for n in p.shape[1:]})
    g = torch.Generator().manual_seed(0)
    tokens, k = 6, min(2, experts)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    errors = []
    for width in widths:
        x = torch.randn(tokens, width, generator=g, dtype=torch.float64)
        try:
            with torch.no_grad():
                got = type(dense).forward(dense, x, index, weights)
                want = torch.zeros_like(got)
                for t in range(tokens):
                    for j in range(k):
                        want[t] += weights[t, j] * run(dense, int(index[t, j]), x[t : t + 1])[0]
        except Exception:  # noqa: BLE001 - not this width, or not this way
            continue
        errors.append(float((got - want).abs().max()) / (float(want.abs().max()) or 1.0))
    return min(errors, default=float("inf"))


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
    counts: dict[str, str] = {}
    stacked: dict[str, tuple[str, ...]] = {}
    runs: dict[str, Any] = {}
    routers: set[str] = set()
    for name, box in found:
        kind = type(box).__name__
        count = _count(box)
        if count is None:
            raise refuse(
                model,
                f"experts '{name}' ({kind}) hold no attribute naming their number "
                f"({', '.join(COUNT_NAMES)}) equal to their weights' first dimension",
            )
        E = getattr(box, count)
        own = dict(box.named_parameters(recurse=False))
        loose = [n for n, p in own.items() if p.dim() == 0 or p.shape[0] != E]
        if loose:
            raise refuse(
                model, f"parameter '{name}.{loose[0]}' of the experts is not stacked by expert"
            )
        if kind not in runs:
            for run in (run_stacked_expert, run_own_expert):
                if _error(model, name, box, run) <= TOLERANCE:
                    runs[kind] = run
                    break
            else:
                raise refuse(
                    model,
                    f"experts '{name}' ({kind}) are not a weighted sum of one expert per "
                    f"choice, experts(hidden, top_k_index, top_k_weights), as far as running "
                    f"them alone shows",
                )
        counts[kind], stacked[kind] = count, tuple(own)
        router = _router(model, name, box, E)
        if router is not None:
            routers.add(router)
    if len(set(counts.values())) != 1 or len(set(stacked.values())) != 1:
        raise refuse(model, f"its expert containers differ: {sorted(counts)}")
    if len(set(runs.values())) != 1:
        raise refuse(model, f"its expert containers run differently: {sorted(runs)}")
    return MoEPlan(
        experts=tuple(counts),
        stacked=next(iter(stacked.values())),
        run_expert=next(iter(runs.values())),
        num_experts=next(iter(counts.values())),
        routers=tuple(sorted(routers)),
        logits_index=0,
        aux_loss_on=_aux_loss_on,
        refuse_kwargs=(("attention_mask", _MASKED),),
    )


__all__ = ["containers", "infer_moe_plan", "run_own_expert"]
